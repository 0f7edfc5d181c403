"""The MoE experts' GEMMs in one launch: rows grouped by expert, each group times its own expert's weight, by a
persistent Triton kernel with a fixed tile schedule (`matmul.py`'s, per expert). Batch-invariant by construction:
a row's products and their order (K walked from 0 in BLOCK_K steps, float32 accumulation) depend only on the row
and its expert's weight, never on how many rows chose that expert or which.

The experts' weights stay separate tensors (the model's parameters, one per expert): the kernel reads them through
a table of their addresses, so nothing is stacked or copied per call. The tiles (expert, first row, row end,
column block) are laid out on the host, BLOCK_M rows from each expert's first row. The backward runs plain torch
GEMMs per expert (only the forward must match the engine).

Importing this module imports Triton. Shapes: x_TK (rows sorted by expert), weights E x (N, K), out_TN.
"""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl

from miles_kernels.triton_ops import interpreting
from miles_kernels.triton_ops.matmul import BLOCK_K, BLOCK_N, MIN_BLOCK_M, num_programs


@triton.jit
def _grouped_kernel(
    x_ptr, weight_table, tiles_ptr, out_ptr, num_tiles, N, K, stride_xm, stride_wn, stride_om,
    NUM_PROGRAMS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    UPCAST: tl.constexpr,
):  # fmt: skip
    for tile in range(tl.program_id(0), num_tiles, NUM_PROGRAMS):
        expert = tl.load(tiles_ptr + tile * 4)
        first = tl.load(tiles_ptr + tile * 4 + 1)
        end = tl.load(tiles_ptr + tile * 4 + 2)
        w_ptr = tl.load(weight_table + expert).to(tl.pointer_type(x_ptr.dtype.element_ty))
        rows = first + tl.arange(0, BLOCK_M)
        cols = tl.load(tiles_ptr + tile * 4 + 3) * BLOCK_N + tl.arange(0, BLOCK_N)
        rows64, cols64 = rows.to(tl.int64), cols.to(tl.int64)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            x = tl.load(x_ptr + rows64[:, None] * stride_xm + ks[None, :],
                        mask=(rows[:, None] < end) & (ks[None, :] < K), other=0.0)  # fmt: skip
            w = tl.load(w_ptr + cols64[None, :] * stride_wn + ks[:, None],
                        mask=(cols[None, :] < N) & (ks[:, None] < K), other=0.0)  # fmt: skip
            if UPCAST:  # the interpreter's 16-bit tl.dot is wrong (Triton 3.8); 16-bit products are exact in float32
                x, w = x.to(tl.float32), w.to(tl.float32)
            acc = tl.dot(x, w, acc, input_precision="ieee")
        tl.store(out_ptr + rows64[:, None] * stride_om + cols64[None, :], acc.to(out_ptr.dtype.element_ty),
                 mask=(rows[:, None] < end) & (cols[None, :] < N))  # fmt: skip


def _tiles(counts: list[int], block_m: int, n: int, device: torch.device) -> torch.Tensor:
    """(expert, first row, row end, column block) of every output tile, experts in order."""
    tiles, start = [], 0
    col_blocks = -(-n // BLOCK_N)
    for expert, count in enumerate(counts):
        for first in range(start, start + count, block_m):
            tiles += [(expert, first, start + count, c) for c in range(col_blocks)]
        start += count
    return torch.tensor(tiles, dtype=torch.int32, device=device).reshape(-1, 4)


def _forward(x_TK: torch.Tensor, counts: list[int], weights: list[torch.Tensor], tile: int) -> torch.Tensor:
    if not (x_TK.is_cuda or interpreting()):
        raise RuntimeError("the Triton grouped GEMM runs on CUDA tensors (or on the CPU under TRITON_INTERPRET=1)")
    n, k = weights[0].shape
    if any(w.shape != (n, k) or w.dtype != x_TK.dtype or not w.is_contiguous() for w in weights):
        raise ValueError(f"every expert weight must be a contiguous ({n}, {k}) tensor of x's dtype {x_TK.dtype}")
    x = x_TK.contiguous()
    out = x.new_empty(x.shape[0], n)
    block_m = max(MIN_BLOCK_M, tile)
    tiles = _tiles(counts, block_m, n, x.device)
    if tiles.shape[0] == 0:
        return out
    table = torch.tensor([w.data_ptr() for w in weights], dtype=torch.int64, device=x.device)
    grid = (min(num_programs(x.device.index if x.is_cuda else None), tiles.shape[0]),)
    _grouped_kernel[grid](
        x, table, tiles, out, tiles.shape[0], n, k, x.stride(0), weights[0].stride(0), out.stride(0),
        NUM_PROGRAMS=grid[0], BLOCK_M=block_m, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K, UPCAST=not x.is_cuda,
    )  # fmt: skip
    return out


def grouped_matmul(x_TK: torch.Tensor, counts: list[int], weights: list[torch.Tensor], tile: int) -> torch.Tensor:
    """Rows `x_TK` grouped by expert (`counts[e]` rows of expert e, in expert order), each group @ weights[e].T;
    differentiable in x and every weight."""
    if torch.is_grad_enabled() and (x_TK.requires_grad or any(w.requires_grad for w in weights)):
        out: torch.Tensor = _GroupedMatmul.apply(x_TK, counts, tile, *weights)
        return out
    return _forward(x_TK, counts, weights, tile)


class _GroupedMatmul(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x_TK: torch.Tensor, counts: list[int], tile: int, *weights: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        ctx.save_for_backward(x_TK, *weights)
        ctx.counts = counts
        return _forward(x_TK, counts, list(weights), tile)

    @staticmethod
    def backward(ctx: Any, grad_TN: torch.Tensor) -> tuple[torch.Tensor | None, ...]:  # type: ignore[override]
        x_TK, *weights = ctx.saved_tensors
        grad_x = torch.zeros_like(x_TK) if ctx.needs_input_grad[0] else None
        grad_weights: list[torch.Tensor | None] = []
        start = 0
        for expert, count in enumerate(ctx.counts):
            rows = slice(start, start + count)
            start += count
            grad = grad_TN[rows].to(x_TK.dtype)
            if grad_x is not None and count:
                grad_x[rows] = grad @ weights[expert]
            needed = ctx.needs_input_grad[3 + expert]
            grad_weights.append(grad.t() @ x_TK[rows] if needed else None)
        return (grad_x, None, None, *grad_weights)
