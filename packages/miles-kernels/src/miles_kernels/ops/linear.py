"""Linear layers whose per-row result does not depend on the number of rows (M) in the call.

Why: BLAS picks kernels and blockings by matrix shape (M = 1..3 take a GEMV-like path on this CPU), so row i
of `x @ W.T` changes with the batch size. Fix by construction: rows are cut into fixed tiles of `T` rows
(the last tile zero-padded) and `torch.bmm` runs the same (T, K) @ (K, N) GEMM on every tile, so a row's
arithmetic is identical whatever M is or where the row sits. Operands always have the same memory layout
(a strided view and a contiguous copy of the same values can take different BLAS paths).
Only the forward pass must be batch-invariant (it is what the engine computes and what the trainer's log-probs
compare against). The backward pass runs two plain GEMMs: autograd through the tiled `bmm` would materialise one
weight gradient per tile (tiles x K x N floats) and sum them, several times slower than one `grad.T @ x`; plain
GEMMs are still deterministic run to run for a given shape.
On CUDA the `bmm` form is not enough (measured on an H200, float32, K = N = 4096): cuBLAS picks its kernel by the
batch count too (a row changed with M by up to 5e-4), and even at a fixed batch count a weight `expand`ed over the
batch (stride 0) gave a row that depended on the other tiles' values (9e-6). There the rows go in plain GEMMs of
one fixed shape, `tile * CUDA_TILES_PER_GEMM` rows each (the last zero-padded): invariant in every case measured.
Batched products of distinct matrices (attention) go through `invariant_bmm`: a fixed batch count per call.

The `native` backend (`native_matmul`, miles_kernels/native) is batch-invariant by construction instead: a C++
register-blocked GEMM computes each output element as one chain of fused multiply-adds over k in order, the same
bits at any M, thread count and instruction set (AVX-512, AVX2, generic). A rollout engine's weights are packed once
per weight version into the GEMM's panel layout (`hold_packed_weights`), so a decode step reads each weight once;
other weights are packed block by block in the call, with the same bits. Its backward runs the same kernel (each
element one chain over the reduced dimension in order), so the gradients are fixed by construction too. On CUDA
tensors it runs the torch-tiled CUDA form.
Shapes: x_MK, weight_NK, out_MN.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F

from miles_kernels import native
from miles_kernels.registry import get_backend, register_backend
from miles_kernels.triton_ops import triton_available

if TYPE_CHECKING:
    from miles_kernels.config import KernelConfig  # annotations only: config imports the ops to resolve backends

# On CUDA every batched matmul carries exactly this many matrices (the last call zero-padded), so cuBLAS sees one
# shape and picks one kernel whatever the number of matrices.
CUDA_BMM_GROUP = 16
# On CUDA a deterministic linear layer runs plain GEMMs of `tile * CUDA_TILES_PER_GEMM` rows.
CUDA_TILES_PER_GEMM = 16


def invariant_bmm(a_BMK: torch.Tensor, b_BKN: torch.Tensor) -> torch.Tensor:
    """`torch.bmm` whose result for each matrix does not depend on how many matrices the call carries.

    On the CPU `torch.bmm` already is (each matrix is one GEMM of its own shape). On CUDA the matrices go in
    calls of exactly `CUDA_BMM_GROUP`. Differentiable.
    """
    if not a_BMK.is_cuda:
        return torch.bmm(a_BMK, b_BKN)
    return grouped_bmm(a_BMK, b_BKN, CUDA_BMM_GROUP)


def grouped_bmm(a_BMK: torch.Tensor, b_BKN: torch.Tensor, group: int) -> torch.Tensor:
    """`torch.bmm` run as calls of exactly `group` matrices each (zero matrices pad the last call). Both operands
    are made contiguous: one memory layout in every call (cuBLAS picks kernels by transposition and strides too;
    an `expand`ed operand is materialised, see the module docstring)."""
    count = a_BMK.shape[0]
    pad = -count % group
    a_BMK, b_BKN = a_BMK.contiguous(), b_BKN.contiguous()
    if pad:
        a_BMK = torch.cat((a_BMK, a_BMK.new_zeros(pad, *a_BMK.shape[1:])))
        b_BKN = torch.cat((b_BKN, b_BKN.new_zeros(pad, *b_BKN.shape[1:])))
    parts = [torch.bmm(a_BMK[i : i + group], b_BKN[i : i + group]) for i in range(0, count + pad, group)]
    out = parts[0] if len(parts) == 1 else torch.cat(parts)
    return out[:count] if pad else out


def fixed_rows_matmul(x_MK: torch.Tensor, weight_KN: torch.Tensor, rows: int) -> torch.Tensor:
    """`x @ weight` as plain GEMMs of exactly `rows` rows each (the last zero-padded): the CUDA form of the tiled
    matmul."""
    num_rows = x_MK.shape[0]
    pad = -num_rows % rows
    if pad:
        x_MK = F.pad(x_MK, (0, 0, 0, pad))
    parts = [torch.mm(x_MK[i : i + rows], weight_KN) for i in range(0, num_rows + pad, rows)]
    out = parts[0] if len(parts) == 1 else torch.cat(parts)
    return out[:num_rows] if pad else out


def tiled_matmul(x_MK: torch.Tensor, weight_NK: torch.Tensor, tile: int) -> torch.Tensor:
    """`x @ weight.T`, computed as fixed-shape (tile, K) @ (K, N) GEMMs (batch-invariant); differentiable, with
    plain-GEMM gradients."""
    if torch.is_grad_enabled() and (x_MK.requires_grad or weight_NK.requires_grad):
        out: torch.Tensor = _TiledMatmul.apply(x_MK, weight_NK, tile)
        return out
    return _tiled_matmul(x_MK, weight_NK, tile)


class _TiledMatmul(torch.autograd.Function):
    # The combined forward(ctx, ...) form: with a separate setup_context, torch binds the arguments through
    # inspect.signature on every call (41 vs 14 us per call here, 29 calls per forward of the default policy).
    @staticmethod
    def forward(ctx: Any, x_MK: torch.Tensor, weight_NK: torch.Tensor, tile: int) -> torch.Tensor:  # type: ignore[override]
        ctx.save_for_backward(x_MK, weight_NK)
        return _tiled_matmul(x_MK, weight_NK, tile)

    @staticmethod
    def backward(ctx: Any, grad_MN: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None, None]:  # type: ignore[override]
        x_MK, weight_NK = ctx.saved_tensors
        grad_MN = grad_MN.contiguous()
        grad_x = grad_MN @ weight_NK if ctx.needs_input_grad[0] else None
        grad_weight = grad_MN.t() @ x_MK if ctx.needs_input_grad[1] else None
        return grad_x, grad_weight, None


def _tiled_matmul(x_MK: torch.Tensor, weight_NK: torch.Tensor, tile: int) -> torch.Tensor:
    x_MK = x_MK.contiguous()  # one memory layout for every call: BLAS picks paths by strides too
    num_rows, k = x_MK.shape
    n = weight_NK.shape[0]
    weight_KN = weight_NK.t()
    if x_MK.is_cuda:
        return fixed_rows_matmul(x_MK, weight_KN, tile * CUDA_TILES_PER_GEMM)
    num_full = num_rows // tile * tile
    parts = []
    if num_full:
        x_BTK = x_MK[:num_full].reshape(num_full // tile, tile, k)
        parts.append(torch.bmm(x_BTK, weight_KN.expand(num_full // tile, k, n)).reshape(num_full, n))
    if num_rows > num_full:
        # Zero-pad only the last, partial tile (padding rows never touch real rows' arithmetic).
        tail_TK = F.pad(x_MK[num_full:], (0, 0, 0, tile - (num_rows - num_full)))
        parts.append(torch.bmm(tail_TK.unsqueeze(0), weight_KN.unsqueeze(0))[0, : num_rows - num_full])
    if not parts:
        return x_MK.new_zeros(0, n)
    return parts[0] if len(parts) == 1 else torch.cat(parts)


def native_matmul(x_MK: torch.Tensor, weight_NK: torch.Tensor, tile: int = 16) -> torch.Tensor:
    """`x @ weight.T` by the native kernels (module docstring): batch-invariant by construction on the CPU,
    differentiable with native gradients; on CUDA the torch-tiled form with `tile`-row tiles."""
    if x_MK.is_cuda:
        return tiled_matmul(x_MK, weight_NK, tile)
    if torch.is_grad_enabled() and (x_MK.requires_grad or weight_NK.requires_grad):
        out: torch.Tensor = _NativeMatmul.apply(x_MK, weight_NK)
        return out
    return native.native_linear(x_MK, weight_NK)


class _NativeMatmul(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x_MK: torch.Tensor, weight_NK: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        ctx.save_for_backward(x_MK, weight_NK)
        return native.native_linear(x_MK, weight_NK)

    @staticmethod
    def backward(ctx: Any, grad_MN: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None]:  # type: ignore[override]
        x_MK, weight_NK = ctx.saved_tensors
        grad_x = native.native_mm(grad_MN, weight_NK) if ctx.needs_input_grad[0] else None
        grad_weight = native.native_mm(grad_MN.t(), x_MK) if ctx.needs_input_grad[1] else None
        return grad_x, grad_weight


def _rows_linear(
    matmul: Callable[[torch.Tensor, torch.Tensor, int], torch.Tensor], x: torch.Tensor, weight: torch.Tensor,
    bias: torch.Tensor | None, tile: int,
) -> torch.Tensor:  # fmt: skip
    """`F.linear` of x's rows (any leading shape) by a batch-invariant `matmul(x_MK, weight_NK, tile)`."""
    if x.dim() == 2:  # the common case: no reshapes (each costs about a microsecond a call)
        out = matmul(x, weight, tile)
        return out if bias is None else out + bias
    out = matmul(x.reshape(-1, x.shape[-1]), weight, tile)
    if bias is not None:
        out = out + bias
    return out.reshape(*x.shape[:-1], weight.shape[0])


