"""Elementwise activations whose result per element does not depend on the tensor's size (batch-invariant).

Why: torch's CPU elementwise kernels run SIMD vectors over the flattened tensor and finish the last partial chunk
with scalar code (`std::exp`, where the vectors use SLEEF), and the two can differ in the last bit: measured here
(AVX2, torch 2.14), `torch.sigmoid` and `F.silu` of an (N, 8) tensor give other bits for some rows when N changes
(`cos` and `exp` do not). An element's arithmetic then depends on where it falls in the flat tensor, i.e. on the
rows around it. Fix by construction: each row is padded to a multiple of `VECTOR_BLOCK` elements, so every row
starts on a chunk boundary and no element ever takes the scalar tail. Rows already that wide (every real model's
intermediate sizes) run unpadded, so they keep their bits. CUDA computes each element alone: no padding there.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

# float32 elements; a multiple of every CPU vector loop's chunk (AVX-512: 16 floats per vector, unrolled twice)
VECTOR_BLOCK = 64


def rowwise(fn: Callable[..., torch.Tensor], *xs: torch.Tensor) -> torch.Tensor:
    """`fn(*xs)` for an elementwise `fn` of same-shape tensors, computed so that each element's bits do not depend
    on the number of rows."""
    width = xs[0].shape[-1]
    pad = -width % VECTOR_BLOCK
    if pad == 0 or xs[0].is_cuda:
        return fn(*xs)
    return fn(*(F.pad(x, (0, pad)) for x in xs))[..., :width]


def silu(x: torch.Tensor) -> torch.Tensor:
    """`F.silu`, batch-invariant (see the module docstring)."""
    return rowwise(F.silu, x)


def sigmoid(x: torch.Tensor) -> torch.Tensor:
    """`torch.sigmoid`, batch-invariant (see the module docstring)."""
    return rowwise(torch.sigmoid, x)


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """`silu(gate) * up`, batch-invariant. Differentiable: under autograd it runs `_SwiGLU` (the same forward ops,
    one node instead of two, or four where rows are padded)."""
    if torch.is_grad_enabled() and (gate.requires_grad or up.requires_grad):
        out: torch.Tensor = _SwiGLU.apply(gate, up)
        return out
    return silu(gate) * up


class _SwiGLU(torch.autograd.Function):
    """y = silu(g) u: du = dy silu(g), dg = silu'(g) dy u (torch's own `silu_backward`, `rowwise` as the forward
    runs): bit for bit the gradients autograd computes from the forward's ops. It keeps what autograd keeps (g, u
    and silu(g)): recomputing silu(g) in the backward would save memory at the cost of a transcendental pass per
    layer (measured slower here)."""

    @staticmethod
    def forward(ctx: Any, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        activated = silu(gate)
        ctx.save_for_backward(gate, up, activated)
        return activated * up

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None]:  # type: ignore[override]
        gate, up, activated = ctx.saved_tensors
        grad_gate = rowwise(torch.ops.aten.silu_backward, grad * up, gate) if ctx.needs_input_grad[0] else None
        grad_up = grad * activated if ctx.needs_input_grad[1] else None
        return grad_gate, grad_up
