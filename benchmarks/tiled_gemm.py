"""Benchmark: the cost of fixed tiles, Miles' batch-invariant linear layer against one plain GEMM, side by side.

At the vs-TRL policy's linear shapes (hidden 256, 8 heads / 4 KV heads of 32, intermediate 768: the seven linear
layers of a decoder layer), float32, for M rows: `tiled_matmul(x, W, tile)` (the deterministic forward: M cut into
tiles of `tile` rows, one fixed-shape `bmm`, the last tile zero-padded) and `F.linear(x, W)` (one GEMM of M rows:
the fast mode's forward and every backward GEMM). M = 8 (a decode step's tail), 64 (a full decode step of
`vs_trl.py`) and 600 (a train step's packed rows). Each number is the median of `--repeats` calls after warm-up,
the two forms called in turn; `decoder_layer_<M>_rows` sums the seven linear layers of one decoder layer.

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

from miles_kernels import KernelConfig, tiled_matmul

# (in, out) of each linear layer of a decoder layer, and how many of them have that shape
SHAPES = {
    "q_proj": ((256, 256), 1),
    "k_proj / v_proj": ((256, 128), 2),
    "o_proj": ((256, 256), 1),
    "gate_proj / up_proj": ((256, 768), 2),
    "down_proj": ((768, 256), 1),
}
FORMS = ("tiled", "plain")


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
    parser.add_argument("--rows", type=int, nargs="+", default=[8, 64, 600])
    parser.add_argument("--repeats", type=int, default=200)
    parser.add_argument("--tile", type=int, default=KernelConfig().linear_tile)
    args = parser.parse_args()
    generator = torch.Generator().manual_seed(0)
    table: dict[str, dict[str, float]] = {}
    with torch.no_grad():
        for name, ((k, n), _) in SHAPES.items():
            weight = torch.randn(n, k, generator=generator)
            for rows in args.rows:
                x = torch.randn(rows, k, generator=generator)
                forms = {
                    "tiled": functools.partial(tiled_matmul, x, weight, args.tile),
                    "plain": functools.partial(F.linear, x, weight),
                }
                us = median_us(forms, args.repeats)
                table[f"{name} {k}x{n}, {rows} rows"] = {**us, "tiled_over_plain": round(us["tiled"] / us["plain"], 2)}
                print(f"{name:20s} {k}x{n} rows {rows:4d}: tiled {us['tiled']:8.1f} us, plain {us['plain']:8.1f} us")
    results: dict[str, object] = {
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "host": host_info(),
        "dtype": "float32",
        "tile": args.tile,
        "repeats": args.repeats,
        "unit": "microseconds per call (median)",
        "per_shape": table,
    }
    for rows in args.rows:
        total = {
            form: round(sum(table[f"{name} {k}x{n}, {rows} rows"][form] * count
                            for name, ((k, n), count) in SHAPES.items()), 1)
            for form in FORMS
        }  # fmt: skip
        ratio = round(total["tiled"] / total["plain"], 2)
        results[f"decoder_layer_{rows}_rows"] = {**total, "tiled_over_plain": ratio}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2) + "\n")
    print(json.dumps({k: v for k, v in results.items() if k.startswith("decoder_layer_")}, indent=2))


if __name__ == "__main__":
    main()
