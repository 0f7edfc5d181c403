"""RMSNorm, computed in float32 like Hugging Face's Qwen3RMSNorm.

Batch-invariant as written: the only reduction is a per-row mean over the last (hidden) dim, which torch
reduces row by row in one fixed order (a row's reduction is never split across threads for hidden sizes
below torch's reduction grain of 32768; test_invariance checks it with 1 and 2 threads).
On CUDA the reduction kernel's launch shape depends on the number of rows too (measured on an H200: a row's mean
of squares changed with M at hidden 4096 and 8192), so there the sum of squares is a fixed-shape GEMM against a
ones vector (`tiled_matmul`), which is batch-invariant by construction.
The `native` backend (miles_kernels/native, norm.cpp) normalizes each row in one C++ call per layer, in one fixed
order (its sum of squares 16 lane chains added in a fixed tree), and has a C++ backward; CUDA tensors run the torch op.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from miles_kernels import native
from miles_kernels.ops.linear import tiled_matmul
from miles_kernels.registry import get_backend, register_backend
from miles_kernels.triton_ops import triton_available

if TYPE_CHECKING:
    from miles_kernels.config import KernelConfig  # annotations only: config imports the ops to resolve backends

CUDA_NORM_TILE = 16  # rows per fixed-shape GEMM of the CUDA sum of squares


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, config: KernelConfig | None = None) -> torch.Tensor:
    """`weight * x / sqrt(mean(x^2) + eps)`, normalized in fp32, returned in x's dtype, by `config`'s backend
    (`norm_backend`; None: the torch op). Differentiable: under autograd it runs one node with a hand-written
    backward instead of seven."""
    backend = _torch_rms_norm if config is None else get_backend(f"rms_norm:{config.mode}", config.norm_backend).fn
    out: torch.Tensor = backend(x, weight, eps)
    return out


def _torch_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    if torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad):
        out: torch.Tensor = _RMSNorm.apply(x, weight, eps)
        return out
    normed, _ = _normalize(x, eps)
    return weight * normed


def _triton_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The Triton kernel (miles_kernels/triton_ops/norm.py, imported on first use); under autograd its forward with
    `_RMSNorm`'s backward (only the forward has to match the engine)."""
    if torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad):
        out: torch.Tensor = _TritonRMSNorm.apply(x, weight, eps)
        return out
    from miles_kernels.triton_ops.norm import rms_norm as triton_rms_norm

    return triton_rms_norm(x, weight, eps)


def _native_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    if x.is_cuda:
        return _torch_rms_norm(x, weight, eps)
    if torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad):
        out: torch.Tensor = _NativeRMSNorm.apply(x, weight, eps)
        return out
    rows, _ = native.native_rms_norm(x, weight, eps)
    return rows.view(x.shape).to(torch.promote_types(x.dtype, weight.dtype))


class _NativeRMSNorm(torch.autograd.Function):
    """The native RMSNorm with its C++ backward (native.native_rms_norm_backward)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:  # type: ignore[override]
        ctx.save_for_backward(x, weight)
        ctx.eps = eps
        rows, _ = native.native_rms_norm(x, weight, eps)
        return rows.view(x.shape).to(torch.promote_types(x.dtype, weight.dtype))

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None, None]:  # type: ignore[override]
        x, weight = ctx.saved_tensors
        dx, dw = native.native_rms_norm_backward(x, weight, grad, ctx.eps, weight_grad=ctx.needs_input_grad[1])
        return dx.view(x.shape).to(x.dtype), None if dw is None else dw.to(weight.dtype), None


def _normalize(x: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(x / sqrt(mean(x^2) + eps) in x's dtype, the fp32 reciprocal root per row)."""
    input_dtype = x.dtype
    x32 = x.to(torch.float32)
    if x32.is_cuda:
        squares = x32.pow(2)
        ones_1H = squares.new_ones(1, squares.shape[-1])
        sums = tiled_matmul(squares.reshape(-1, squares.shape[-1]), ones_1H, CUDA_NORM_TILE)
        variance = sums.reshape(*squares.shape[:-1], 1) / squares.shape[-1]
    else:
        variance = x32.pow(2).mean(-1, keepdim=True)
    inverse = torch.rsqrt(variance + eps)
    return (x32 * inverse).to(input_dtype), inverse


class _RMSNorm(torch.autograd.Function):
    """y = w * n, n = x * r, r = 1 / sqrt(mean(x^2) + eps):
    dw = sum over rows of dy * n;  dx = r * (g - n * mean(g * n)) with g = dy * w (all in fp32)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:  # type: ignore[override]
        normed, inverse = _normalize(x, eps)
        ctx.save_for_backward(x, weight, inverse)
        return weight * normed

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None, None]:  # type: ignore[override]
        x, weight, inverse = ctx.saved_tensors
        return _backward(ctx, x, weight, inverse, grad)


class _TritonRMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:  # type: ignore[override]
        from miles_kernels.triton_ops.norm import rms_norm as triton_rms_norm

        ctx.save_for_backward(x, weight)
        ctx.eps = eps
        return triton_rms_norm(x, weight, eps)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None, None]:  # type: ignore[override]
        x, weight = ctx.saved_tensors
        return _backward(ctx, x, weight, _normalize(x, ctx.eps)[1], grad)


def _backward(
    ctx: Any, x: torch.Tensor, weight: torch.Tensor, inverse: torch.Tensor, grad: torch.Tensor
) -> tuple[torch.Tensor | None, torch.Tensor | None, None]:
    """dw = sum over rows of dy * n;  dx = r * (g - n * mean(g * n)), g = dy * w (float32)."""
    normed32 = x.to(torch.float32) * inverse
    grad32 = grad.to(torch.float32)
    grad_weight = None
    if ctx.needs_input_grad[1]:
        rows = grad32.reshape(-1, grad32.shape[-1])
        grad_weight = (rows * normed32.to(x.dtype).to(torch.float32).reshape_as(rows)).sum(0).to(weight.dtype)
    grad_x = None
    if ctx.needs_input_grad[0]:
        g = grad32 * weight.to(torch.float32)
        grad_x = (inverse * (g - normed32 * (g * normed32).mean(-1, keepdim=True))).to(x.dtype)
    return grad_x, grad_weight, None


register_backend("rms_norm:deterministic", "torch", _torch_rms_norm)
# chosen by name (kernel.norm_backend=triton) until its GPU speed is measured; `auto` keeps the torch op
register_backend("rms_norm:deterministic", "triton", _triton_rms_norm, is_available=triton_available, priority=-1)
# The native kernels (miles_kernels/native): `auto` in both modes where the library built and loads (fewer ops than
# the torch op's seven; CUDA tensors run the torch op through it).
register_backend("rms_norm:deterministic", "native", _native_rms_norm, is_available=native.status, priority=1)
register_backend("rms_norm:fast", "torch", _torch_rms_norm)
register_backend("rms_norm:fast", "native", _native_rms_norm, is_available=native.status, priority=1)
