"""Causal GQA attention over a paged KV store, for both callers of the model.

- The rollout engine keeps K/V in a paged cache; each forward brings a chunk of new query tokens per sequence
  (a whole prompt, a prefill chunk after a cached prefix, or one decode token).
- The trainer runs packed variable-length sequences; its K/V go to a temporary paged store laid out the same
  way, so the trainer runs *exactly* the engine's attention code.

Deterministic mode runs the blocked attention (ops/blocked_attention.py: fixed tiles and key blocks, an online
softmax in ascending block order; batch-invariant by construction) or the native one.
The `native` backend (miles_kernels/native, attention.cpp) computes each (token, head) row on its own in one C++
call per layer: an online softmax over chunks of min(page, 16) keys aligned to absolute positions, ascending, from
the row's position, query and keys alone, so it is batch-invariant by construction (no tiles); its hand-written
backward runs in C++ too. Its bits are its own (not the blocked attention's): the fingerprint names the backend.
Fast mode (`torch-hybrid`) runs the same blocked attention for decode and short chunks, and
`scaled_dot_product_attention` over K/V gathered into a padded batch (decode rows in one call, each prefill chunk in
its own) where a sequence brings a long chunk; `torch-sdpa` always runs the latter.

Shapes: N query tokens, S sequences, H query heads, Hkv KV heads, G = H / Hkv, D head dim, P page size,
NT query tiles, Tq tile rows. K/V pages are head-major: (pages, Hkv, P, D), so gathering a block's pages
gives GEMM-ready operands. Page 0 of every store is a zero "null" page that block tables are padded with. The
layout (`AttentionBatch`, its builders, the block plans and chunks) is `ops/attention_batch.py`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F

from miles_kernels import native
from miles_kernels.ops.attention_batch import AttentionBatch, num_pages_needed
from miles_kernels.ops.blocked_attention import BlockedAttention, blocked_attention
from miles_kernels.ops.kv_pages import kv_writes, scratch_pages
from miles_kernels.registry import get_backend, register_backend
from miles_kernels.triton_ops import triton_available

if TYPE_CHECKING:
    from miles_kernels.config import KernelConfig  # annotations only: config imports the ops to resolve backends


def attention(
    q_NHD: torch.Tensor,
    k_pages_PgHPD: torch.Tensor,
    v_pages_PgHPD: torch.Tensor,
    batch: AttentionBatch,
    scale: float,
    config: KernelConfig,
    window: int | None = None,
) -> torch.Tensor:
    """Causal attention of the batch's query tokens over their sequences' stored keys (a sliding `window`: each
    query sees only its last `window` keys, itself included); returns (N, H, D)."""
    backend = get_backend(f"attention:{config.mode}", config.attention_backend)
    out: torch.Tensor = backend.fn(q_NHD, k_pages_PgHPD, v_pages_PgHPD, batch, scale, window)
    return out


def packed_attention(
    q_NHD: torch.Tensor,
    k_NKD: torch.Tensor,
    v_NKD: torch.Tensor,
    batch: AttentionBatch,
    scale: float,
    config: KernelConfig,
    window: int | None = None,
) -> torch.Tensor:
    """Attention of a forward with no KV cache (the trainer's): the keys are the batch's own tokens (K/V (N, Hkv, D)),
    laid out in a temporary paged store exactly as the engine's cache holds them, so the forward runs the engine's
    code. Differentiable. The native attention runs `_NativeAttention` (its C++ forward and backward), the blocked
    attention `BlockedAttention`: the engine's forward plus a hand-written backward (a FlashAttention-style
    recomputation over the same blocks); another backend is differentiated through its own ops."""
    num_pages = num_pages_needed(batch)
    backend = get_backend(f"attention:{config.mode}", config.attention_backend).fn
    grad = torch.is_grad_enabled() and any(t.requires_grad for t in (q_NHD, k_NKD, v_NKD))
    if backend is _triton_attention and grad:
        triton_out: torch.Tensor = _TritonAttention.apply(q_NHD, k_NKD, v_NKD, batch, scale, num_pages, window)
        return triton_out
    if backend in (_native_attention, _native_fast_attention) and q_NHD.is_cuda:  # what they run on CUDA tensors
        backend = blocked_attention if backend is _native_attention else _hybrid_attention
    if backend in (_native_attention, _native_fast_attention):
        if grad:
            native_out: torch.Tensor = _NativeAttention.apply(q_NHD, k_NKD, v_NKD, batch, scale, num_pages, window)
            return native_out
        rows, _ = batch.slot_rows(num_pages)  # K/V read as rows in place: no page store built
        native_out, _ = native.native_attention(
            q_NHD, k_NKD, v_NKD, batch.positions_N, batch.token_seqs(), batch.block_tables_SB, scale, window, rows
        )
        return native_out.to(q_NHD.dtype)
    if backend is blocked_attention or (backend is _hybrid_attention and not _uses_sdpa(batch)):
        if grad:
            out: torch.Tensor = BlockedAttention.apply(q_NHD, k_NKD, v_NKD, batch, scale, num_pages, window)
            return out
        return blocked_attention(q_NHD, *scratch_pages(k_NKD, v_NKD, batch, num_pages), batch, scale, window)
    shape = (num_pages, k_NKD.shape[1], batch.page_size, k_NKD.shape[2])
    k_all, v_all, where = kv_writes(k_NKD, v_NKD, batch)  # out of place: gradients flow through the backend's ops
    k_pages = k_NKD.new_zeros(shape).index_put(where, k_all)
    v_pages = v_NKD.new_zeros(shape).index_put(where, v_all)
    return attention(q_NHD, k_pages, v_pages, batch, scale, config, window)


def _native_attention(
    q_NHD: torch.Tensor,
    k_pages: torch.Tensor,
    v_pages: torch.Tensor,
    batch: AttentionBatch,
    scale: float,
    window: int | None = None,
) -> torch.Tensor:
    """The native attention (module docstring); CUDA tensors run the blocked attention."""
    if q_NHD.is_cuda:
        return blocked_attention(q_NHD, k_pages, v_pages, batch, scale, window)
    if torch.is_grad_enabled() and any(t.requires_grad for t in (q_NHD, k_pages, v_pages)):
        out: torch.Tensor = _NativeAttention.apply(q_NHD, k_pages, v_pages, batch, scale, None, window)
        return out
    native_out, _ = native.native_attention(
        q_NHD, k_pages, v_pages, batch.positions_N, batch.token_seqs(), batch.block_tables_SB, scale, window
    )
    return native_out.to(q_NHD.dtype)


class _NativeAttention(torch.autograd.Function):
    """The native attention with its C++ backward (native.native_attention_backward). Inputs are K/V pages, or K/V
    per token (`num_pages` given), as for `BlockedAttention`: those are read in place as the rows of the slots of a
    `num_pages` store (`AttentionBatch.slot_rows`), with the bits that store would give, and their gradients are the
    slots' sums as `read_tokens` gathers them (a token's own slot, plus its copies' in order)."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        q_NHD: torch.Tensor,
        k_in: torch.Tensor,
        v_in: torch.Tensor,
        batch: AttentionBatch,
        scale: float,
        num_pages: int | None,
        window: int | None,
    ) -> torch.Tensor:
        rows = None if num_pages is None else batch.slot_rows(num_pages)[0]
        seqs_N = batch.token_seqs()
        out, lse = native.native_attention(
            q_NHD, k_in, v_in, batch.positions_N, seqs_N, batch.block_tables_SB, scale, window, rows
        )
        ctx.save_for_backward(q_NHD, k_in, v_in, seqs_N, out, lse)
        ctx.batch, ctx.scale, ctx.window, ctx.num_pages = batch, scale, window, num_pages
        ctx.dtypes = (q_NHD.dtype, k_in.dtype, v_in.dtype)
        return out.to(q_NHD.dtype)

    @staticmethod
    def backward(ctx: Any, grad_NHD: torch.Tensor) -> tuple[torch.Tensor | None, ...]:  # type: ignore[override]
        q_NHD, k_in, v_in, seqs_N, out, lse = ctx.saved_tensors
        batch: AttentionBatch = ctx.batch
        query_starts = F.pad(batch.query_lens_S.cumsum(0), (1, 0))
        rows, grad_rows = (None, None) if ctx.num_pages is None else batch.slot_rows(ctx.num_pages)
        num_tokens, num_copies = batch.num_tokens, batch.copy_tokens_C.numel()
        dq, dk, dv = native.native_attention_backward(
            q_NHD, k_in, v_in, batch.positions_N, seqs_N, batch.block_tables_SB, query_starts, ctx.scale, ctx.window,
            out, lse, grad_NHD, rows, grad_rows, num_tokens + num_copies,
        )  # fmt: skip
        if rows is not None and num_copies:  # each copy's slot sum added to its token's, in order (`read_tokens`)
            copies = batch.copy_tokens_C.to(dk.device)
            dk, dv = (grads[:num_tokens].index_add_(0, copies, grads[num_tokens:]) for grads in (dk, dv))
        elif rows is not None:
            dk, dv = dk[:num_tokens], dv[:num_tokens]
        q_dtype, k_dtype, v_dtype = ctx.dtypes
        return dq.to(q_dtype), dk.to(k_dtype), dv.to(v_dtype), None, None, None, None


