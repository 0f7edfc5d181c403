"""Benchmark: `torch.compile` (Inductor, CPU) on the non-GEMM chains of Miles' decoder layer, against eager.

The question it answers: should the batch-invariant ops that are not GEMMs (RMSNorm, the SiLU gate, RoPE, the
residual add + RMSNorm) run compiled on the CPU? Each chain is Miles' own op (`miles_kernels.ops`), compiled with
`fullgraph=True` (a graph break is an error, never a silent fall-back) and `dynamic=True` (a new number of rows must
not recompile), at the vs-TRL policy's shapes (hidden 256, 8 / 4 heads of 32, intermediate 768) for a decode batch
(64 rows) and a train batch (512 rows). Measured in this one process, eager and compiled side by side:
- the first call's wall time (tracing + Inductor codegen + the C++ build; `--fresh-cache` empties Inductor's cache
  first, so the first chain also pays the cold build) and the one-time import of torch._dynamo / Inductor;
- the median time per call, forward only and forward + backward (AOTAutograd compiles the backward);
- whether the compiled forward equals eager bit for bit, and whether it is batch-invariant on its own (rows computed
  alone vs among M rows, M = 2, 3, 17, 64, 300), with the number of recompiles over those M.

    uv run python benchmarks/compile_probe.py --out benchmarks/results/compile_probe.json
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
from host import host_info

from miles_kernels.ops.activation import silu
from miles_kernels.ops.norm import rms_norm
from miles_kernels.ops.rope import apply_rope, inv_frequencies, rope_cos_sin

HIDDEN, HEADS, HEAD_DIM, INTERMEDIATE, EPS = 256, 8, 32, 768, 1e-6


def rmsnorm_chain(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return rms_norm(x, weight, EPS)


def residual_rmsnorm_chain(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return rms_norm(x + residual, weight, EPS)


def silu_gate_chain(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return silu(gate) * up


def rope_chain(q: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    cos, sin = rope_cos_sin(positions, inv_frequencies(HEAD_DIM, 10_000.0), q.dtype)
    return apply_rope(q.view(q.shape[0], HEADS, HEAD_DIM), cos, sin).view(q.shape[0], -1)


def inputs(name: str, rows: int, generator: torch.Generator, grad: bool) -> list[torch.Tensor]:
    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=generator).requires_grad_(grad)

    if name == "rmsnorm":
        return [randn(rows, HIDDEN), (1 + 0.1 * torch.randn(HIDDEN, generator=generator)).requires_grad_(grad)]
    if name == "residual_rmsnorm":
        return [randn(rows, HIDDEN), randn(rows, HIDDEN), torch.ones(HIDDEN).requires_grad_(grad)]
    if name == "silu_gate":
        return [randn(rows, INTERMEDIATE), randn(rows, INTERMEDIATE)]
    return [randn(rows, HEADS * HEAD_DIM), torch.arange(rows) % 97]


CHAINS: dict[str, Callable[..., torch.Tensor]] = {
    "rmsnorm": rmsnorm_chain,
    "residual_rmsnorm": residual_rmsnorm_chain,
    "silu_gate": silu_gate_chain,
    "rope": rope_chain,
}


# How many of a chain's leading inputs have one row per token (the rest are weights).
ROW_INPUTS = {"rmsnorm": 1, "residual_rmsnorm": 2, "silu_gate": 2, "rope": 2}


def median_us(fn: Callable[[], object], repeats: int) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e6


def probe(name: str, fn: Callable[..., torch.Tensor], repeats: int) -> dict[str, object]:
    import torch._dynamo

    generator = torch.Generator().manual_seed(0)
    compiled = torch.compile(fn, fullgraph=True, dynamic=True)
    result: dict[str, object] = {}
    args = inputs(name, 64, generator, grad=False)
    start = time.perf_counter()
    compiled(*args)
    result["first_call_s"] = round(time.perf_counter() - start, 2)
    for label, rows in (("decode_64_rows", 64), ("train_512_rows", 512)):
        args = inputs(name, rows, generator, grad=False)
        eager_us = median_us(lambda a=args: fn(*a), repeats)
        compiled_us = median_us(lambda a=args: compiled(*a), repeats)
        grad_args = inputs(name, rows, generator, grad=True)

        def step(f: Callable[..., torch.Tensor], a: list[torch.Tensor] = grad_args) -> None:
            f(*a).sum().backward()

        start = time.perf_counter()
        step(compiled)
        backward_first_s = time.perf_counter() - start
        result[label] = {
            "forward_eager_us": round(eager_us, 1),
            "forward_compiled_us": round(compiled_us, 1),
            "forward_compiled_over_eager": round(compiled_us / eager_us, 2),
            "forward_backward_eager_us": round(median_us(lambda: step(fn), repeats), 1),
            "forward_backward_compiled_us": round(median_us(lambda: step(compiled), repeats), 1),
            "backward_first_call_s": round(backward_first_s, 2),
            "compiled_equals_eager_bitwise": bool(torch.equal(compiled(*args), fn(*args))),
        }
    big = inputs(name, 300, generator, grad=False)
    full = compiled(*big)
    compiles_before = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    invariant = True
    for rows in (1, 2, 3, 17, 64):
        part = compiled(*[t[:rows] if i < ROW_INPUTS[name] else t for i, t in enumerate(big)])
        invariant &= bool(torch.equal(part, full[:rows]))
    result["batch_invariant_rows_1_to_300"] = invariant
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    result["graphs_compiled_for_new_row_counts"] = graphs - compiles_before
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="benchmarks/results/compile_probe.json")
    parser.add_argument("--repeats", type=int, default=200)
    parser.add_argument("--fresh-cache", action="store_true", help="start from an empty Inductor cache")
    args = parser.parse_args()
    cache = None
    if args.fresh_cache:
        cache = tempfile.mkdtemp(prefix="inductor-")
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = cache
    start = time.perf_counter()
    import torch._dynamo
    import torch._inductor.compile_fx

    import_s = time.perf_counter() - start
    results: dict[str, object] = {
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "cpu_count": os.cpu_count(),
        "host": host_info(),
        "fresh_inductor_cache": args.fresh_cache,
        "import_dynamo_inductor_s": round(import_s, 2),
        "shapes": {"hidden": HIDDEN, "heads": HEADS, "head_dim": HEAD_DIM, "intermediate": INTERMEDIATE},
        "compile_options": {"fullgraph": True, "dynamic": True, "backend": "inductor"},
        "chains": {},
    }
    for name, fn in CHAINS.items():
        results["chains"][name] = probe(name, fn, args.repeats)  # type: ignore[index]
        print(name, json.dumps(results["chains"][name]))  # type: ignore[index]
    if cache:
        shutil.rmtree(cache, ignore_errors=True)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
