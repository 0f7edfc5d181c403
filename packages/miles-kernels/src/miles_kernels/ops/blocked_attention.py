"""The blocked attention: Miles' deterministic attention in torch ops (`torch-blocked`, and fast mode's `torch-hybrid`
for decode and short chunks), the engine's forward and the trainer's hand-written backward (`BlockedAttention`).
ops/attention.py dispatches to it; miles_kernels/native/attention.cpp is the native backend.

Batch-invariant by construction:
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

Shapes: N query tokens, H query heads, Hkv KV heads, G = H / Hkv, D head dim, P page size, NT query tiles, Tq tile
rows; K/V pages (pages, Hkv, P, D), page 0 the null page.
"""

from __future__ import annotations

from typing import Any

import torch

from miles_kernels.ops.attention_batch import AttentionBatch, BlockChunk
from miles_kernels.ops.kv_pages import read_tokens, scratch_pages
from miles_kernels.ops.linear import invariant_bmm

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


def blocked_attention(
    q_NHD: torch.Tensor,
    k_pages: torch.Tensor,
    v_pages: torch.Tensor,
    batch: AttentionBatch,
    scale: float,
    window: int | None = None,
) -> torch.Tensor:
    if torch.is_grad_enabled() and any(t.requires_grad for t in (q_NHD, k_pages, v_pages)):
        out: torch.Tensor = BlockedAttention.apply(q_NHD, k_pages, v_pages, batch, scale, None, window)
        return out
    q_tiles = _query_tiles(q_NHD, batch, k_pages.shape[1])
    out_tiles, _, _ = _online_softmax(q_tiles, k_pages, v_pages, batch, scale, window)
    return _token_rows(out_tiles, batch).to(q_NHD.dtype)


class BlockedAttention(torch.autograd.Function):
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
        k_pages, v_pages = (k_in, v_in) if num_pages is None else scratch_pages(k_in, v_in, batch, num_pages)
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
        dk, dv = (read_tokens(pages, batch) for pages in (dk_pages, dv_pages))
        return dq, dk.to(k_dtype), dv.to(v_dtype), None, None, None, None