def _sdpa_attention(
    q_NHD: torch.Tensor,
    k_pages: torch.Tensor,
    v_pages: torch.Tensor,
    batch: AttentionBatch,
    scale: float,
    window: int | None = None,
) -> torch.Tensor:
    """Fast mode: decode sequences (one query each) in one padded SDPA call, each prefill chunk in its own, so a
    long prompt in the batch never pads every decode row to its length."""
    out = torch.empty_like(q_NHD)
    starts = (torch.cumsum(batch.query_lens_S, 0) - batch.query_lens_S).tolist()
    lengths = batch.query_lens_S.tolist()
    decode = [s for s, n in enumerate(lengths) if n == 1]
    groups = ([decode] if decode else []) + [[s] for s, n in enumerate(lengths) if n > 1]
    for seqs in groups:
        tokens = torch.cat([torch.arange(starts[s], starts[s] + lengths[s]) for s in seqs]).to(q_NHD.device)
        lengths_of = [lengths[s] for s in seqs]
        out[tokens] = _sdpa_group(q_NHD, k_pages, v_pages, batch, scale, window, seqs, lengths_of, tokens)
    return out


# Fast mode's default (`torch-hybrid`): a batch whose sequences all bring fewer new tokens than this runs the blocked
# attention, any other runs SDPA. Measured on the reference CPU (8 sequences, 4 KV heads of 64, one layer): blocked
# vs SDPA 1.1 vs 4.6 ms at 16 new tokens each, 4.0 vs 6.3 at 32, 10.2 vs 6.7 at 64, 34.4 vs 10.4 at 128.
HYBRID_SDPA_FROM_TOKENS = 48


