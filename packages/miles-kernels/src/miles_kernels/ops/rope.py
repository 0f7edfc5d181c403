"""Rotary position embeddings (RoPE, rotate-half layout as in Hugging Face Qwen3; partial rotary as in GLM-4.5:
cos / sin narrower than the head rotate its leading dimensions and the rest pass through unchanged).

Batch-invariant as written: angles are computed per position (`position * inv_freq`, elementwise, no
reduction), so a token's rotation depends only on its absolute position, never on the batch or chunk it is in.
Shapes: x_NHD (tokens, heads, head_dim), positions_N.
"""

from __future__ import annotations

import torch


def inv_frequencies(head_dim: int, theta: float, device: torch.device | None = None) -> torch.Tensor:
    """`1 / theta^(2i / head_dim)` for i < head_dim / 2, in float32 (as Hugging Face computes it)."""
    exponent = torch.arange(0, head_dim, 2, dtype=torch.int64, device=device).to(torch.float32) / head_dim
    return 1.0 / (theta**exponent)


def rope_cos_sin(
    positions_N: torch.Tensor, inv_freq: torch.Tensor, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of shape (N, head_dim) for the given absolute positions."""
    angles = positions_N.to(torch.float32)[:, None] * inv_freq[None, :]
    angles = torch.cat((angles, angles), dim=-1)
    return angles.cos().to(dtype), angles.sin().to(dtype)


def apply_rope(x_NHD: torch.Tensor, cos_NR: torch.Tensor, sin_NR: torch.Tensor) -> torch.Tensor:
    """Rotate the first R (rotary) dimensions of each head of each token by its position's angles (R = D: all)."""
    rotary = cos_NR.shape[-1]
    if rotary < x_NHD.shape[-1]:
        return torch.cat((apply_rope(x_NHD[..., :rotary], cos_NR, sin_NR), x_NHD[..., rotary:]), dim=-1)
    half = rotary // 2
    rotated = torch.cat((-x_NHD[..., half:], x_NHD[..., :half]), dim=-1)
    return x_NHD * cos_NR[:, None, :] + rotated * sin_NR[:, None, :]
