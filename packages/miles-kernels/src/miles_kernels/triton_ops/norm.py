"""RMSNorm by a Triton kernel, batch-invariant: one program per row, the sum of squares accumulated in float32 over
fixed `BLOCK`-wide chunks from the start of the row, then reduced once (a fixed tree for a fixed BLOCK). Matches
`miles_kernels.ops.norm.rms_norm`'s arithmetic (normalize in float32, round to x's dtype, multiply by the weight),
up to the order of the sum. Forward only: the trainer's backward stays the torch op's (`ops/norm.py`).

Importing this module imports Triton.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from miles_kernels.triton_ops import interpreting

BLOCK = 1024  # columns per chunk of a row; fixed, so a row's sum has one order whatever the batch


@triton.jit
def _rms_norm_kernel(x_ptr, w_ptr, out_ptr, H, stride_x, stride_out, eps, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    squares = tl.zeros((BLOCK,), dtype=tl.float32)
    for h0 in range(0, H, BLOCK):
        cols = h0 + tl.arange(0, BLOCK)
        x = tl.load(x_ptr + row * stride_x + cols, mask=cols < H, other=0.0).to(tl.float32)
        squares += x * x
    inverse = 1.0 / tl.sqrt(tl.sum(squares, axis=0) / H + eps)
    for h0 in range(0, H, BLOCK):
        cols = h0 + tl.arange(0, BLOCK)
        x = tl.load(x_ptr + row * stride_x + cols, mask=cols < H, other=0.0)
        normed = (x.to(tl.float32) * inverse).to(x.dtype)  # as torch: normalized in float32, rounded to x's dtype
        w = tl.load(w_ptr + cols, mask=cols < H, other=0.0)
        out = w.to(tl.float32) * normed.to(tl.float32)
        tl.store(out_ptr + row * stride_out + cols, out.to(out_ptr.dtype.element_ty), mask=cols < H)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """`weight * x / sqrt(mean(x^2) + eps)` over the last dim, normalized in float32; the result in the dtype torch
    would give `weight * normed` (the promotion of the weight's and x's dtypes)."""
    if not (x.is_cuda or interpreting()):
        raise RuntimeError("the Triton RMSNorm runs on CUDA tensors (or on the CPU under TRITON_INTERPRET=1)")
    hidden = x.shape[-1]
    rows = x.reshape(-1, hidden).contiguous()
    out = torch.empty(rows.shape, dtype=torch.promote_types(weight.dtype, x.dtype), device=x.device)
    if rows.shape[0]:
        _rms_norm_kernel[(rows.shape[0],)](rows, weight.contiguous(), out, hidden, rows.stride(0), out.stride(0), eps,
                                           BLOCK=min(BLOCK, triton.next_power_of_2(hidden)))  # fmt: skip
    return out.reshape(x.shape)
