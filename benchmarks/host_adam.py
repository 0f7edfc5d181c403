"""The host-memory AdamW (`trainer.optimizer.offload`, miles_trainer.host_adam) beside torch's fused AdamW, as JSON.

One optimizer step over a model's worth of float32 parameters with gradients, side by side in one process: torch's
`AdamW(fused=True)` with its moments beside the parameters (the default), and `HostAdamW` with its moments in host
memory, float32 and bfloat16, its chunks staged through the pinned slots (a device's path: download, CPU step,
upload) and in place (`moments_and_master`, the parameters already in host memory). Per variant: the median step time
over `--repeats` steps after a warm-up, its ratio to the fused AdamW's, the optimizer's bytes on the device and in host
memory, and whether the parameters after the steps equal the fused AdamW's bit for bit (float32 moments) or how far
they are (bfloat16). On a CUDA machine the parameters live on the GPU (`--device cuda`); on a CPU the "device" is the
host, so the staged path measures the cost of the extra copies and the chunking alone, not of a PCIe bus.

    uv run python benchmarks/host_adam.py --out benchmarks/results/host_adam.json     # 100M params, ~3 min
    uv run python benchmarks/host_adam.py --params 1e7 --repeats 3 --out /tmp/h.json  # a quick check
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from typing import Any

import torch
from host import host_info, write_results

from miles_trainer.host_adam import HostAdamW

HYPER = {"lr": 1e-4, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.01}
SHAPES = [(1024, 1024), (1024, 2816), (2816, 1024), (1024,)]  # a small decoder layer's matrices and a norm (6.8M)


def model_params(total: int, device: str) -> list[torch.Tensor]:
    """Tensors of decoder-layer shapes summing to about `total` elements."""
    shapes: list[tuple[int, ...]] = []
    while sum(torch.Size(s).numel() for s in shapes) < total:
        shapes += SHAPES
    generator = torch.Generator().manual_seed(0)
    return [torch.randn(*s, generator=generator).to(device) for s in shapes]


def timed(make: Any, params0: list[torch.Tensor], grads: list[torch.Tensor], repeats: int, device: str
          ) -> tuple[float, list[torch.Tensor], torch.optim.Optimizer]:  # fmt: skip
    params = [torch.nn.Parameter(p.clone()) for p in params0]
    for p, g in zip(params, grads, strict=True):
        p.grad = g
    optimizer = make(params)
    optimizer.step()  # warm-up: the state is allocated
    times = []
    for _ in range(repeats):
        if device == "cuda":
            torch.cuda.synchronize()
        began = time.perf_counter()
        optimizer.step()
        if device == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - began)
    return statistics.median(times), params, optimizer


def state_bytes(optimizer: torch.optim.Optimizer) -> dict[str, int]:
    out = {"device": 0, "host": 0}
    for state in optimizer.state.values():
        for value in state.values():
            if isinstance(value, torch.Tensor):
                out["host" if value.device.type == "cpu" else "device"] += value.numel() * value.element_size()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="benchmarks/results/host_adam.json")
    parser.add_argument("--params", type=float, default=1e8, help="float32 parameters stepped")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--chunk-mb", type=int, default=32)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args()
    began = time.perf_counter()
    device = args.device
    params0 = model_params(int(args.params), device)
    generator = torch.Generator().manual_seed(1)
    grads = [torch.randn(p.shape, generator=generator).to(device) for p in params0]
    numel = sum(p.numel() for p in params0)
    chunk = args.chunk_mb << 20
    variants: dict[str, Any] = {
        "fused_adamw": lambda ps: torch.optim.AdamW(ps, fused=True, **HYPER),
        "host_float32_staged": lambda ps: HostAdamW(ps, chunk_bytes=chunk, staging=True, **HYPER),
        "host_bfloat16_staged": lambda ps: HostAdamW(
            ps, chunk_bytes=chunk, staging=True, moments_dtype="bfloat16", **HYPER
        ),
    }
    if device == "cpu":  # moments_and_master: the shards are in host memory already, stepped in place
        variants["host_float32_in_place"] = lambda ps: HostAdamW(ps, chunk_bytes=chunk, staging=False, **HYPER)
        variants["host_bfloat16_in_place"] = lambda ps: HostAdamW(ps, chunk_bytes=chunk, staging=False,
                                                                  moments_dtype="bfloat16", **HYPER)  # fmt: skip
    results: dict[str, Any] = {}
    reference: list[torch.Tensor] | None = None
    for name, make in variants.items():
        seconds, params, optimizer = timed(make, params0, grads, args.repeats, device)
        row: dict[str, Any] = {"median_step_s": round(seconds, 4), **state_bytes(optimizer)}
        row["state_bytes_per_param"] = {k: round(v / numel, 3) for k, v in state_bytes(optimizer).items()}
        if reference is None:
            reference = [p.detach().cpu() for p in params]
        else:
            diffs = [(p.detach().cpu() - r).abs().max().item() for p, r in zip(params, reference, strict=True)]
            row["max_abs_diff_vs_fused"] = max(diffs)
            pairs = zip(params, reference, strict=True)
            row["bitwise_equal_to_fused"] = all(torch.equal(p.detach().cpu(), r) for p, r in pairs)
        results[name] = row
        print(name, row, flush=True)
        del params, optimizer
    base = results["fused_adamw"]["median_step_s"]
    for row in results.values():
        row["time_ratio_vs_fused"] = round(row["median_step_s"] / base, 3)
    write_results(args.out, {
        "script_command": " ".join(["python", *sys.argv]),
        "host": host_info(),
        "device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
        "num_params": numel,
        "chunk_mb": args.chunk_mb,
        "repeats": args.repeats,
        "variants": results,
    }, began)  # fmt: skip


if __name__ == "__main__":
    main()
