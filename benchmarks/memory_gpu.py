"""The memory planner against a real GPU: `torch.cuda.max_memory_allocated` of one FSDP2 train step vs the plan.

A ~0.25B-parameter Qwen3 (hidden 1024, 12 layers, vocab 32,000; random weights made here), one rank of the FSDP2
backend on the GPU with bf16 fast kernels (SDPA attention: no score matrix, the case the planner's formula
describes), one step of `--tokens` packed tokens. Measured: the allocator's peak during the step, the bytes
allocated before it, the rank's resident bytes by tag. Planned: `miles_memory.fsdp2_bytes` for the same shape,
world 1, bfloat16, the same tokens. Error = planned / measured − 1 (the target: within 10%).
`--device cpu` is a dry run of the script itself (no allocator peak there).

    uv run python benchmarks/memory_gpu.py --out benchmarks/results/memory_gpu.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from host import host_info

from miles_contracts import Sample
from miles_kernels import KernelConfig, save_model
from miles_kernels.testing import random_model, tiny_config
from miles_memory import ModelShape, fsdp2_bytes
from miles_trainer import BackendConfig, FSDP2Backend, OptimizerConfig, PolicyLossConfig

VOCAB = 32000


def model_config() -> Any:
    return tiny_config(
        "dense", vocab_size=VOCAB, hidden_size=1024, intermediate_size=3072, num_hidden_layers=12,
        num_attention_heads=16, num_key_value_heads=8, head_dim=64, max_position_embeddings=4096,
    )  # fmt: skip


def batch(tokens: int, length: int) -> list[Sample]:
    generator = torch.Generator().manual_seed(0)
    out = []
    for i in range(tokens // length):
        ids = torch.randint(0, VOCAB, (length,), generator=generator).tolist()
        half = length // 2
        out.append(Sample(index=i, group_index=i, prompt="", prompt_tokens=ids[:half], response_tokens=ids[half:],
                          reward=float(i % 2), rollout_logprobs=[-1.0] * (length - half)))  # fmt: skip
    return out


def measure(device: str, tokens: int, length: int, checkpointing: bool) -> dict[str, Any]:
    if not dist.is_initialized():
        store = dist.HashStore()  # type: ignore[attr-defined]
        dist.init_process_group("cpu:gloo,cuda:nccl" if device == "cuda" else "gloo", store=store, rank=0,
                                world_size=1)  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = os.path.join(tmp, "model")
        save_model(random_model(model_config(), seed=0), model_dir)
        shape = ModelShape.from_hf(json.loads(Path(model_dir, "config.json").read_text()))
        kernel = KernelConfig(mode="fast", dtype="bfloat16")
        backend = FSDP2Backend(model_dir, kernel, OptimizerConfig(lr=1e-5), PolicyLossConfig(),
                               BackendConfig(max_tokens_per_micro_batch=tokens, device=device,
                                           activation_checkpointing=checkpointing))  # fmt: skip
    samples = batch(tokens, length)
    advantages = [1.0 if s.reward else -1.0 for s in samples]
    backend.train_step(samples, advantages)  # the first step creates the AdamW state
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
    metrics = backend.train_step(samples, advantages)
    peak = torch.cuda.max_memory_allocated() if device == "cuda" else None
    planned = fsdp2_bytes(shape, 1, "bfloat16", tokens, recompute="full" if checkpointing else "none")
    planned_peak = sum(planned[t] for t in ("weights", "grads", "optimizer", "mtp", "gathered", "activations"))
    resident = backend.memory.manager.resident_bytes()
    out: dict[str, Any] = {
        "tokens": tokens, "sequence_length": length, "activation_checkpointing": checkpointing,
        "planned": planned, "planned_step_peak": planned_peak, "resident_by_tag": resident,
        "activation_peak_saved_bytes": metrics["mem_train_activation_peak_bytes"],
    }  # fmt: skip
    if peak is not None:
        out |= {"allocated_before_step": before, "max_memory_allocated": peak, "error": planned_peak / peak - 1}
    dist.destroy_process_group()
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--sequence-length", type=int, default=1024)
    parser.add_argument(
        "--checkpointing",
        choices=["off", "on", "both"],
        default="both",
        help="activation checkpointing of the measured step; run one per process for a clean peak",
    )
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        print("no CUDA device: use --device cpu for a dry run", file=sys.stderr)
        return 2
    modes = {"off": [False], "on": [True], "both": [False, True]}[args.checkpointing]
    runs = [measure(args.device, args.tokens, args.sequence_length, ckpt) for ckpt in modes]
    result = {
        "device": torch.cuda.get_device_name(0) if args.device == "cuda" else "cpu (dry run)",
        "host": host_info(),
        "torch": torch.__version__, "command": "uv run python benchmarks/memory_gpu.py " + " ".join(sys.argv[1:]),
        "runs": runs,
    }  # fmt: skip
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
