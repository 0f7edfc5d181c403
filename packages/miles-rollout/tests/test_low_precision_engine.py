"""CPU numerics, in-process engine: a low-precision engine (`EngineConfig.weight_dtype`, docs/low-precision.md). A
full-precision checkpoint is quantized as it loads and serves exactly what an engine loaded from the quantized
checkpoint serves; quantized weight updates arrive by every path a run uses (a directory with its
`quantization_config`, buckets, a full-precision directory quantized on arrival) with the engine's checksum over the
stored parts; the engine reports its format, and its weights take fewer bytes; a released engine takes the next
update."""

from __future__ import annotations

import asyncio

import pytest
import torch

from miles_contracts import GenerateRequest, SamplingParams
from miles_kernels import (
    WeightQuantizer,
    checkpoint_tensors,
    encode_bucket,
    load_model,
    read_model_config,
    save_model,
    weights_checksum,
)
from miles_kernels.config import KernelConfig
from miles_kernels.testing import random_model
from miles_rollout import Engine, EngineConfig, InProcessClient

KERNEL = KernelConfig(page_size=16)
PROBE = GenerateRequest(
    input_ids=[[7, 8, 9, 10], [3] * 20],
    sampling_params=SamplingParams(max_new_tokens=6, temperature=1.0, sampling_seed=3),
    return_logprob=True,
)
FORMATS = {
    "fp8_block": EngineConfig(num_kv_pages=64, weight_dtype="fp8_block", weight_block_size=(32, 32)),
    "int4_group": EngineConfig(num_kv_pages=64, weight_dtype="int4_group", weight_group_size=32),
}


def served(client: InProcessClient) -> list[tuple]:
    responses = asyncio.run(client.generate(PROBE))
    return [(tuple(r.output_ids), tuple(e[0] for e in r.meta_info.output_token_logprobs)) for r in responses]


def serve(model_dir, config: EngineConfig) -> tuple[Engine, InProcessClient]:  # type: ignore[no-untyped-def]
    engine = Engine(str(model_dir), KERNEL, config)
    return engine, InProcessClient(engine)


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_a_quantized_engine_serves_the_stored_format_whichever_way_weights_arrive(dense_dir, tmp_path, fmt) -> None:
    config = FORMATS[fmt]
    weights = config.weight_quant()
    stored = load_model(str(dense_dir), KERNEL, weights=weights)
    save_model(stored, tmp_path / "quantized")  # parts + quantization_config, as the engine holds them
    expected_engine, expected_client = serve(tmp_path / "quantized", config)
    full_engine, full_client = serve(dense_dir, EngineConfig(num_kv_pages=64))
    try:
        expected = served(expected_client)
        assert expected != served(full_client)  # the format is in effect
        full_info = asyncio.run(full_client.get_server_info())
    finally:
        expected_engine.shutdown()
        full_engine.shutdown()

    engine, client = serve(dense_dir, config)  # a full-precision checkpoint, quantized as it loads
    try:
        assert served(client) == expected
        info = asyncio.run(client.get_server_info())
        assert info["weight_dtype"] == fmt
        assert info["kernel_config"]["weights"]["format"] == fmt
        assert info["kernel_config"]["fingerprint"] != full_info["kernel_config"]["fingerprint"]
        assert info["memory_bytes"]["weights"] < full_info["memory_bytes"]["weights"] / 2
        checksum = weights_checksum(checkpoint_tensors(stored, mtp_copies=False).items())
        assert asyncio.run(client.weights_checksum()) == checksum

        # a trainer's quantized sync of other weights, in buckets; then the quantized directory back, from disk
        other = random_model(read_model_config(dense_dir), KERNEL, seed=9)
        quantizer = WeightQuantizer(weights, other.trunk_linears())
        parts = dict(p for n, t in checkpoint_tensors(other, mtp_copies=False).items() for p in quantizer.parts(n, t))
        names = sorted(parts)
        halves = [names[: len(names) // 2], names[len(names) // 2 :]]
        for index, half in enumerate(halves):
            bucket = encode_bucket({n: parts[n] for n in half}, version=1, index=index, count=2)
            asyncio.run(client.update_weights_from_tensor(bucket))
        assert served(client) != expected
        assert asyncio.run(client.weights_checksum()) == weights_checksum(parts.items())
        asyncio.run(client.update_weights_from_disk(str(tmp_path / "quantized"), weight_version=2))
        assert served(client) == expected
        # released for the trainer's turn: the weights come back with the next update (here a full-precision one)
        asyncio.run(client.release_memory_occupation())
        asyncio.run(client.resume_memory_occupation())
        asyncio.run(client.update_weights_from_disk(str(dense_dir), weight_version=3))
        assert served(client) == expected and asyncio.run(client.weights_checksum()) == checksum
    finally:
        engine.shutdown()


def test_a_format_the_model_cannot_take_stops_the_start_up_naming_the_layer(dense_dir) -> None:
    with pytest.raises(ValueError, match=r"model.layers.0.self_attn.q_proj: int4_group with group_size=4096"):
        Engine(
            str(dense_dir), KERNEL, EngineConfig(num_kv_pages=64, weight_dtype="int4_group", weight_group_size=4096)
        )
    with pytest.raises(ValueError, match="LoRA adapters"):
        EngineConfig(weight_dtype="fp8_block", policy_lora={"rank": 4})
    assert torch.float8_e4m3fn  # the dtype the CPU build must have
