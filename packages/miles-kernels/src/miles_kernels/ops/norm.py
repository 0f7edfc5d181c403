"""RMSNorm, computed in float32 like Hugging Face's Qwen3RMSNorm.

Batch-invariant as written: the only reduction is a per-row mean over the last (hidden) dim, which torch
reduces row by row in one fixed order (a row's reduction is never split across threads for hidden sizes
below torch's reduction grain of 32768; test_invariance checks it with 1 and 2 threads).
On CUDA the reduction kernel's launch shape depends on the number of rows too (measured on an H200: a row's mean
of squares changed with M at hidden 4096 and 8192), so there the sum of squares is a fixed-shape GEMM against a
ones vector (`tiled_matmul`), which is batch-invariant by construction.
"""

from __future__ import annotations

import torch

from miles_kernels.ops.linear import tiled_matmul

CUDA_NORM_TILE = 16  # rows per fixed-shape GEMM of the CUDA sum of squares


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """`weight * x / sqrt(mean(x^2) + eps)`, normalized in fp32, returned in x's dtype."""
    input_dtype = x.dtype
    x32 = x.to(torch.float32)
    if x32.is_cuda:
        squares = x32.pow(2)
        ones_1H = squares.new_ones(1, squares.shape[-1])
        sums = tiled_matmul(squares.reshape(-1, squares.shape[-1]), ones_1H, CUDA_NORM_TILE)
        variance = sums.reshape(*squares.shape[:-1], 1) / squares.shape[-1]
    else:
        variance = x32.pow(2).mean(-1, keepdim=True)
    x32 = x32 * torch.rsqrt(variance + eps)
    return weight * x32.to(input_dtype)
