"""Rotary position embeddings (RoPE, rotate-half layout as in Hugging Face Qwen3; partial rotary as in GLM-4.5:
cos / sin narrower than the head rotate its leading dimensions and the rest pass through unchanged; Llama 3's
frequency scaling, `llama3_inv_frequencies`; YaRN's, `yarn_inv_frequencies`, for DeepSeek-V3, whose magnitude
correction `yarn_mscale` is torch-free in model_config.py).

Batch-invariant as written: angles are computed per position (`position * inv_freq`, elementwise, no
reduction), so a token's rotation depends only on its absolute position, never on the batch or chunk it is in.
On a CPU where the native library loads, float32 rotations run native/rope.cpp: the torch form's products and sums,
each rounded once, in one call (the same bits, tested against the torch form).
Shapes: x_NHD (tokens, heads, head_dim), positions_N.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from miles_kernels import native


def inv_frequencies(head_dim: int, theta: float, device: torch.device | None = None) -> torch.Tensor:
    """`1 / theta^(2i / head_dim)` for i < head_dim / 2, in float32 (as Hugging Face computes it)."""
    exponent = torch.arange(0, head_dim, 2, dtype=torch.int64, device=device).to(torch.float32) / head_dim
    return 1.0 / (theta**exponent)


def llama3_inv_frequencies(
    inv_freq: torch.Tensor, factor: float, low_freq_factor: float, high_freq_factor: float,
    original_max_position_embeddings: float,
) -> torch.Tensor:  # fmt: skip
    """Llama 3's scaled frequencies (Meta's reference, as transformers' `rope_type: llama3`): wavelengths shorter
    than `original / high_freq_factor` keep their frequency, those longer than `original / low_freq_factor` are
    divided by `factor`, and the band between interpolates smoothly between the two."""
    wavelen = 2 * math.pi / inv_freq
    low_freq_wavelen = original_max_position_embeddings / low_freq_factor
    high_freq_wavelen = original_max_position_embeddings / high_freq_factor
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (original_max_position_embeddings / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def yarn_inv_frequencies(
    head_dim: int, theta: float, factor: float, original_max_position_embeddings: float, beta_fast: float = 32.0,
    beta_slow: float = 1.0, truncate: bool = True, device: torch.device | None = None,
) -> torch.Tensor:  # fmt: skip
    """YaRN's frequencies (Peng et al., 2023; DeepSeek-V3 / Kimi-K2's `rope_scaling: {type: yarn}`, as transformers'
    `rope_type: yarn`): dimensions that turn more than `beta_fast` times over the original context keep their
    frequency (extrapolation), those that turn fewer than `beta_slow` times are divided by `factor`
    (interpolation), and a linear ramp over the dimensions between blends the two. In float32."""

    def correction_dim(rotations: float) -> float:  # the dimension that turns `rotations` times over the context
        return (
            head_dim * math.log(original_max_position_embeddings / (rotations * 2 * math.pi)) / (2 * math.log(theta))
        )

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001  # no zero-width ramp
    ramp = torch.clamp((torch.arange(head_dim // 2, dtype=torch.float32, device=device) - low) / (high - low), 0, 1)
    wavelengths = theta ** (
        torch.arange(0, head_dim, 2, dtype=torch.int64, device=device).to(torch.float32) / head_dim
    )
    keep = 1 - ramp  # 1: the dimension keeps its frequency
    return 1.0 / (factor * wavelengths) * (1 - keep) + 1.0 / wavelengths * keep


def rope_cos_sin(
    positions_N: torch.Tensor, inv_freq: torch.Tensor, dtype: torch.dtype, attention_factor: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of shape (N, head_dim) for the given absolute positions (times YaRN's `attention_factor` in float32
    before the cast, as transformers scales them)."""
    angles = positions_N.to(torch.float32)[:, None] * inv_freq[None, :]
    angles = torch.cat((angles, angles), dim=-1)
    cos, sin = angles.cos(), angles.sin()
    if attention_factor != 1.0:
        cos, sin = cos * attention_factor, sin * attention_factor
    return cos.to(dtype), sin.to(dtype)


def deinterleave(x: torch.Tensor) -> torch.Tensor:
    """DeepSeek's interleaved rotary layout (`rope_interleave`: pairs (x0, x1), (x2, x3), ... rotate together) in the
    rotate-half layout `apply_rope` takes: [x0, x2, ..., x1, x3, ...]. A permutation, so exact; rotating the result is
    bit for bit transformers' `apply_rotary_pos_emb_interleave`."""
    return torch.cat((x[..., 0::2], x[..., 1::2]), dim=-1)


