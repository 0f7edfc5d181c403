"""Causal GQA attention over a paged KV store, for both callers of the model.

- The rollout engine keeps K/V in a paged cache; each forward brings a chunk of new query tokens per sequence
  (a whole prompt, a prefill chunk after a cached prefix, or one decode token).
- The trainer runs packed variable-length sequences; its K/V go to a temporary paged store laid out the same
  way, so the trainer runs *exactly* the engine's attention code.

Deterministic mode (batch-invariant by construction):
- Keys are split into blocks of `page_size` tokens aligned to absolute positions (one block = one page).
- Queries are cut into tiles of `attention_query_tile` rows of one sequence; each KV head's tile is a fixed
  (tile * group, head_dim) matrix. Scores and P@V are fixed-shape `bmm`s, one per (tile, head, key block).
- Softmax is online over key blocks in ascending order. A block that lies wholly after a query's position is
  fully masked for it and is an exact no-op (scale 1, adds exact zeros), so a query's arithmetic depends only on
  its own position and keys, whatever the tile, chunk, batch or prefix-cache state around it.
- Padding rows in a tile copy the tile's last real position (never a NaN row) and are dropped.
- Sliding-window layers (`window`: a row sees its last `window` keys) mask the keys before the window too. A row
  whose running max is still -inf (every block so far before its window) takes its block's max as 0 when shifting:
  its probabilities and corrections are exact zeros, so those blocks leave its state exactly empty, and its first
  visible block starts it as block 0 starts any other row. A row still depends only on its position and keys.
- Tiles are ordered by descending last position, so the tiles that reach a key block are a prefix of the tile
  list: per-block state is sliced (views), not gathered. Tile order never changes a tile's arithmetic.
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
from miles_kernels.ops.attention_batch import AttentionBatch, BlockChunk, num_pages_needed
from miles_kernels.ops.linear import invariant_bmm
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


def write_kv(
    k_pages: torch.Tensor, v_pages: torch.Tensor, k_NKD: torch.Tensor, v_NKD: torch.Tensor, batch: AttentionBatch
) -> None:
    """Store each token's K/V at its page and offset, in place (and the batch's copy writes, see `AttentionBatch`).
    One store for both (`v_pages is k_pages`, MLA's latent cache) is written once. Contiguous stores take the rows as
    one `index_copy_` each at the batch's flat slots (`AttentionBatch.kv_write_slots`, shared by the layers)."""
    stores = (k_pages,) if v_pages is k_pages else (k_pages, v_pages)
    if not all(store.is_contiguous() and store.dim() == 4 and store.shape[2] == batch.page_size for store in stores):
        k_all, v_all, where = _kv_writes(k_NKD, v_NKD, batch)
        k_pages.index_put_(where, k_all.to(k_pages.dtype))
        if v_pages is not k_pages:
            v_pages.index_put_(where, v_all.to(v_pages.dtype))
        return
    slots = batch.kv_write_slots(k_NKD.shape[1])
    for store, rows in zip(stores, (k_NKD, v_NKD), strict=False):
        if batch.copy_tokens_C.numel():
            rows = torch.cat((rows, rows[batch.copy_tokens_C]))
        store.view(-1, store.shape[-1]).index_copy_(0, slots, rows.reshape(-1, store.shape[-1]).to(store.dtype))


def _kv_writes(
    k_NKD: torch.Tensor, v_NKD: torch.Tensor, batch: AttentionBatch
) -> tuple[torch.Tensor, torch.Tensor, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """The K/V rows a forward stores (the tokens', then their copies') and the (page, head, offset) index of each."""
    pages, offsets = batch.write_pages_N, batch.write_offsets_N
    if batch.copy_tokens_C.numel():
        k_NKD, v_NKD = torch.cat((k_NKD, k_NKD[batch.copy_tokens_C])), torch.cat((v_NKD, v_NKD[batch.copy_tokens_C]))
        pages, offsets = torch.cat((pages, batch.copy_pages_C)), torch.cat((offsets, batch.copy_offsets_C))
    heads = torch.arange(k_NKD.shape[1], device=k_NKD.device)
    return k_NKD, v_NKD, (pages[:, None], heads[None, :], offsets[:, None])


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
    attention `_BlockedAttention`: the engine's forward plus a hand-written backward (a FlashAttention-style
    recomputation over the same blocks); another backend is differentiated through its own ops."""
    num_pages = num_pages_needed(batch)
    backend = get_backend(f"attention:{config.mode}", config.attention_backend).fn
    grad = torch.is_grad_enabled() and any(t.requires_grad for t in (q_NHD, k_NKD, v_NKD))
    if backend is _triton_attention and grad:
        triton_out: torch.Tensor = _TritonAttention.apply(q_NHD, k_NKD, v_NKD, batch, scale, num_pages, window)
        return triton_out
    if backend in (_native_attention, _native_fast_attention) and q_NHD.is_cuda:  # what they run on CUDA tensors
        backend = _blocked_attention if backend is _native_attention else _hybrid_attention
    if backend in (_native_attention, _native_fast_attention):
        if grad:
            native_out: torch.Tensor = _NativeAttention.apply(q_NHD, k_NKD, v_NKD, batch, scale, num_pages, window)
            return native_out
        return _native_attention(q_NHD, *_scratch_pages(k_NKD, v_NKD, batch, num_pages), batch, scale, window)
    if backend is _blocked_attention or (backend is _hybrid_attention and not _uses_sdpa(batch)):
        if grad:
            out: torch.Tensor = _BlockedAttention.apply(q_NHD, k_NKD, v_NKD, batch, scale, num_pages, window)
            return out
        return _blocked_attention(q_NHD, *_scratch_pages(k_NKD, v_NKD, batch, num_pages), batch, scale, window)
    shape = (num_pages, k_NKD.shape[1], batch.page_size, k_NKD.shape[2])
    k_all, v_all, where = _kv_writes(k_NKD, v_NKD, batch)  # out of place: gradients flow through the backend's ops
    k_pages = k_NKD.new_zeros(shape).index_put(where, k_all)
    v_pages = v_NKD.new_zeros(shape).index_put(where, v_all)
    return attention(q_NHD, k_pages, v_pages, batch, scale, config, window)


def _scratch_pages(
    k_NKD: torch.Tensor, v_NKD: torch.Tensor, batch: AttentionBatch, num_pages: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """A temporary K/V page store (zeros, the null page included) holding the batch's own tokens, written in place
    (one store when the keys are the values, as MLA's latent is)."""
    shape = (num_pages, k_NKD.shape[1], batch.page_size, k_NKD.shape[2])
    k_pages = k_NKD.new_zeros(shape)
    v_pages = k_pages if v_NKD is k_NKD else v_NKD.new_zeros(shape)
    write_kv(k_pages, v_pages, k_NKD, v_NKD, batch)
    return k_pages, v_pages


# Bytes of gathered K/V, queries and scores per batched chunk of the blocked attention: few ops per layer, while a
# chunk's operands stay in cache (on the reference CPU, 64-row decode at ~300 cached tokens: 12.9 ms per layer with 4
# MiB, 20.9 ms with 16 MiB, 37.7 ms with 64 MiB, 21.5 ms block by block).
MAX_CHUNK_BYTES = 4 << 20


def _max_pairs(num_kv_heads: int, rows: int, page: int, head_dim: int) -> int:
    pair_bytes = 4 * num_kv_heads * (2 * page * head_dim + 2 * rows * head_dim + 2 * rows * page)
    return max(1, MAX_CHUNK_BYTES // pair_bytes)


def _query_tiles(q_NHD: torch.Tensor, batch: AttentionBatch, num_kv_heads: int) -> torch.Tensor:
    """(NT, Tq, Hkv, G, D) -> (NT, Hkv, Tq * G, D) float32: each KV head sees one fixed-shape query matrix per tile."""
    num_heads, head_dim = q_NHD.shape[1], q_NHD.shape[2]
    num_tiles, tile = batch.tile_tokens_NT_Tq.shape
    group = num_heads // num_kv_heads
    q_tiles = q_NHD.to(torch.float32).index_select(0, batch.tile_tokens_NT_Tq.view(-1))
    q_tiles = q_tiles.reshape(num_tiles, tile, num_kv_heads, group, head_dim).permute(0, 2, 1, 3, 4)
    return q_tiles.reshape(num_tiles, num_kv_heads, tile * group, head_dim).contiguous()


def _token_rows(tiles_NT_Hkv_R_D: torch.Tensor, batch: AttentionBatch) -> torch.Tensor:
    """The tokens' rows of a tile-layout tensor, as (N, H, D) (padding rows dropped)."""
    num_tiles, num_kv_heads, rows, head_dim = tiles_NT_Hkv_R_D.shape
    tile = batch.tile_tokens_NT_Tq.shape[1]
    tile_N, row_N = batch.token_tile_rows()
    out = tiles_NT_Hkv_R_D.view(num_tiles, num_kv_heads, tile, rows // tile, head_dim)[tile_N, :, row_N]
    return out.reshape(tile_N.shape[0], num_kv_heads * (rows // tile), head_dim)


def _chunk_scores(
    q_tiles: torch.Tensor, k_pages: torch.Tensor, chunk: BlockChunk, scale: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The chunk's masked scores (X, Hkv, rows, P) and its gathered queries (X * Hkv, rows, D) and float32 K
    (X, Hkv, P, D). One `bmm` of fixed-shape (rows, D) @ (D, P) products, the same per pair whatever the chunk holds;
    operands are contiguous gathers (one memory layout for every call: a strided view and a copy of the same values
    can take different BLAS paths)."""
    _, num_kv_heads, rows, head_dim = q_tiles.shape
    page = k_pages.shape[2]
    num_pairs = chunk.pair_tiles_X.shape[0]
    q_x = q_tiles.index_select(0, chunk.pair_tiles_X).view(-1, rows, head_dim)
    k_x = k_pages.index_select(0, chunk.pair_pages_X).to(torch.float32)
    scores = invariant_bmm(q_x, k_x.view(-1, page, head_dim).transpose(1, 2))
    scores = scores.mul_(scale).view(num_pairs, num_kv_heads, rows, page)
    if chunk.hidden_X_rows_P is not None:
        scores.masked_fill_(chunk.hidden_X_rows_P[:, None], float("-inf"))
    return scores, q_x, k_x


def _online_softmax(
    q_tiles: torch.Tensor,
    k_pages: torch.Tensor,
    v_pages: torch.Tensor,
    batch: AttentionBatch,
    scale: float,
    window: int | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The blocked attention's forward on tiles: (normalized output (NT, Hkv, rows, D), running max, running sum),
    float32, no autograd.

    Per key block b, in ascending order, for its active tiles (a prefix):
        m_b = max(m_{b-1}, rowmax(s_b));  p_b = exp(s_b - m_b);  c_b = exp(m_{b-1} - m_b)
        acc_b = acc_{b-1} * c_b + p_b @ v_b;  sum_b = sum_{b-1} * c_b + rowsum(p_b)
    (block 0 starts with m_0 = rowmax(s_0), acc_0 = p_0 @ v_0, sum_0 = rowsum(p_0)). A fully masked block is an exact
    no-op for a row (c = 1, adds exact zeros). A chunk's scores, maxes (a cumulative max over its blocks: max is
    exact), p_b, c_b, p_b @ v_b and row sums run as batched ops, each pair's arithmetic that of its own fixed-shape
    product; only the accumulator update (its last column the running sum) goes block by block, two ops each.
    With a `window`, m_b may still be -inf (no visible key yet): the shift is then 0 (see the module docstring).
    """
    num_tiles, num_kv_heads, rows, head_dim = q_tiles.shape
    page = k_pages.shape[2]
    # The accumulator and, in its last column, the running sum: both follow x_b = x_{b-1} * c_b + y_b.
    acc = q_tiles.new_empty(num_tiles, num_kv_heads, rows, head_dim + 1)
    running_max = q_tiles.new_full((num_tiles, num_kv_heads, rows, 1), float("-inf"))
    max_pairs = _max_pairs(num_kv_heads, rows, page, head_dim)
    for chunk in batch.block_chunks(rows // batch.tile_tokens_NT_Tq.shape[1], max_pairs, window):
        scores, _, _ = _chunk_scores(q_tiles, k_pages, chunk, scale)
        if len(chunk.plans) == 1:  # one block: its active tiles' maxes directly
            active = chunk.plans[0].num_active
            block_max = torch.maximum(running_max[:active], scores.amax(dim=-1, keepdim=True))
            shift = _shift(block_max, window)
            corrections = torch.exp(running_max[:active] - shift)
            running_max[:active] = block_max
        else:
            # m_b for every pair at once: a cumulative max over the chunk's blocks (exact, as max is), from the state
            # carried in; tiles a block does not reach keep -inf there, so they carry their max through it.
            maxes = running_max.new_full((len(chunk.plans) + 1, *running_max.shape), float("-inf"))
            maxes[0] = running_max
            maxes[chunk.pair_blocks_X + 1, chunk.pair_tiles_X] = scores.amax(dim=-1, keepdim=True)
            maxes = torch.cummax(maxes, dim=0).values
            shift = _shift(maxes[chunk.pair_blocks_X + 1, chunk.pair_tiles_X], window)
            corrections = torch.exp(maxes[chunk.pair_blocks_X, chunk.pair_tiles_X] - shift)
            running_max = maxes[-1]
        probs = scores.sub_(shift).exp_()
        v_x = v_pages.index_select(0, chunk.pair_pages_X).to(torch.float32).view(-1, page, head_dim)
        pv = invariant_bmm(probs.view(-1, rows, page), v_x).view(-1, num_kv_heads, rows, head_dim)
        updates = torch.cat((pv, probs.sum(dim=-1, keepdim=True)), dim=-1)
        for plan, start, end in zip(chunk.plans, chunk.starts, chunk.starts[1:], strict=False):
            if plan.block == 0:  # the online softmax starts here (every tile sees block 0)
                acc.copy_(updates[start:end])
            else:
                acc[: plan.num_active].mul_(corrections[start:end]).add_(updates[start:end])
    running_sum = acc[..., head_dim:]
    return acc[..., :head_dim] / running_sum, running_max, running_sum


def _shift(block_max: torch.Tensor, window: int | None) -> torch.Tensor:
    """What a block's scores are shifted by: m_b, or 0 for a windowed row that has seen no visible key yet (its
    probabilities and corrections are then exact zeros, where -inf - -inf would give NaN)."""
    if window is None:  # every row sees key 0: m_b is finite from block 0 on
        return block_max
    return block_max.masked_fill(block_max == float("-inf"), 0.0)


def _blocked_attention(
    q_NHD: torch.Tensor,
    k_pages: torch.Tensor,
    v_pages: torch.Tensor,
    batch: AttentionBatch,
    scale: float,
    window: int | None = None,
) -> torch.Tensor:
    if torch.is_grad_enabled() and any(t.requires_grad for t in (q_NHD, k_pages, v_pages)):
        out: torch.Tensor = _BlockedAttention.apply(q_NHD, k_pages, v_pages, batch, scale, None, window)
        return out
    q_tiles = _query_tiles(q_NHD, batch, k_pages.shape[1])
    out_tiles, _, _ = _online_softmax(q_tiles, k_pages, v_pages, batch, scale, window)
    return _token_rows(out_tiles, batch).to(q_NHD.dtype)


class _BlockedAttention(torch.autograd.Function):
    """The blocked attention with a hand-written backward. The forward is `_online_softmax` (the engine's bits);
    the backward recomputes each chunk's scores from the saved queries and pages and the saved log-sum-exp:
        p = exp(s - lse), dv = p^T dO, dp = dO v^T, ds = p (dp - rowsum(dO o)) scale, dq = ds k, dk = ds^T q,
    accumulating dk / dv per page with `index_add_` (deterministic on the CPU). Inputs are either K/V pages, or K/V
    per token (`num_pages` given: they are written into a temporary store inside, and their gradients read back
    from it), which spares autograd a copy of the store per layer."""

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
        k_pages, v_pages = (k_in, v_in) if num_pages is None else _scratch_pages(k_in, v_in, batch, num_pages)
        q_tiles = _query_tiles(q_NHD, batch, k_pages.shape[1])
        out_tiles, running_max, running_sum = _online_softmax(q_tiles, k_pages, v_pages, batch, scale, window)
        ctx.save_for_backward(q_tiles, k_pages, v_pages, out_tiles, running_max + torch.log(running_sum))
        ctx.batch, ctx.scale, ctx.window, ctx.per_token = batch, scale, window, num_pages is not None
        ctx.dtypes = (q_NHD.dtype, k_in.dtype, v_in.dtype)
        return _token_rows(out_tiles, batch).to(q_NHD.dtype)

    @staticmethod
    def backward(ctx: Any, grad_NHD: torch.Tensor) -> tuple[torch.Tensor | None, ...]:  # type: ignore[override]
        q_tiles, k_pages, v_pages, out_tiles, lse = ctx.saved_tensors
        batch: AttentionBatch = ctx.batch
        num_tiles, num_kv_heads, rows, head_dim = q_tiles.shape
        tile = batch.tile_tokens_NT_Tq.shape[1]
        page = k_pages.shape[2]
        grad_tiles = torch.zeros_like(out_tiles)  # padding rows get no gradient
        tile_N, row_N = batch.token_tile_rows()
        grad_view = grad_tiles.view(num_tiles, num_kv_heads, tile, rows // tile, head_dim)
        grad_view[tile_N, :, row_N] = grad_NHD.to(torch.float32).view(-1, num_kv_heads, rows // tile, head_dim)
        delta = (grad_tiles * out_tiles).sum(dim=-1, keepdim=True)
        dq_tiles = torch.zeros_like(q_tiles)
        dk_pages = torch.zeros(k_pages.shape, dtype=torch.float32, device=k_pages.device)
        dv_pages = torch.zeros_like(dk_pages)
        for chunk in batch.block_chunks(rows // tile, _max_pairs(num_kv_heads, rows, page, head_dim), ctx.window):
            tiles = chunk.pair_tiles_X
            scores, q_x, k_x = _chunk_scores(q_tiles, k_pages, chunk, ctx.scale)
            probs = scores.sub_(lse.index_select(0, tiles)).exp_().view(-1, rows, page)
            grad_x = grad_tiles.index_select(0, tiles).view(-1, rows, head_dim)
            v_x = v_pages.index_select(0, chunk.pair_pages_X).to(torch.float32).view(-1, page, head_dim)
            dv_pages.index_add_(
                0, chunk.pair_pages_X, torch.bmm(probs.transpose(1, 2), grad_x).view(-1, num_kv_heads, page, head_dim)
            )
            dscores = torch.bmm(grad_x, v_x.transpose(1, 2)).view(-1, num_kv_heads, rows, page)
            dscores = (
                dscores.sub_(delta.index_select(0, tiles))
                .mul_(probs.view_as(dscores))
                .mul_(ctx.scale)
                .view(-1, rows, page)
            )
            dq_x = torch.bmm(dscores, k_x.view(-1, page, head_dim)).view(-1, num_kv_heads, rows, head_dim)
            dq_tiles.index_add_(0, tiles, dq_x)
            dk_pages.index_add_(
                0, chunk.pair_pages_X, torch.bmm(dscores.transpose(1, 2), q_x).view(-1, num_kv_heads, page, head_dim)
            )
        q_dtype, k_dtype, v_dtype = ctx.dtypes
        dq = _token_rows(dq_tiles, batch).to(q_dtype)
        if not ctx.per_token:
            return dq, dk_pages.to(k_dtype), dv_pages.to(v_dtype), None, None, None, None
        dk, dv = (_read_tokens(pages, batch) for pages in (dk_pages, dv_pages))
        return dq, dk.to(k_dtype), dv.to(v_dtype), None, None, None, None


def _read_tokens(pages: torch.Tensor, batch: AttentionBatch) -> torch.Tensor:
    """The gradient of `write_kv`: each token's entry (N, Hkv, D), plus its copy writes' entries."""
    out = pages[batch.write_pages_N, :, batch.write_offsets_N]
    if batch.copy_tokens_C.numel():
        out.index_add_(0, batch.copy_tokens_C, pages[batch.copy_pages_C, :, batch.copy_offsets_C])
    return out


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
        return _blocked_attention(q_NHD, k_pages, v_pages, batch, scale, window)
    if torch.is_grad_enabled() and any(t.requires_grad for t in (q_NHD, k_pages, v_pages)):
        out: torch.Tensor = _NativeAttention.apply(q_NHD, k_pages, v_pages, batch, scale, None, window)
        return out
    native_out, _ = native.native_attention(
        q_NHD, k_pages, v_pages, batch.positions_N, batch.token_seqs(), batch.block_tables_SB, scale, window
    )
    return native_out.to(q_NHD.dtype)


class _NativeAttention(torch.autograd.Function):
    """The native attention with its C++ backward (native.native_attention_backward). Inputs are K/V pages, or K/V
    per token (`num_pages` given), as for `_BlockedAttention`."""

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
        k_pages, v_pages = (k_in, v_in) if num_pages is None else _scratch_pages(k_in, v_in, batch, num_pages)
        seqs_N = batch.token_seqs()
        out, lse = native.native_attention(
            q_NHD, k_pages, v_pages, batch.positions_N, seqs_N, batch.block_tables_SB, scale, window
        )
        ctx.save_for_backward(q_NHD, k_pages, v_pages, seqs_N, out, lse)
        ctx.batch, ctx.scale, ctx.window, ctx.per_token = batch, scale, window, num_pages is not None
        ctx.dtypes = (q_NHD.dtype, k_in.dtype, v_in.dtype)
        return out.to(q_NHD.dtype)

    @staticmethod
    def backward(ctx: Any, grad_NHD: torch.Tensor) -> tuple[torch.Tensor | None, ...]:  # type: ignore[override]
        q_NHD, k_pages, v_pages, seqs_N, out, lse = ctx.saved_tensors
        batch: AttentionBatch = ctx.batch
        query_starts = F.pad(batch.query_lens_S.cumsum(0), (1, 0))
        dq, dk_pages, dv_pages = native.native_attention_backward(
            q_NHD, k_pages, v_pages, batch.positions_N, seqs_N, batch.block_tables_SB, query_starts, ctx.scale,
            ctx.window, out, lse, grad_NHD,
        )  # fmt: skip
        q_dtype, k_dtype, v_dtype = ctx.dtypes
        if not ctx.per_token:
            return dq.to(q_dtype), dk_pages.to(k_dtype), dv_pages.to(v_dtype), None, None, None, None
        dk, dv = (_read_tokens(pages, batch) for pages in (dk_pages, dv_pages))
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
    return _blocked_attention(q_NHD, k_pages, v_pages, batch, scale, window)


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
        return _triton_attention(q_NHD, *_scratch_pages(k_NKD, v_NKD, batch, num_pages), batch, scale, window)

    @staticmethod
    def backward(ctx: Any, grad_NHD: torch.Tensor) -> tuple[torch.Tensor | None, ...]:  # type: ignore[override]
        needed = ctx.needs_input_grad[:3]
        inputs = [t.detach().requires_grad_(n) for t, n in zip(ctx.saved_tensors, needed, strict=True)]
        with torch.enable_grad():
            out = _BlockedAttention.apply(*inputs, ctx.batch, ctx.scale, ctx.num_pages, ctx.window)
            wanted = [t for t in inputs if t.requires_grad]
            grads = iter(torch.autograd.grad(out, wanted, grad_NHD))
        return (*(next(grads) if t.requires_grad else None for t in inputs), None, None, None, None)


# Deterministic mode needs a batch-invariant backend; fast mode takes the fastest usable one. The Triton kernel is
# chosen by name (kernel.attention_backend=triton) until its GPU speed is measured; `auto` keeps torch-blocked.
register_backend("attention:deterministic", "torch-blocked", _blocked_attention)
register_backend("attention:deterministic", "triton", _triton_attention, is_available=triton_available,
                 priority=-1)  # fmt: skip
# The native kernels (miles_kernels/native): `auto` in both modes where the library built and loads (on CUDA tensors
# the blocked attention in deterministic mode, torch-hybrid in fast mode); the torch backends otherwise, or by name.
register_backend("attention:deterministic", "native", _native_attention, is_available=native.status, priority=1)
register_backend("attention:fast", "torch-sdpa", _sdpa_attention)
register_backend("attention:fast", "torch-hybrid", _hybrid_attention, priority=1)
register_backend("attention:fast", "native", _native_fast_attention, is_available=native.status, priority=2)
