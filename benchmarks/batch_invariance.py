"""Benchmark (correctness side): how much a row's result changes with the batch it is computed in, per op.

For each op, a row computed alone (M = 1) is compared with the same row computed among M rows, M = 2..300; the
JSON holds max |difference| per form and M (0.0 everywhere = batch-invariant). Forms:
- linear, K = N = 4096: plain `x @ W.T`; the CPU form of the tiled matmul (16-row tiles, one `bmm` against the
  weight expanded over the tiles); the same with every call padded to 16 tiles (a fixed batch count, weight still
  expanded); and Miles' `tiled_matmul` as it runs on this device (on CUDA: plain GEMMs of 16 x 16 rows);
- attention-shaped `bmm` of distinct (8 x 128) @ (128 x 16) matrices: plain, and Miles' `invariant_bmm`;
- RMSNorm at hidden 4096 and 8192: the plain row mean of squares, and Miles' `rms_norm`;
- `log_softmax` over a 151,936-token vocabulary.
On the CPU every Miles form is invariant by construction; on CUDA the plain forms are the ones that vary (see
docs/true-on-policy.md). Data: seeded random normals on the device.

    uv run python benchmarks/batch_invariance.py --out benchmarks/results/batch_invariance.json
    python benchmarks/batch_invariance.py --device cuda --out batch_invariance_cuda.json
"""

from __future__ import annotations

import argparse
import json
import platform
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from host import host_info

from miles_kernels import rms_norm, tiled_matmul
from miles_kernels.ops.linear import invariant_bmm

BATCHES = (2, 3, 9, 17, 33, 64, 300)
TILE = 16


def row_drift(fn: Callable[[int, int], torch.Tensor], rows: int = 3) -> dict[str, float]:
    """`fn(start, stop)` computes rows start..stop-1 in one call: max |fn(0, M)[r] - fn(r, r + 1)| over the first
    `rows` rows, per M."""
    alone = [fn(r, r + 1) for r in range(rows)]
    drift = {}
    for m in BATCHES:
        out = fn(0, m)
        drift[str(m)] = max(float((out[r : r + 1] - alone[r]).abs().max()) for r in range(min(m, rows)))
    return drift


def one_bmm_tiles(x: torch.Tensor, weight: torch.Tensor, group: int | None = None) -> torch.Tensor:
    """16-row tiles in one `bmm` against the expanded weight (the CPU form); with `group`, calls of exactly that
    many tiles."""
    rows, k = x.shape
    x = F.pad(x, (0, 0, 0, -rows % (TILE * (group or 1)))).reshape(-1, TILE, k)
    step = group or x.shape[0]
    parts = [torch.bmm(x[i : i + step], weight.t().expand(step, k, weight.shape[0])) for i in range(0, len(x), step)]
    return torch.cat(parts).reshape(-1, weight.shape[0])[:rows]


def linear_drift(x: torch.Tensor, weight: torch.Tensor) -> dict[str, dict[str, float]]:
    return {
        "plain": row_drift(lambda i, j: x[i:j] @ weight.t()),
        "one_bmm_expanded_weight": row_drift(lambda i, j: one_bmm_tiles(x[i:j], weight)),
        "fixed_16_tiles_expanded_weight": row_drift(lambda i, j: one_bmm_tiles(x[i:j], weight, 16)),
        "miles_tiled_matmul": row_drift(lambda i, j: tiled_matmul(x[i:j], weight, TILE)),
    }


def norm_drift(x: torch.Tensor, weight: torch.Tensor) -> dict[str, dict[str, float]]:
    return {
        "plain_mean": row_drift(lambda i, j: x[i:j] * torch.rsqrt(x[i:j].pow(2).mean(-1, keepdim=True) + 1e-6)),
        "miles_rms_norm": row_drift(lambda i, j: rms_norm(x[i:j], weight, 1e-6)),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu", help="torch device: cpu or cuda")
    parser.add_argument("--out", default="benchmarks/results/batch_invariance.json", help="JSON output path")
    args = parser.parse_args()
    device = torch.device(args.device)
    generator = torch.Generator(device=device).manual_seed(0)

    def randn(*shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return torch.randn(*shape, device=device, dtype=dtype, generator=generator)

    results: dict[str, object] = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu",
        "host": host_info(),
        "torch": torch.__version__,
        "metric": "max |row computed alone - the same row in a batch of M rows|, per M",
        "linear_K4096_N4096": {
            str(dtype).removeprefix("torch."): linear_drift(
                randn(300, 4096, dtype=dtype), randn(4096, 4096, dtype=dtype) / 64
            )
            for dtype in (torch.float32, torch.bfloat16)
        },
    }
    a, b = randn(300, 8, 128), randn(300, 128, 16)
    results["attention_bmm"] = {
        "plain": row_drift(lambda i, j: torch.bmm(a[i:j], b[i:j])),
        "miles_invariant_bmm": row_drift(lambda i, j: invariant_bmm(a[i:j], b[i:j])),
    }
    results["rms_norm"] = {str(hidden): norm_drift(randn(300, hidden), randn(hidden)) for hidden in (4096, 8192)}
    logits = randn(300, 151936)
    results["log_softmax_V151936"] = row_drift(lambda i, j: torch.log_softmax(logits[i:j], -1))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2))
    print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
