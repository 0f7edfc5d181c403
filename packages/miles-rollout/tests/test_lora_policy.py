"""CPU numerics, in-process engine: a LoRA RL run's engine (`EngineConfig.policy_lora`). Adapter-only weight updates
arrive by every path a run uses (a directory as the shm / disk transports write it, buckets, tensors) and are merged
into the kept base: the engine then serves exactly a model whose weights were merged by `fold_adapters`; its checksum
covers base and adapters; released weights come back with their contents (the base is never sent again)."""

from __future__ import annotations

import asyncio
import json
import shutil

import torch
from safetensors.torch import save_file

from miles_contracts import GenerateRequest, SamplingParams
from miles_kernels import (
    KernelConfig,
    add_lora,
    checkpoint_tensors,
    encode_bucket,
    fold_adapters,
    load_model,
    load_state,
    weights_checksum,
)
from miles_kernels.config import LoraConfig
from miles_kernels.testing import random_adapter
from miles_rollout import Engine, EngineConfig, InProcessClient

LORA = LoraConfig(rank=4, alpha=8, target_modules=["q_proj", "v_proj", "down_proj"])
KERNEL = KernelConfig(page_size=16)
PROBE = GenerateRequest(
    input_ids=[[7, 8, 9, 10], [3] * 20],
    sampling_params=SamplingParams(max_new_tokens=6, temperature=1.0, sampling_seed=3),
    return_logprob=True,
)


def served(client: InProcessClient) -> list[tuple]:
    responses = asyncio.run(client.generate(PROBE))
    return [(tuple(r.output_ids), tuple(e[0] for e in r.meta_info.output_token_logprobs)) for r in responses]


def test_adapter_updates_by_every_path_serve_the_merged_model(dense_dir, tmp_path) -> None:
    reference = load_model(str(dense_dir), KERNEL)
    add_lora(reference, LORA)
    adapters = random_adapter(reference, LORA, seed=5)
    load_state(reference, adapters)
    fold_adapters(reference)
    merged_dir = tmp_path / "merged"  # the merged model as a plain checkpoint: what the adapters must serve
    shutil.copytree(dense_dir, merged_dir)
    plain = load_model(str(dense_dir), KERNEL)
    with torch.no_grad():
        for name, module in reference.named_modules():
            if getattr(module, "folded", None) is not None:
                dict(plain.named_parameters())[f"{name}.weight"].copy_(module.folded)
    save_file({n: t.contiguous() for n, t in checkpoint_tensors(plain).items()}, str(merged_dir / "model.safetensors"))
    expected_engine = Engine(str(merged_dir), KERNEL, EngineConfig(num_kv_pages=64))
    try:
        expected = served(InProcessClient(expected_engine))
    finally:
        expected_engine.shutdown()

    engine = Engine(str(dense_dir), KERNEL, EngineConfig(num_kv_pages=64, policy_lora=LORA))
    client = InProcessClient(engine)
    try:
        base = served(client)  # B starts at zero: the base model
        assert base != expected
        update = tmp_path / "update"  # the shm / disk transports: the run's config.json beside the adapters only
        update.mkdir()
        shutil.copy(dense_dir / "config.json", update / "config.json")
        save_file(adapters, str(update / "model.safetensors"))
        asyncio.run(client.update_weights_from_disk(str(update), weight_version=1))
        assert served(client) == expected
        assert asyncio.run(client.weights_checksum()) == weights_checksum(
            checkpoint_tensors(reference, mtp_copies=False).items()
        )
        zero = {n: torch.zeros_like(t) if n.endswith("lora_B") else t for n, t in adapters.items()}
        asyncio.run(client.update_weights_from_tensor(encode_bucket(zero, version=2, index=0, count=1)))
        assert served(client) == base
        asyncio.run(client.update_weights_from_tensor(encode_bucket(adapters, version=3, index=0, count=1)))
        assert served(client) == expected
        # released for the trainer's turn and resumed: the base comes back as it was, the adapters with the next sync
        asyncio.run(client.release_memory_occupation())
        asyncio.run(client.resume_memory_occupation())
        asyncio.run(client.update_weights_from_tensor(encode_bucket(adapters, version=4, index=0, count=1)))
        assert served(client) == expected
        info = asyncio.run(client.get_server_info())
        assert json.dumps(info["memory_bytes"])  # reported, serializable
    finally:
        engine.shutdown()
