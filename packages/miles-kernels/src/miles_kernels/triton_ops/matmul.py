"""`x @ w.T` by a persistent Triton kernel with a fixed tile schedule: batch-invariant by construction.

Each output tile (BLOCK_M rows x BLOCK_N columns) is computed by one program, which walks K in BLOCK_K steps from
0 up, accumulating in float32 (`tl.dot`, IEEE float32 for float32 inputs: no TF32). The block sizes are constants
(BLOCK_M is the config's `linear_tile`, at least 16 for `tl.dot`), never tuned on M, so a row's products and their
order are the same whatever M is and wherever the row sits in its tile (rows past M are masked to zero and never
touch another row's sums). The grid is persistent: one program per SM (`NUM_PROGRAMS`), each taking every
NUM_PROGRAMS-th tile; which program computes a tile does not change its bits.

The backward runs the same kernel for its two GEMMs (grad @ W and grad^T @ x, the operands strided views): only
the forward must be batch-invariant (it is what the engine computes); the backward's fixed reduction order makes
the gradients the same bits run to run.
Importing this module imports Triton (`linear.py` imports it on first use of the backend). Shapes: x_MK,
weight_NK, out_MN.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import triton
import triton.language as tl

from miles_kernels.triton_ops import interpreting

BLOCK_N = 64
BLOCK_K = 32
MIN_BLOCK_M = 16  # tl.dot needs at least 16 rows
INTERPRETER_PROGRAMS = 4


@triton.jit
def _matmul_kernel(
    x_ptr, w_ptr, out_ptr, M, N, K, stride_xm, stride_xk, stride_wn, stride_wk, stride_om, stride_on,
    NUM_PROGRAMS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    UPCAST: tl.constexpr,
):  # fmt: skip
    tiles_n = tl.cdiv(N, BLOCK_N)
    num_tiles = tl.cdiv(M, BLOCK_M) * tiles_n
    for tile in range(tl.program_id(0), num_tiles, NUM_PROGRAMS):
        rows = (tile // tiles_n) * BLOCK_M + tl.arange(0, BLOCK_M)
        cols = (tile % tiles_n) * BLOCK_N + tl.arange(0, BLOCK_N)
        rows64, cols64 = rows.to(tl.int64), cols.to(tl.int64)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            x = tl.load(x_ptr + rows64[:, None] * stride_xm + ks[None, :] * stride_xk,
                        mask=(rows[:, None] < M) & (ks[None, :] < K), other=0.0)  # fmt: skip
            w = tl.load(w_ptr + cols64[None, :] * stride_wn + ks[:, None] * stride_wk,
                        mask=(cols[None, :] < N) & (ks[:, None] < K), other=0.0)  # fmt: skip
            if UPCAST:  # the interpreter's 16-bit tl.dot is wrong (Triton 3.8); 16-bit products are exact in float32
                x, w = x.to(tl.float32), w.to(tl.float32)
            acc = tl.dot(x, w, acc, input_precision="ieee")
        tl.store(out_ptr + rows64[:, None] * stride_om + cols64[None, :] * stride_on,
                 acc.to(out_ptr.dtype.element_ty), mask=(rows[:, None] < M) & (cols[None, :] < N))  # fmt: skip


@functools.cache
def num_programs(device_index: int | None) -> int:
    """One program per SM on CUDA; a few under the interpreter."""
    if device_index is None:
        return INTERPRETER_PROGRAMS
    return int(torch.cuda.get_device_properties(device_index).multi_processor_count)


def _forward(x_MK: torch.Tensor, weight_NK: torch.Tensor, tile: int) -> torch.Tensor:
    if not (x_MK.is_cuda or interpreting()):
        raise RuntimeError("the Triton matmul runs on CUDA tensors (or on the CPU under TRITON_INTERPRET=1)")
    if x_MK.dtype != weight_NK.dtype:
        raise TypeError(f"x is {x_MK.dtype} and the weight {weight_NK.dtype}: give both the kernel dtype")
    num_rows, k = x_MK.shape
    n = weight_NK.shape[0]
    out = x_MK.new_empty(num_rows, n)
    if num_rows == 0 or n == 0:
        return out
    block_m = max(MIN_BLOCK_M, tile)
    num_tiles = -(-num_rows // block_m) * -(-n // BLOCK_N)
    programs = num_programs(x_MK.device.index if x_MK.is_cuda else None)
    grid = (min(programs, num_tiles),)
    _matmul_kernel[grid](
        x_MK, weight_NK, out, num_rows, n, k, *x_MK.stride(), *weight_NK.stride(), *out.stride(),
        NUM_PROGRAMS=grid[0], BLOCK_M=block_m, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K, UPCAST=not x_MK.is_cuda,
    )  # fmt: skip
    return out


def matmul(x_MK: torch.Tensor, weight_NK: torch.Tensor, tile: int = MIN_BLOCK_M) -> torch.Tensor:
    """`x @ weight.T` in x's dtype (float32 accumulation), batch-invariant; differentiable (the backward GEMMs run
    the same kernel)."""
    if torch.is_grad_enabled() and (x_MK.requires_grad or weight_NK.requires_grad):
        out: torch.Tensor = _Matmul.apply(x_MK, weight_NK, tile)
        return out
    return _forward(x_MK, weight_NK, tile)


class _Matmul(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x_MK: torch.Tensor, weight_NK: torch.Tensor, tile: int) -> torch.Tensor:  # type: ignore[override]
        ctx.save_for_backward(x_MK, weight_NK)
        ctx.tile = tile
        return _forward(x_MK, weight_NK, tile)

    @staticmethod
    def backward(ctx: Any, grad_MN: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None, None]:  # type: ignore[override]
        x_MK, weight_NK = ctx.saved_tensors
        grad_MN = grad_MN.to(x_MK.dtype).contiguous()
        # the same kernel, operands as strided views: grad_x = grad @ W, grad_W = grad^T @ x (a sum over the rows,
        # in the kernel's fixed K order: the same bits run to run)
        grad_x = _forward(grad_MN, weight_NK.t(), ctx.tile) if ctx.needs_input_grad[0] else None
        grad_weight = _forward(grad_MN.t(), x_MK.t(), ctx.tile) if ctx.needs_input_grad[1] else None
        return grad_x, grad_weight, None