def _hybrid_attention(
    q_NHD: torch.Tensor,
    k_pages: torch.Tensor,
    v_pages: torch.Tensor,
    batch: AttentionBatch,
    scale: float,
    window: int | None = None,
) -> torch.Tensor:
    """Fast mode: the blocked attention for decode and short chunks (SDPA would gather every sequence's K/V into a
    padded batch per layer), SDPA where some sequence brings a long chunk (the blocked kernel's per-block GEMMs grow
    with the square of its length)."""
    if _uses_sdpa(batch):
        return _sdpa_attention(q_NHD, k_pages, v_pages, batch, scale, window)
    return blocked_attention(q_NHD, k_pages, v_pages, batch, scale, window)


def _native_fast_attention(
    q_NHD: torch.Tensor,
    k_pages: torch.Tensor,
    v_pages: torch.Tensor,
    batch: AttentionBatch,
    scale: float,
    window: int | None = None,
) -> torch.Tensor:
    """Fast mode's `native`: the native attention on the CPU (faster than SDPA over gathered K/V at every chunk length
    measured, `benchmarks/kernels.py`), `torch-hybrid` on CUDA tensors."""
    if q_NHD.is_cuda:
        return _hybrid_attention(q_NHD, k_pages, v_pages, batch, scale, window)
    return _native_attention(q_NHD, k_pages, v_pages, batch, scale, window)


def _uses_sdpa(batch: AttentionBatch) -> bool:
    return int(batch.query_lens_S.max()) >= HYBRID_SDPA_FROM_TOKENS