def _tiled_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, config: KernelConfig
) -> torch.Tensor:
    return _rows_linear(tiled_matmul, x, weight, bias, config.linear_tile)


def _native_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, config: KernelConfig
) -> torch.Tensor:
    return _rows_linear(native_matmul, x, weight, bias, config.linear_tile)


def _native_fast_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, config: KernelConfig
) -> torch.Tensor:
    """Fast mode's native linear: the deterministic native backend on CPU tensors, one plain GEMM on CUDA ones."""
    return (_plain_linear if x.is_cuda else _native_linear)(x, weight, bias, config)


def _plain_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, config: KernelConfig
) -> torch.Tensor:
    return F.linear(x, weight, bias)


def _triton_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, config: KernelConfig
) -> torch.Tensor:
    from miles_kernels.triton_ops.matmul import matmul  # imports Triton: only when this backend runs

    return _rows_linear(matmul, x, weight, bias, config.linear_tile)


register_backend("linear:deterministic", "torch-tiled", _tiled_linear)
# The persistent Triton matmul (miles_kernels/triton_ops/matmul.py): chosen by name (kernel.linear_backend=triton)
# until its GPU speed is measured; `auto` keeps torch-tiled.
register_backend("linear:deterministic", "triton", _triton_linear, is_available=triton_available, priority=-1)
# The native kernels (miles_kernels/native): `auto` where the library built and loads (CUDA tensors run the
# torch-tiled CUDA form through it); torch-tiled otherwise, or by name.
register_backend("linear:deterministic", "native", _native_linear, is_available=native.status, priority=1)
register_backend("linear:fast", "torch", _plain_linear)
# Fast mode's `auto`: one MKL GEMM, except where the native GEMM is the faster plain GEMM (an AVX-512 or AVX2 CPU
# that is not Intel's: MKL runs its AVX2 code there; native.faster_than_mkl). Its bits are the deterministic backend's.
register_backend("linear:fast", "native", _native_fast_linear, is_available=native.faster_than_mkl, priority=1)


