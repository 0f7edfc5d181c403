"""miles-memory measured: the planner against the bytes the tensors hold, and the offload manager's speed.

1. **Planner validation (CPU).** The built-in policy (Qwen3 hidden 256, 4 layers, one MTP module, vocab 264) under
   the FSDP2 backend on 1 and 2 gloo ranks: after one step with `--tokens` tokens per micro-batch, each rank's bytes
   by tag counted from the tensors (the offload manager's `resident_bytes`: parameters, MTP modules, AdamW state;
   the gradients; the activations the forward saved for backward, at their most, from `ActivationMeter`), against
   `miles_memory.fsdp2_bytes` (with the deterministic attention's term for the 16-token sequences); and the embedded
   engine's `memory_bytes()` against `embedded_engine_bytes`, idle and after a request (then with the native linear's
   packed weight copies). Error = planned / measured - 1.
2. **Offload speed.** Offload + onload of that policy's trainer state (parameters and AdamW moments, one rank, after
   a step), medians of `--repeats` alternating cycles in one process: the offload manager's disk store against the
   obvious alternative, saving the same tensors with safetensors and loading them back into place.

`--architecture` plans and measures the built-in policy in another family (the planner's MLA terms:
`--architecture deepseek_v3 --repeats 0`, no offload timing).

    uv run python benchmarks/memory.py --out benchmarks/results/memory.json
    uv run python benchmarks/memory.py --architecture deepseek_v3 --repeats 0 \
        --out benchmarks/results/memory_deepseek_v3.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from host import host_info

from miles_contracts import Sample
from miles_kernels import KernelConfig, resolved_backends, save_model
from miles_kernels.testing import random_model
from miles_memory import (
    ModelShape,
    blocked_attention_elements,
    embedded_engine_bytes,
    fsdp2_bytes,
    native_attention_elements,
)
from miles_orchestrator.data.bootstrap import policy_config
from miles_trainer import BackendConfig, FSDP2Backend, OptimizerConfig, PolicyLossConfig, ensure_process_group

VOCAB = 264
SEQUENCE_LENGTH = 16
TAGS = ("weights", "grads", "optimizer", "mtp", "activations")


def samples(num_tokens: int, seed: int) -> list[Sample]:
    """Samples of SEQUENCE_LENGTH = 16 tokens (12 prompt, 4 response) filling `num_tokens` per rank."""
    generator = torch.Generator().manual_seed(seed)
    out = []
    for i in range(num_tokens // 16):
        tokens = torch.randint(0, VOCAB, (16,), generator=generator).tolist()
        out.append(Sample(index=i, group_index=i // 4, prompt="", prompt_tokens=tokens[:12],
                          response_tokens=tokens[12:], reward=float(i % 2),
                          rollout_logprobs=[-1.0] * 4))  # fmt: skip
    return out


def _rank(rank: int, world: int, model_dir: str, tokens: int, init: str, out: str) -> None:
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    torch.set_num_threads(1)
    backend = FSDP2Backend(model_dir, KernelConfig(), OptimizerConfig(lr=1e-4), PolicyLossConfig(),
                           BackendConfig(max_tokens_per_micro_batch=tokens))  # fmt: skip
    batch = samples(tokens, seed=rank)
    metrics = backend.train_step(batch, [1.0 if s.reward else -1.0 for s in batch])
    resident = backend.memory.manager.resident_bytes()
    measured = {
        "weights": resident["weights"], "mtp": resident["mtp"], "optimizer": resident["optimizer"],
        "grads": resident["grads"], "activations": backend.memory.peak_activation_bytes,
        "micro_batches": float(len(batch) * 16 / tokens), "step_peak": metrics["mem_train_peak_bytes"],
    }  # fmt: skip
    Path(out, f"rank{rank}.json").write_text(json.dumps(measured))
    dist.barrier()
    dist.destroy_process_group()


def validate_trainer(model_dir: str, shape: ModelShape, world: int, tokens: int) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as out:
        init = f"file://{out}/init"
        mp.spawn(_rank, args=(world, model_dir, tokens, init, out), nprocs=world, join=True)
        ranks = [json.loads(Path(out, f"rank{r}.json").read_text()) for r in range(world)]
    kernel = (
        KernelConfig()
    )  # deterministic: what its attention keeps beyond a fused kernel's (16-token sequences here)
    if resolved_backends(kernel)["attention"] == "native":
        extra = native_attention_elements(shape, SEQUENCE_LENGTH)
    else:
        extra = blocked_attention_elements(shape, SEQUENCE_LENGTH, kernel.attention_query_tile, kernel.page_size)
    planned = fsdp2_bytes(shape, world, "float32", tokens, attention_extra=extra)
    rows = {}
    for tag in TAGS:
        measured = statistics.mean(r[tag] for r in ranks)  # per rank (shards differ by at most a row)
        rows[tag] = {"planned": planned[tag], "measured": measured, "error": planned[tag] / measured - 1}
    return {"world": world, "tokens_per_micro_batch": tokens, "per_rank": rows,
            "planned_total": sum(planned[t] for t in TAGS),
            "measured_total": statistics.mean(sum(r[t] for t in TAGS) for r in ranks)}  # fmt: skip


def validate_engine(model_dir: str, shape: ModelShape) -> dict[str, Any]:
    """The engine's bytes by tag idle (before its first forward) and serving (after one request: the native linear's
    packed weight copies are held from the first forward on), against the planner."""
    import asyncio

    from miles_contracts import GenerateRequest, SamplingParams
    from miles_kernels import native
    from miles_rollout import Engine, EngineConfig, InProcessClient

    config = EngineConfig(num_kv_pages=256, max_running_requests=16)
    kernel = KernelConfig()
    engine = Engine(model_dir, kernel, config)
    try:
        idle = engine.memory_bytes()  # nothing allocates while it is read
        request = GenerateRequest(input_ids=[1, 2, 3], sampling_params=SamplingParams(max_new_tokens=4))
        asyncio.run(InProcessClient(engine).generate(request))
        serving = engine.memory_bytes()
    finally:
        engine.shutdown()
    width = native.panel_width() if resolved_backends(kernel)["linear"] == "native" else None
    planned = {
        "idle": embedded_engine_bytes(shape, "float32", config.num_kv_pages, kernel.page_size),
        "serving": embedded_engine_bytes(shape, "float32", config.num_kv_pages, kernel.page_size, packed_width=width),
    }
    return {
        state: {tag: {"planned": planned[state][tag], "measured": measured[tag],
                      "error": planned[state][tag] / measured[tag] - 1} for tag in ("weights", "kv_cache")}
        for state, measured in (("idle", idle), ("serving", serving))
    }  # fmt: skip


def offload_speed(model_dir: str, repeats: int) -> dict[str, Any]:
    from safetensors.torch import load_file, save_file

    ensure_process_group()  # one rank in this process
    backend = FSDP2Backend(model_dir, KernelConfig(), OptimizerConfig(lr=1e-4), PolicyLossConfig(),
                           BackendConfig(max_tokens_per_micro_batch=1024))  # fmt: skip
    batch = samples(256, seed=0)
    backend.train_step(batch, [1.0 if s.reward else -1.0 for s in batch])
    backend.offload(), backend.onload()  # warm: the store's file exists
    state = [v for s in backend.optimizer.state.values() for v in s.values() if v.dim()]
    tensors = {f"t{i}": t for i, t in enumerate([*backend.model.parameters(), *state])}
    nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
    times: dict[str, list[float]] = {"manager": [], "safetensors": []}
    with tempfile.TemporaryDirectory() as tmp:
        file = os.path.join(tmp, "state.safetensors")
        for _ in range(repeats):
            start = time.perf_counter()
            backend.offload()
            backend.onload()
            times["manager"].append(time.perf_counter() - start)
            start = time.perf_counter()
            save_file({k: v.detach() for k, v in tensors.items()}, file)
            for name, value in load_file(file).items():
                tensors[name].detach().copy_(value)
            times["safetensors"].append(time.perf_counter() - start)
    manager, baseline = statistics.median(times["manager"]), statistics.median(times["safetensors"])
    return {"state_bytes": nbytes, "repeats": repeats, "manager_ms": manager * 1e3, "safetensors_ms": baseline * 1e3,
            "speedup": baseline / manager}  # fmt: skip


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=1024, help="tokens per micro-batch (one micro-batch per rank)")
    parser.add_argument("--repeats", type=int, default=12, help="offload cycles timed (0: no offload timing)")
    parser.add_argument("--architecture", default="qwen3", help="the built-in policy's bootstrap_architecture")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        config = policy_config(VOCAB, args.architecture)
        model_dir = os.path.join(tmp, "policy")
        save_model(random_model(config, seed=0), model_dir)
        shape = ModelShape.from_hf(json.loads(Path(model_dir, "config.json").read_text()))
        result = {
            "host": host_info(),
            "command": "uv run python benchmarks/memory.py " + " ".join(sys.argv[1:]),
            "trainer": [validate_trainer(model_dir, shape, world, args.tokens) for world in (1, 2)],
            "architecture": args.architecture,
            "engine": validate_engine(model_dir, shape),
        }
        if args.repeats:
            result["offload"] = offload_speed(model_dir, args.repeats)
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
