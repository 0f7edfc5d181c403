"""The native CPU kernels: a C++ library (gemm.cpp, attention.cpp, norm.cpp, rope.cpp, fused.cpp, noise.cpp, built by
build.py when the package installs) called through ctypes, with no torch headers in it, so one build serves every
torch version.

`native_mm(a, b)` is `a @ b` for 2-D CPU tensors of any strides (float32, or bfloat16 with float32 accumulation), each
output element one fused multiply-add chain over the inner dimension in order; `native_linear(x, w)` is `x @ w.T` with
the same chains (a server's weights packed once per version: `hold_packed_weights`); `native_attention` is causal
GQA attention over a paged KV store, each (token, head) row on its own in one fixed order, with its backward
(`native_attention_backward`); `native_rms_norm` is RMSNorm a row at a time, with its backward; `native_rope` is RoPE's
rotation (float32), with its backward, the bits of its torch form; `gumbel_uniforms` is
the sampler's noise uniforms (integer arithmetic: the bits of its torch form); `decoder_attention` is the attention
half of a dense decoder layer's engine forward in one call (fused.cpp: these kernels in the modules' order, so their
bits; miles_kernels/fused_layer.py decides when it applies). All are batch-invariant by
construction: the same bits at any batch composition and thread count, and on every instruction set the library
dispatches to (AVX-512, AVX2, generic). `status()` says whether the library is usable here, or why
not; the op registry's `native` linear and attention backends are available exactly when it is (ops/linear.py,
ops/attention.py).

Here: the attention, RMSNorm, RoPE and noise calls; the GEMM's and the packed weights' in matmul.py; the fused
layer's in layer.py; loading the library (its instruction-set build, its kernels by name) in library.py.
"""

from __future__ import annotations

import torch

from miles_kernels.native.layer import decoder_attention
from miles_kernels.native.library import (
    DTYPES,
    ISAS,
    cpu_vendor,
    faster_than_mkl,
    isa,
    kernels,
    library_path,
    panel_width,
    run,
    status,
)
from miles_kernels.native.matmul import (
    held_panels,
    hold_packed_weights,
    native_linear,
    native_mm,
    pack_weight,
    packed_weights,
)

__all__ = [
    "ISAS",
    "MAX_HEAD_DIM",
    "cpu_vendor",
    "decoder_attention",
    "faster_than_mkl",
    "gumbel_uniforms",
    "held_panels",
    "hold_packed_weights",
    "isa",
    "library_path",
    "native_attention",
    "native_attention_backward",
    "native_linear",
    "native_mm",
    "native_rms_norm",
    "native_rms_norm_backward",
    "native_rope",
    "native_rope_backward",
    "pack_weight",
    "packed_weights",
    "panel_width",
    "status",
]


def gumbel_uniforms(seeds_M: torch.Tensor, positions_M: torch.Tensor, vocab: int) -> torch.Tensor:
    """The sampler's float64 uniforms (M, vocab) of rows (seed, position) (int64 tensors holding their 64-bit
    patterns): `miles_kernels.ops.sampling.uniform` for every token id, the same bits as its torch form (noise.cpp:
    integer arithmetic and one exact conversion), threaded over the elements."""
    state = kernels()
    seeds, positions = (t.to(torch.int64).contiguous() for t in (seeds_M, positions_M))
    if seeds.dim() != 1 or seeds.shape != positions.shape or seeds.device.type != "cpu":
        raise ValueError(f"gumbel_uniforms takes seeds and positions (M,) on the CPU; got {tuple(seeds.shape)} and "
                         f"{tuple(positions.shape)} on {seeds.device}")  # fmt: skip
    out = torch.empty(seeds.shape[0], vocab, dtype=torch.float64)
    run("gumbel_uniforms", state["gumbel_uniforms"], seeds.data_ptr(), positions.data_ptr(), seeds.shape[0], vocab,
         out.data_ptr(), torch.get_num_threads())  # fmt: skip
    return out


MAX_HEAD_DIM = 1024  # attention.cpp keeps a row's accumulator on the stack
_KV_LAYOUTS = {4: "pages (pages, Hkv, P, D)", 3: "rows (R, Hkv, D) with the rows of the slots (pages, P)"}


