"""RMSNorm, computed in float32 like Hugging Face's Qwen3RMSNorm.

Batch-invariant as written: the only reduction is a per-row mean over the last (hidden) dim, which torch
reduces row by row in one fixed order (a row's reduction is never split across threads for hidden sizes
below torch's reduction grain of 32768; test_invariance checks it with 1 and 2 threads).
"""

from __future__ import annotations

import torch


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """`weight * x / sqrt(mean(x^2) + eps)`, normalized in fp32, returned in x's dtype."""
    input_dtype = x.dtype
    x32 = x.to(torch.float32)
    variance = x32.pow(2).mean(-1, keepdim=True)
    x32 = x32 * torch.rsqrt(variance + eps)
    return weight * x32.to(input_dtype)
