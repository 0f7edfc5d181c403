"""Benchmark: the cost of batch invariance, Miles' deterministic linear layers against one plain GEMM, side by side.

At the vs-TRL policy's linear shapes (hidden 256, 8 heads / 4 KV heads of 32, intermediate 768: the seven linear
layers of a decoder layer), float32, for M rows: `tiled_matmul(x, W, tile)` (the deterministic forward: M cut into
tiles of `tile` rows, one fixed-shape `bmm`, the last tile zero-padded) and `F.linear(x, W)` (one GEMM of M rows:
the fast mode's forward and the torch-tiled backend's backward GEMMs) and `native_matmul` (the `native` backend:
miles_kernels/native, batch-invariant by construction) on a weight packed once (`native`: an engine's weights,
`hold_packed_weights`) and on one it packs in the call (`native_per_call`: a trainer's; the same bits). M = 1 (one
sequence decoding), 8 (a decode step's tail), 64 (a full decode step of `vs_trl.py`) and 600 (a train step's packed
rows). Each number is the median of `--repeats` calls after warm-up, the forms called in turn;
`decoder_layer_<M>_rows` sums the seven linear layers of one decoder layer. `backward_<M>_rows` does the same for
the two backward GEMMs at the largest M (dX = g W, dW = g^T x): plain GEMMs against the native GEMM.

    uv run python benchmarks/tiled_gemm.py --out benchmarks/results/tiled_gemm.json
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from host import host_info

from miles_kernels import KernelConfig, hold_packed_weights, native_matmul, tiled_matmul
from miles_kernels.native import isa, native_mm

# (in, out) of each linear layer of a decoder layer, and how many of them have that shape
SHAPES = {
    "q_proj": ((256, 256), 1),
    "k_proj / v_proj": ((256, 128), 2),
    "o_proj": ((256, 256), 1),
    "gate_proj / up_proj": ((256, 768), 2),
    "down_proj": ((768, 256), 1),
}
FORMS = ("tiled", "native", "native_per_call", "plain")


def median_us(fns: dict[str, Callable[[], object]], repeats: int) -> dict[str, float]:
    """Median microseconds per call of each function, called in turn (so a slow stretch hits every form)."""
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(5):
        for fn in fns.values():
            fn()
    for _ in range(repeats):
        for name, fn in fns.items():
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    return {name: round(statistics.median(t) * 1e6, 1) for name, t in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="benchmarks/results/tiled_gemm.json")
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 8, 64, 600])
    parser.add_argument("--repeats", type=int, default=200)
    parser.add_argument("--tile", type=int, default=KernelConfig().linear_tile)
    args = parser.parse_args()
    generator = torch.Generator().manual_seed(0)
    table: dict[str, dict[str, float]] = {}
    backward: dict[str, dict[str, float]] = {}
    with torch.no_grad():
        for name, ((k, n), _) in SHAPES.items():
            weight = torch.randn(n, k, generator=generator)
            held = weight.clone()
            hold_packed_weights([held])
            for rows in args.rows:
                x = torch.randn(rows, k, generator=generator)
                forms = {
                    "tiled": functools.partial(tiled_matmul, x, weight, args.tile),
                    "native": functools.partial(native_matmul, x, held),
                    "native_per_call": functools.partial(native_matmul, x, weight),
                    "plain": functools.partial(F.linear, x, weight),
                }
                us = median_us(forms, args.repeats)
                table[f"{name} {k}x{n}, {rows} rows"] = {**us, **_ratios(us)}
                print(f"{name:20s} {k}x{n} rows {rows:4d}: " + ", ".join(f"{f} {us[f]:8.1f} us" for f in FORMS))
            rows = max(args.rows)
            x, grad = torch.randn(rows, k, generator=generator), torch.randn(rows, n, generator=generator)
            us = median_us({
                "plain_dx": lambda grad=grad, weight=weight: grad @ weight,
                "native_dx": lambda grad=grad, weight=weight: native_mm(grad, weight),
                "plain_dw": lambda grad=grad, x=x: grad.t() @ x,
                "native_dw": lambda grad=grad, x=x: native_mm(grad.t(), x),
            }, args.repeats)  # fmt: skip
            backward[f"{name} {k}x{n}, {rows} rows"] = us
    results: dict[str, object] = {
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "host": host_info(),
        "dtype": "float32",
        "native_isa": isa(),
        "tile": args.tile,
        "repeats": args.repeats,
        "unit": "microseconds per call (median)",
        "per_shape": table,
        "backward_per_shape": backward,
    }
    for rows in args.rows:
        total = {
            form: round(sum(table[f"{name} {k}x{n}, {rows} rows"][form] * count
                            for name, ((k, n), count) in SHAPES.items()), 1)
            for form in FORMS
        }  # fmt: skip
        results[f"decoder_layer_{rows}_rows"] = {**total, **_ratios(total)}
    rows = max(args.rows)
    sums = {
        form: round(sum(backward[f"{name} {k}x{n}, {rows} rows"][form] * count
                        for name, ((k, n), count) in SHAPES.items()), 1)
        for form in ("plain_dx", "native_dx", "plain_dw", "native_dw")
    }  # fmt: skip
    results[f"backward_{rows}_rows"] = {
        **sums, "native_over_plain_dx": round(sums["native_dx"] / sums["plain_dx"], 2),
        "native_over_plain_dw": round(sums["native_dw"] / sums["plain_dw"], 2),
    }  # fmt: skip
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2) + "\n")
    print(json.dumps({k: v for k, v in results.items() if k.startswith(("decoder_layer_", "backward_"))}, indent=2))


def _ratios(us: dict[str, float]) -> dict[str, float]:
    return {f"{form}_over_plain": round(us[form] / us["plain"], 2) for form in FORMS if form != "plain"}


if __name__ == "__main__":
    main()