def _attention_operands(
    q_NHD: torch.Tensor,
    k_pages: torch.Tensor,
    v_pages: torch.Tensor,
    tables_SB: torch.Tensor,
    rows_PP: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Checked, contiguous operands: q as float32, the pages (or K/V rows, `rows_PP` given) in a dtype the kernels
    read (float16 as float32)."""
    tensors = (q_NHD, k_pages, v_pages, tables_SB) + (() if rows_PP is None else (rows_PP,))
    if any(t.device.type != "cpu" for t in tensors):
        raise ValueError(f"native attention runs on CPU tensors; got {[str(t.device) for t in tensors]}")
    kv_dims = 4 if rows_PP is None else 3
    if q_NHD.dim() != 3 or k_pages.dim() != kv_dims or (rows_PP is not None and rows_PP.dim() != 2):
        raise ValueError(f"native attention takes q (N, H, D) and K / V {_KV_LAYOUTS[kv_dims]}; got q "
                         f"{tuple(q_NHD.shape)}, K {tuple(k_pages.shape)}")  # fmt: skip
    (_, heads, head_dim), kv_heads, page_dim = q_NHD.shape, k_pages.shape[1], k_pages.shape[-1]
    if k_pages.shape != v_pages.shape or page_dim != head_dim or heads % kv_heads or head_dim > MAX_HEAD_DIM:
        raise ValueError(
            f"native attention takes q (N, H, D) and K / V {_KV_LAYOUTS[kv_dims]} of one shape, H a multiple of Hkv"
            f" and D <= {MAX_HEAD_DIM}; got q {tuple(q_NHD.shape)}, K {tuple(k_pages.shape)}, V {tuple(v_pages.shape)}"
        )
    if k_pages.dtype != v_pages.dtype:
        raise ValueError(f"native attention needs K and V pages of one dtype; got {k_pages.dtype} and {v_pages.dtype}")
    if k_pages.dtype not in DTYPES:
        k_pages, v_pages = k_pages.float(), v_pages.float()
    return q_NHD.float().contiguous(), k_pages.contiguous(), v_pages.contiguous()


def native_attention(
    q_NHD: torch.Tensor,
    k_pages: torch.Tensor,
    v_pages: torch.Tensor,
    positions_N: torch.Tensor,
    seqs_N: torch.Tensor,
    tables_SB: torch.Tensor,
    scale: float,
    window: int | None = None,
    rows_PP: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal attention of each query token (position `positions_N[t]`, sequence `seqs_N[t]`) over its sequence's
    keys in the page store (`tables_SB[s, b]`: the page of key block b; pages (num_pages, Hkv, P, D)), a row at a time
    in one fixed order (attention.cpp): batch-invariant by construction. `window`: a row sees its last `window` keys.
    `rows_PP` (num_pages, P): K / V are rows (R, Hkv, D) instead, slot (page, offset) holding row rows_PP[page,
    offset] (the trainer's tokens, no page store built; the same bits). Returns the float32 output (N, H, D) and
    log-sum-exp (N, H)."""
    state = kernels()
    q, k, v = _attention_operands(q_NHD, k_pages, v_pages, tables_SB, rows_PP)
    (n, heads, head_dim), kv_heads = q.shape, k.shape[1]
    page = k.shape[2] if rows_PP is None else rows_PP.shape[1]
    out = torch.empty(n, heads, head_dim)
    lse = torch.empty(n, heads)
    ints = [t.to(torch.int64).contiguous() for t in (positions_N, seqs_N, tables_SB)]
    rows = 0 if rows_PP is None else rows_PP.to(torch.int64).contiguous()
    run("native_attention", state[f"attention_fwd_{DTYPES[k.dtype]}"], q.data_ptr(), k.data_ptr(), v.data_ptr(), n,
         heads, kv_heads, head_dim, page, *(t.data_ptr() for t in ints), ints[2].shape[1], scale, window or 0,
         _pointer(rows), out.data_ptr(), lse.data_ptr(), torch.get_num_threads())  # fmt: skip
    return out, lse


def _pointer(t: torch.Tensor | int) -> int:
    return t if isinstance(t, int) else t.data_ptr()


def native_attention_backward(
    q_NHD: torch.Tensor,
    k_pages: torch.Tensor,
    v_pages: torch.Tensor,
    positions_N: torch.Tensor,
    seqs_N: torch.Tensor,
    tables_SB: torch.Tensor,
    query_starts: torch.Tensor,
    scale: float,
    window: int | None,
    out_NHD: torch.Tensor,
    lse_NH: torch.Tensor,
    grad_NHD: torch.Tensor,
    rows_PP: torch.Tensor | None = None,
    grad_rows_PP: torch.Tensor | None = None,
    num_grad_rows: int = 0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The gradients (dq (N, H, D), dK and dV pages, float32) of `native_attention` given its float32 output and
    log-sum-exp and the output's gradient; the tokens of sequence s are query_starts[s] .. query_starts[s + 1] - 1,
    positions ascending. Deterministic: each sum runs in one fixed order (attention.cpp). K / V as rows (`rows_PP`,
    as `native_attention`): dK and dV are (num_grad_rows, Hkv, D), slot (page, offset)'s gradient in row
    grad_rows_PP[page, offset] (the sum a page store's slot would hold)."""
    state = kernels()
    q, k, v = _attention_operands(q_NHD, k_pages, v_pages, tables_SB, rows_PP)
    (n, heads, head_dim), kv_heads = q.shape, k.shape[1]
    ints = [t.to(torch.int64).contiguous() for t in (positions_N, seqs_N, tables_SB, query_starts)]
    out, lse, grad = (t.float().contiguous() for t in (out_NHD, lse_NH, grad_NHD))
    dq = torch.empty(n, heads, head_dim)
    rows: torch.Tensor | int = 0  # 0: K / V are pages
    grad_rows: torch.Tensor | int = 0
    grad_shape: tuple[int, ...] = tuple(k.shape)
    if rows_PP is None:
        num_pages, _, page, _ = k.shape
    else:
        if grad_rows_PP is None or grad_rows_PP.shape != rows_PP.shape:
            raise ValueError("native attention over K / V rows takes the gradient row of each slot, grad_rows_PP, of "
                             f"the shape of rows_PP {tuple(rows_PP.shape)}")  # fmt: skip
        (num_pages, page), grad_shape = rows_PP.shape, (num_grad_rows, kv_heads, head_dim)
        rows, grad_rows = (t.to(torch.int64).contiguous() for t in (rows_PP, grad_rows_PP))
    dk, dv = torch.zeros(grad_shape), torch.zeros(grad_shape)
    run("native_attention_backward", state[f"attention_bwd_{DTYPES[k.dtype]}"], q.data_ptr(), k.data_ptr(),
         v.data_ptr(), n, heads, kv_heads, head_dim, page, *(t.data_ptr() for t in ints[:3]), ints[2].shape[1], scale,
         window or 0, _pointer(rows), ints[3].shape[0] - 1, ints[3].data_ptr(), num_pages, _pointer(grad_rows),
         out.data_ptr(), lse.data_ptr(), grad.data_ptr(), dq.data_ptr(), dk.data_ptr(), dv.data_ptr(),
         torch.get_num_threads())  # fmt: skip
    return dq, dk, dv


def _norm_operands(x: torch.Tensor, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x as contiguous rows (M, H) and the weight, in one dtype the kernels read (float16 as float32)."""
    if x.device.type != "cpu" or weight.device.type != "cpu":
        raise ValueError(f"native RMSNorm runs on CPU tensors; got {x.device} and {weight.device}")
    if weight.dim() != 1 or x.shape[-1] != weight.shape[0]:
        raise ValueError(f"native RMSNorm takes x (..., H) and a weight (H,); got {tuple(x.shape)} and "
                         f"{tuple(weight.shape)}")  # fmt: skip
    dtype = x.dtype if x.dtype in DTYPES and weight.dtype == x.dtype else torch.float32
    return x.reshape(-1, x.shape[-1]).to(dtype).contiguous(), weight.to(dtype).contiguous()


def native_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """`weight * (x * r)`, r = 1 / sqrt(mean(x^2) + eps), each row in one fixed order (norm.cpp): float32 (M, H) rows
    (M = x's leading dims) for the caller to round once, and r (M,)."""
    state = kernels()
    rows, w = _norm_operands(x, weight)
    out, inverse = torch.empty(rows.shape), torch.empty(rows.shape[0])
    run("native_rms_norm", state[f"rms_norm_fwd_{DTYPES[rows.dtype]}"], rows.data_ptr(), w.data_ptr(),
         out.data_ptr(), inverse.data_ptr(), *rows.shape, eps, torch.get_num_threads())  # fmt: skip
    return out, inverse


def native_rms_norm_backward(
    x: torch.Tensor, weight: torch.Tensor, grad: torch.Tensor, eps: float, weight_grad: bool = True
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """dx (M, H) and dw (H,) (None unless `weight_grad`) of `native_rms_norm`, float32: dx = r (g - n mean(g n)),
    g = dy w, n = x r, row by row; dw = the sum over rows, in order, of dy n."""
    state = kernels()
    rows, w = _norm_operands(x, weight)
    grad_rows = grad.reshape(rows.shape).to(rows.dtype).contiguous()
    dx = torch.empty(rows.shape)
    dw = torch.empty(rows.shape[1]) if weight_grad else None
    run("native_rms_norm_backward", state[f"rms_norm_bwd_{DTYPES[rows.dtype]}"], rows.data_ptr(), w.data_ptr(),
         grad_rows.data_ptr(), dx.data_ptr(), 0 if dw is None else dw.data_ptr(), *rows.shape, eps,
         torch.get_num_threads())  # fmt: skip
    return dx, dw


def _rope_operands(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[int, int, int, int]:
    """(N, H, D, R) of x (N, H, D) and cos / sin (N, R): contiguous float32 CPU tensors, R even and <= D."""
    tensors = (x, cos, sin)
    if any(t.device.type != "cpu" or t.dtype != torch.float32 or not t.is_contiguous() for t in tensors):
        raise ValueError(f"native RoPE takes contiguous float32 CPU tensors; got "
                         f"{[(t.dtype, str(t.device), t.is_contiguous()) for t in tensors]}")  # fmt: skip
    if x.dim() != 3 or cos.dim() != 2 or cos.shape != sin.shape or cos.shape[0] != x.shape[0]:
        raise ValueError(f"native RoPE takes x (N, H, D) and cos / sin (N, R); got {tuple(x.shape)}, "
                         f"{tuple(cos.shape)} and {tuple(sin.shape)}")  # fmt: skip
    (n, heads, dim), rotary = x.shape, cos.shape[1]
    if rotary % 2 or rotary > dim:
        raise ValueError(f"native RoPE rotates an even number of dimensions <= the head's {dim}; got {rotary}")
    return n, heads, dim, rotary


def native_rope(x_NHD: torch.Tensor, cos_NR: torch.Tensor, sin_NR: torch.Tensor) -> torch.Tensor:
    """`miles_kernels.ops.rope.apply_rope`'s rotation (rotate-half; the dimensions past R pass through) in one call
    (rope.cpp): the bits of its torch form. float32 (N, H, D) rows and (N, R) tables, contiguous, on the CPU."""
    return _rope("native_rope", "rope_fwd", x_NHD, cos_NR, sin_NR)


def native_rope_backward(grad_NHD: torch.Tensor, cos_NR: torch.Tensor, sin_NR: torch.Tensor) -> torch.Tensor:
    """The gradient of `native_rope` with respect to x, given the output's (the bits of the torch form's backward,
    `ops.rope._Rope`)."""
    return _rope("native_rope_backward", "rope_bwd", grad_NHD, cos_NR, sin_NR)


def _rope(name: str, kernel: str, x_NHD: torch.Tensor, cos_NR: torch.Tensor, sin_NR: torch.Tensor) -> torch.Tensor:
    state = kernels()
    shape = _rope_operands(x_NHD, cos_NR, sin_NR)
    out = torch.empty_like(x_NHD)
    run(name, state[kernel], x_NHD.data_ptr(), cos_NR.data_ptr(), sin_NR.data_ptr(), out.data_ptr(), *shape,
         torch.get_num_threads())  # fmt: skip
    return out