def _sdpa_group(
    q_NHD: torch.Tensor,
    k_pages: torch.Tensor,
    v_pages: torch.Tensor,
    batch: AttentionBatch,
    scale: float,
    window: int | None,
    seqs: list[int],
    lengths: list[int],
    tokens: torch.Tensor,
) -> torch.Tensor:
    num_heads, head_dim = q_NHD.shape[1], q_NHD.shape[2]
    num_kv_heads, page = k_pages.shape[1], k_pages.shape[2]
    device = q_NHD.device
    seq_index = torch.tensor(seqs, device=device)
    num_blocks = int((batch.kv_lens_S[seq_index].max().item() + page - 1) // page)
    tables = batch.block_tables_SB[seq_index, :num_blocks]
    num_seqs, max_keys = len(seqs), num_blocks * page
    # (S, B, Hkv, P, D) -> (S, Hkv, B * P, D)
    k_SHLD = k_pages[tables].transpose(1, 2).reshape(num_seqs, num_kv_heads, max_keys, head_dim)
    v_SHLD = v_pages[tables].transpose(1, 2).reshape(num_seqs, num_kv_heads, max_keys, head_dim)
    max_q = max(lengths)
    seq_of_row = torch.repeat_interleave(torch.arange(num_seqs, device=device), torch.tensor(lengths, device=device))
    row_starts = torch.tensor([sum(lengths[:i]) for i in range(num_seqs)], device=device)
    slot = torch.arange(len(tokens), device=device) - row_starts[seq_of_row]
    q_SQHD = q_NHD.new_zeros(num_seqs, max_q, num_heads, head_dim)
    q_SQHD[seq_of_row, slot] = q_NHD[tokens]
    q_pos = torch.full((num_seqs, max_q), -1, dtype=torch.int64, device=device)
    q_pos[seq_of_row, slot] = batch.positions_N[tokens]
    key_pos = torch.arange(max_keys, device=device)
    visible = key_pos[None, None, :] <= q_pos[:, :, None]
    if window is not None:
        visible &= key_pos[None, None, :] > q_pos[:, :, None] - window
    mask = visible | (q_pos[:, :, None] < 0)  # pad rows see all: no NaN
    out = F.scaled_dot_product_attention(
        q_SQHD.transpose(1, 2), k_SHLD, v_SHLD, attn_mask=mask[:, None], scale=scale,
        enable_gqa=num_heads != num_kv_heads,
    ).transpose(1, 2)  # fmt: skip
    return out[seq_of_row, slot]


def _triton_attention(
    q_NHD: torch.Tensor,
    k_pages: torch.Tensor,
    v_pages: torch.Tensor,
    batch: AttentionBatch,
    scale: float,
    window: int | None = None,
) -> torch.Tensor:
    """Deterministic mode on a GPU: the Triton kernel (miles_kernels/triton_ops/attention.py, imported on first
    use), one program per (token, KV head, split of its keys) over key blocks in ascending order."""
    from miles_kernels.triton_ops.attention import paged_attention

    return paged_attention(q_NHD, k_pages, v_pages, batch, scale, window)


class _TritonAttention(torch.autograd.Function):
    """The trainer's Triton attention: the kernel's forward (the engine's bits) over the batch's own K/V, and the
    gradient of the same function taken through the blocked attention (recomputed in the backward; only the forward
    has to match the engine)."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, q_NHD: torch.Tensor, k_NKD: torch.Tensor, v_NKD: torch.Tensor, batch: AttentionBatch, scale: float,
        num_pages: int, window: int | None,
    ) -> torch.Tensor:  # fmt: skip
        ctx.save_for_backward(q_NHD, k_NKD, v_NKD)
        ctx.batch, ctx.scale, ctx.num_pages, ctx.window = batch, scale, num_pages, window
        return _triton_attention(q_NHD, *scratch_pages(k_NKD, v_NKD, batch, num_pages), batch, scale, window)

    @staticmethod
    def backward(ctx: Any, grad_NHD: torch.Tensor) -> tuple[torch.Tensor | None, ...]:  # type: ignore[override]
        needed = ctx.needs_input_grad[:3]
        inputs = [t.detach().requires_grad_(n) for t, n in zip(ctx.saved_tensors, needed, strict=True)]
        with torch.enable_grad():
            out = BlockedAttention.apply(*inputs, ctx.batch, ctx.scale, ctx.num_pages, ctx.window)
            wanted = [t for t in inputs if t.requires_grad]
            grads = iter(torch.autograd.grad(out, wanted, grad_NHD))
        return (*(next(grads) if t.requires_grad else None for t in inputs), None, None, None, None)


# Deterministic mode needs a batch-invariant backend; fast mode takes the fastest usable one. The Triton kernel is
# chosen by name (kernel.attention_backend=triton) until its GPU speed is measured; `auto` keeps torch-blocked.
register_backend("attention:deterministic", "torch-blocked", blocked_attention)
register_backend("attention:deterministic", "triton", _triton_attention, is_available=triton_available,
                 priority=-1)  # fmt: skip
# The native kernels (miles_kernels/native): `auto` in both modes where the library built and loads (on CUDA tensors
# the blocked attention in deterministic mode, torch-hybrid in fast mode); the torch backends otherwise, or by name.
register_backend("attention:deterministic", "native", _native_attention, is_available=native.status, priority=1)
register_backend("attention:fast", "torch-sdpa", _sdpa_attention)
register_backend("attention:fast", "torch-hybrid", _hybrid_attention, priority=1)
register_backend("attention:fast", "native", _native_fast_attention, is_available=native.status, priority=2)