def apply_rope(x_NHD: torch.Tensor, cos_NR: torch.Tensor, sin_NR: torch.Tensor) -> torch.Tensor:
    """Rotate the first R (rotary) dimensions of each head of each token by its position's angles (R = D: all).
    Differentiable: under autograd it runs `_Rope` (the same forward ops, one node with a hand-written backward
    instead of nine). Contiguous float32 CPU rows run the native kernel (native/rope.cpp: one call instead of five
    ops, the same bits) where the library loads."""
    if torch.is_grad_enabled() and x_NHD.requires_grad and not (cos_NR.requires_grad or sin_NR.requires_grad):
        out: torch.Tensor = _Rope.apply(x_NHD, cos_NR, sin_NR)
        return out
    return _rotate(x_NHD, cos_NR, sin_NR)


def _runs_native(x_NHD: torch.Tensor, cos_NR: torch.Tensor, sin_NR: torch.Tensor) -> bool:
    """Whether the native kernel takes these operands: float32 contiguous CPU tensors of the shapes it reads."""
    return (
        x_NHD.dtype == torch.float32
        and x_NHD.is_cpu
        and x_NHD.dim() == 3
        and cos_NR.dtype == torch.float32
        and sin_NR.dtype == torch.float32
        and x_NHD.is_contiguous()
        and cos_NR.is_contiguous()
        and sin_NR.is_contiguous()
        and cos_NR.dim() == 2
        and cos_NR.shape == sin_NR.shape
        and cos_NR.shape[0] == x_NHD.shape[0]
        and cos_NR.shape[1] % 2 == 0
        and cos_NR.shape[1] <= x_NHD.shape[2]
        and native.status() is True
    )


def _rotate(x_NHD: torch.Tensor, cos_NR: torch.Tensor, sin_NR: torch.Tensor) -> torch.Tensor:
    if _runs_native(x_NHD, cos_NR, sin_NR):
        return native.native_rope(x_NHD, cos_NR, sin_NR)
    return _torch_rotate(x_NHD, cos_NR, sin_NR)


def _torch_rotate(x_NHD: torch.Tensor, cos_NR: torch.Tensor, sin_NR: torch.Tensor) -> torch.Tensor:
    rotary = cos_NR.shape[-1]
    if rotary < x_NHD.shape[-1]:
        return torch.cat((_torch_rotate(x_NHD[..., :rotary], cos_NR, sin_NR), x_NHD[..., rotary:]), dim=-1)
    half = rotary // 2
    rotated = torch.cat((-x_NHD[..., half:], x_NHD[..., :half]), dim=-1)
    return x_NHD * cos_NR[:, None, :] + rotated * sin_NR[:, None, :]


class _Rope(torch.autograd.Function):
    """y = x cos + rot(x) sin with rot(x) = [-x2, x1]: dx = g cos + rot^T(g sin), rot^T(z) = [z2, -z1] (the
    dimensions past the rotary ones pass their gradient through). Bit for bit the gradient autograd computes from
    the forward's ops (each element adds the same two products; the other terms autograd adds are exact zeros)."""

    @staticmethod
    def forward(ctx: Any, x_NHD: torch.Tensor, cos_NR: torch.Tensor, sin_NR: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        ctx.save_for_backward(cos_NR, sin_NR)
        return _rotate(x_NHD, cos_NR, sin_NR)

    @staticmethod
    def backward(ctx: Any, grad_NHD: torch.Tensor) -> tuple[torch.Tensor, None, None]:  # type: ignore[override]
        cos_NR, sin_NR = ctx.saved_tensors
        if _runs_native(grad_NHD, cos_NR, sin_NR):
            return native.native_rope_backward(grad_NHD, cos_NR, sin_NR), None, None
        rotary = cos_NR.shape[-1]
        half = rotary // 2
        grad_rot = grad_NHD[..., :rotary]
        z = grad_rot * sin_NR[:, None, :]
        grad_x = grad_rot * cos_NR[:, None, :] + torch.cat((z[..., half:], -z[..., :half]), dim=-1)
        if rotary < grad_NHD.shape[-1]:
            grad_x = torch.cat((grad_x, grad_NHD[..., rotary:]), dim=-1)
        return grad_x, None, None