def linear(
    x: torch.Tensor, weight: torch.Tensor, config: KernelConfig, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """`F.linear` over the last dim of `x` (any leading shape); batch-invariant in deterministic mode."""
    backend = get_backend(f"linear:{config.mode}", config.linear_backend)
    out: torch.Tensor = backend.fn(x, weight, bias, config)
    return out


def rows_matmul(x_MK: torch.Tensor, weight_NK: torch.Tensor, config: KernelConfig, tile: int) -> torch.Tensor:
    """`x @ weight.T` by the deterministic linear backend `config` resolves to, with `tile`-row tiles where it
    tiles (MoE experts use their own tile); differentiable."""
    if get_backend(f"linear:{config.mode}", config.linear_backend).name == "native":
        return native_matmul(x_MK, weight_NK, tile)
    return tiled_matmul(x_MK, weight_NK, tile)


def head_linear(x_NHK: torch.Tensor, weight_HOK: torch.Tensor, config: KernelConfig) -> torch.Tensor:
    """Each head's own linear map: out[:, h] = x[:, h] @ weight[h].T, (N, H, K) -> (N, H, O) (MLA's absorbed key and
    value projections). Deterministic mode runs `linear` per head, so each head's rows are as batch-invariant as any
    linear layer's; fast mode one batched product."""
    if not config.is_deterministic:
        return torch.bmm(x_NHK.transpose(0, 1), weight_HOK.transpose(1, 2)).transpose(0, 1)
    heads = [linear(x_NHK[:, h], weight_HOK[h], config) for h in range(x_NHK.shape[1])]
    return torch.stack(heads, dim=1)


def merge_lora(
    weight_OK: torch.Tensor, a_RK: torch.Tensor, b_OR: torch.Tensor, scaling: float, kernel: KernelConfig
) -> torch.Tensor:
    """`weight + scaling * b @ a` in the operands' dtype. The product runs through `linear` (batch-invariant in
    deterministic mode: each of its rows has one fixed order of operations), so engine and trainer merging the same
    values get the same bits; differentiable in `a` and `b`."""
    delta_KO = linear(a_RK.t(), b_OR, kernel)  # row k: a[:, k] @ b.T
    return weight_OK + scaling * delta_KO.t()
