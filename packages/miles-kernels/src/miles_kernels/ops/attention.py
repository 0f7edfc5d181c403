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
- Tiles are ordered by descending last position, so the tiles that reach a key block are a prefix of the tile
  list: per-block state is sliced (views), not gathered. Tile order never changes a tile's arithmetic.
Fast mode: one `scaled_dot_product_attention` over the batch padded to its longest sequence.

Shapes: N query tokens, S sequences, H query heads, Hkv KV heads, G = H / Hkv, D head dim, P page size,
NT query tiles, Tq tile rows. K/V pages are head-major: (pages, Hkv, P, D), so gathering a block's pages
gives GEMM-ready operands. Page 0 of every store is a zero "null" page that block tables are padded with.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field, fields, replace

import torch
import torch.nn.functional as F

from miles_kernels.config import KernelConfig
from miles_kernels.ops.linear import invariant_bmm
from miles_kernels.registry import get_backend, register_backend

NULL_PAGE = 0
_NO_COPIES = torch.zeros(0, dtype=torch.int64)


@dataclass(frozen=True)
class BlockPlan:
    """The query tiles that see key block `block`, their pages, and which (row, key) pairs are visible."""

    block: int
    num_active: int  # tiles are sorted by descending last position, so the active ones are a prefix
    pages_A: torch.Tensor  # page holding this block for each active tile's sequence
    visible_A_rows_P: torch.Tensor  # key position <= row position (causal mask), rows = (t, g) pairs


@dataclass(frozen=True)
class AttentionBatch:
    """Where the query tokens of one forward call sit, and which KV pages each sequence owns.

    Built once per forward and shared by every layer (the block plans are computed lazily, once).
    """

    positions_N: torch.Tensor  # absolute position of each query token (int64)
    write_pages_N: torch.Tensor  # page where each token's K/V is stored
    write_offsets_N: torch.Tensor  # offset of the token inside that page
    block_tables_SB: torch.Tensor  # page ids of each sequence's key blocks, padded with NULL_PAGE
    kv_lens_S: torch.Tensor  # keys per sequence after this call (prefix + new tokens)
    query_lens_S: torch.Tensor  # new query tokens per sequence (packed in sequence order)
    page_size: int
    # Query tiles (deterministic attention): token index of each tile row, the row's position, and the
    # tile's sequence; padding rows repeat the tile's last token.
    tile_tokens_NT_Tq: torch.Tensor
    tile_positions_NT_Tq: torch.Tensor
    tile_seq_NT: torch.Tensor
    tile_row_of_token_N: torch.Tensor  # where each token sits in the flattened tiles
    # Extra K/V writes (trainer batches with shared prompts): token copy_tokens_C[c]'s K/V also goes to page
    # copy_pages_C[c] at copy_offsets_C[c] (a prompt's partial page, copied for each sequence that continues it).
    copy_tokens_C: torch.Tensor = field(default_factory=lambda: _NO_COPIES)
    copy_pages_C: torch.Tensor = field(default_factory=lambda: _NO_COPIES)
    copy_offsets_C: torch.Tensor = field(default_factory=lambda: _NO_COPIES)
    _plans: dict[int, list[BlockPlan]] = field(default_factory=dict, repr=False, compare=False)

    @property
    def num_tokens(self) -> int:
        return int(self.positions_N.shape[0])

    def to(self, device: torch.device | str) -> AttentionBatch:
        """This batch with its tensors on `device` (itself when they are there already)."""
        if self.positions_N.device == torch.device(device):
            return self
        tensors = [f.name for f in fields(self) if f.name not in ("page_size", "_plans")]
        return replace(self, **{name: getattr(self, name).to(device) for name in tensors}, _plans={})

    @property
    def num_seqs(self) -> int:
        return int(self.kv_lens_S.shape[0])

    def block_plans(self, group: int) -> list[BlockPlan]:
        """Per key block: active tiles, their pages and causal masks, for `group` query heads per KV head."""
        if group not in self._plans:
            self._plans[group] = self._make_block_plans(group)
        return self._plans[group]

    def _make_block_plans(self, group: int) -> list[BlockPlan]:
        page = self.page_size
        row_positions = self.tile_positions_NT_Tq.repeat_interleave(group, dim=1)  # rows are (t, g), g fastest
        tile_max_position = self.tile_positions_NT_Tq.max(dim=1).values
        tile_tables = self.block_tables_SB[self.tile_seq_NT]
        key_offsets = torch.arange(page, device=row_positions.device)
        plans = []
        for block in range(int(tile_max_position.max().item()) // page + 1):
            num_active = int((tile_max_position >= block * page).sum().item())
            visible = (block * page + key_offsets)[None, None, :] <= row_positions[:num_active, :, None]
            plans.append(BlockPlan(block, num_active, tile_tables[:num_active, block], visible))
        return plans


def build_attention_batch(
    query_lens: list[int],
    prefix_lens: list[int],
    block_tables: list[list[int]],
    page_size: int,
    query_tile: int,
    device: torch.device | str = "cpu",
) -> AttentionBatch:
    """Lay out sequences that bring `query_lens[s]` new tokens after `prefix_lens[s]` cached ones.

    `block_tables[s]` lists the pages holding sequence s's keys in order; it must cover prefix + new tokens.
    """
    if not (len(query_lens) == len(prefix_lens) == len(block_tables)):
        raise ValueError("query_lens, prefix_lens and block_tables need one entry per sequence")
    positions: list[int] = []
    pages_of_token: list[int] = []
    tile_tokens: list[list[int]] = []
    tile_positions: list[list[int]] = []
    tile_seq: list[int] = []
    row_of_token: list[int] = []
    num_blocks = max((len(t) for t in block_tables), default=0)
    token = 0
    for s, (num_new, prefix, pages) in enumerate(zip(query_lens, prefix_lens, block_tables, strict=True)):
        if num_new < 1:
            raise ValueError(f"sequence {s} brings no query tokens; every sequence needs at least one")
        if len(pages) * page_size < prefix + num_new:
            raise ValueError(f"sequence {s}: {len(pages)} pages of {page_size} cannot hold {prefix + num_new} tokens")
        seq_positions = list(range(prefix, prefix + num_new))
        positions += seq_positions
        pages_of_token += [pages[p // page_size] for p in seq_positions]
        for start in range(0, num_new, query_tile):
            rows = list(range(token + start, token + min(start + query_tile, num_new)))
            row_of_token += [len(tile_tokens) * query_tile + r for r in range(len(rows))]
            pad = query_tile - len(rows)
            tile_tokens.append(rows + [rows[-1]] * pad)
            row_positions = seq_positions[start : start + len(rows)]
            tile_positions.append(row_positions + [row_positions[-1]] * pad)
            tile_seq.append(s)
        token += num_new
    padded_tables = [list(t) + [NULL_PAGE] * (num_blocks - len(t)) for t in block_tables]
    # Longest-reaching tiles first, so the tiles that see key block j are always a prefix (views, not gathers).
    order = sorted(range(len(tile_tokens)), key=lambda i: -tile_positions[i][-1])
    new_index = {old: new for new, old in enumerate(order)}
    row_of_token = [new_index[r // query_tile] * query_tile + r % query_tile for r in row_of_token]
    tile_tokens = [tile_tokens[i] for i in order]
    tile_positions = [tile_positions[i] for i in order]
    tile_seq = [tile_seq[i] for i in order]

    def as_tensor(values: list[int] | list[list[int]]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int64, device=device)

    return AttentionBatch(
        positions_N=as_tensor(positions),
        write_pages_N=as_tensor(pages_of_token),
        write_offsets_N=as_tensor(positions) % page_size,
        block_tables_SB=as_tensor(padded_tables).reshape(len(block_tables), num_blocks),
        kv_lens_S=as_tensor([p + n for p, n in zip(prefix_lens, query_lens, strict=True)]),
        query_lens_S=as_tensor(query_lens),
        page_size=page_size,
        tile_tokens_NT_Tq=as_tensor(tile_tokens).reshape(len(tile_tokens), query_tile),
        tile_positions_NT_Tq=as_tensor(tile_positions).reshape(len(tile_tokens), query_tile),
        tile_seq_NT=as_tensor(tile_seq),
        tile_row_of_token_N=as_tensor(row_of_token),
    )


def build_packed_batch(
    seq_lens: list[int],
    page_size: int,
    query_tile: int,
    device: torch.device | str = "cpu",
    parents: Sequence[int | None] | None = None,
) -> AttentionBatch:
    """Packed sequences with no cached prefix (the trainer): pages 1, 2, ... are laid out in order.

    `parents[s]` (optional): an earlier sequence whose tokens come before sequence s's — a prompt packed once
    for all the responses that continue it. Sequence s then attends to the parent's keys and its positions
    continue the parent's, laid out as the engine forks a prefilled prompt: the parent's full pages are shared
    and its partial page is copied into a page of s's own (copy writes). A row's arithmetic depends only on
    its position and keys, so each response's rows equal, bit for bit, those of the prompt + response packed
    as one sequence. A parent cannot itself have a parent.
    """
    parents = list(parents) if parents is not None else [None] * len(seq_lens)
    if len(parents) != len(seq_lens):
        raise ValueError(f"got {len(parents)} parents for {len(seq_lens)} sequences; give one (or None) each")
    starts = [0, *itertools.accumulate(seq_lens)]  # first packed token of each sequence
    tables: list[list[int]] = []
    prefix_lens: list[int] = []
    copies: list[tuple[int, int, int]] = []  # (token, page, offset)
    next_page = NULL_PAGE + 1
    for s, (length, parent) in enumerate(zip(seq_lens, parents, strict=True)):
        table: list[int] = []
        prefix = 0
        if parent is not None:
            if not 0 <= parent < s or parents[parent] is not None:
                raise ValueError(f"sequence {s}: parent {parent} must be an earlier sequence without a parent")
            prefix = seq_lens[parent]
            num_full = prefix // page_size
            table = tables[parent][:num_full]
            if prefix > num_full * page_size:
                table = [*table, next_page]
                copies += [(starts[parent] + p, next_page, p % page_size) for p in range(num_full * page_size, prefix)]
                next_page += 1
        num_new_pages = -(-(prefix + length) // page_size) - len(table)
        tables.append(table + list(range(next_page, next_page + num_new_pages)))
        next_page += num_new_pages
        prefix_lens.append(prefix)
    batch = build_attention_batch(seq_lens, prefix_lens, tables, page_size, query_tile, device)
    if not copies:
        return batch
    columns = zip(*copies, strict=True)
    tokens, pages, offsets = (torch.tensor(column, dtype=torch.int64, device=device) for column in columns)
    return replace(batch, copy_tokens_C=tokens, copy_pages_C=pages, copy_offsets_C=offsets)


def num_pages_needed(batch: AttentionBatch) -> int:
    """Pages a temporary store needs for this batch (the null page included)."""
    return int(batch.block_tables_SB.max().item()) + 1 if batch.block_tables_SB.numel() else 1


def attention(
    q_NHD: torch.Tensor,
    k_pages_PgHPD: torch.Tensor,
    v_pages_PgHPD: torch.Tensor,
    batch: AttentionBatch,
    scale: float,
    config: KernelConfig,
) -> torch.Tensor:
    """Causal attention of the batch's query tokens over their sequences' stored keys; returns (N, H, D)."""
    backend = get_backend(f"attention:{config.mode}", config.attention_backend)
    out: torch.Tensor = backend.fn(q_NHD, k_pages_PgHPD, v_pages_PgHPD, batch, scale)
    return out


def _blocked_attention(
    q_NHD: torch.Tensor, k_pages: torch.Tensor, v_pages: torch.Tensor, batch: AttentionBatch, scale: float
) -> torch.Tensor:
    num_heads, head_dim = q_NHD.shape[1], q_NHD.shape[2]
    num_kv_heads, page = k_pages.shape[1], k_pages.shape[2]
    group = num_heads // num_kv_heads
    num_tiles, tile = batch.tile_tokens_NT_Tq.shape
    rows = tile * group
    # (NT, Tq, Hkv, G, D) -> (NT, Hkv, Tq * G, D): each KV head sees one fixed-shape query matrix per tile.
    q_tiles = q_NHD.to(torch.float32)[batch.tile_tokens_NT_Tq]
    q_tiles = q_tiles.reshape(num_tiles, tile, num_kv_heads, group, head_dim).permute(0, 2, 1, 3, 4)
    q_tiles = q_tiles.reshape(num_tiles, num_kv_heads, rows, head_dim).contiguous()

    # The online-softmax state, started by key block 0 (every tile sees it).
    acc: torch.Tensor
    running_sum: torch.Tensor
    running_max: torch.Tensor
    for plan in batch.block_plans(group):
        # Tiles wholly before this block skip it; the rest run the same fixed-shape GEMMs. GEMM operands always
        # have one memory layout (contiguous gathers; K transposed as a view): a strided view and a copy of the
        # same values can take different BLAS paths.
        active = plan.num_active
        k_blk = k_pages[plan.pages_A].to(torch.float32).reshape(-1, page, head_dim)  # (A * Hkv, P, D)
        v_blk = v_pages[plan.pages_A].to(torch.float32).reshape(-1, page, head_dim)
        scores = invariant_bmm(q_tiles[:active].reshape(-1, rows, head_dim), k_blk.transpose(1, 2))
        scores = (scores * scale).reshape(active, num_kv_heads, rows, page)
        scores = scores.masked_fill(~plan.visible_A_rows_P[:, None], float("-inf"))
        if plan.block == 0:  # the online softmax starts here: no running state to rescale yet
            running_max = scores.amax(dim=-1, keepdim=True)
            probs = torch.exp(scores - running_max)
            acc = invariant_bmm(probs.reshape(-1, rows, page), v_blk).reshape(active, num_kv_heads, rows, head_dim)
            running_sum = probs.sum(dim=-1, keepdim=True)
            continue
        old_max = running_max[:active]
        block_max = torch.maximum(old_max, scores.amax(dim=-1, keepdim=True))
        probs = torch.exp(scores - block_max)
        correction = torch.exp(old_max - block_max)
        pv = invariant_bmm(probs.reshape(-1, rows, page), v_blk).reshape(active, num_kv_heads, rows, head_dim)
        new_acc = acc[:active] * correction + pv
        new_sum = running_sum[:active] * correction + probs.sum(dim=-1, keepdim=True)
        if active == num_tiles:
            acc, running_sum, running_max = new_acc, new_sum, block_max
        else:  # out of place, so the trainer's backward sees every intermediate
            acc = torch.cat((new_acc, acc[active:]))
            running_sum = torch.cat((new_sum, running_sum[active:]))
            running_max = torch.cat((block_max, running_max[active:]))
    out = acc / running_sum  # (NT, Hkv, Tq * G, D)
    out = out.reshape(num_tiles, num_kv_heads, tile, group, head_dim).permute(0, 2, 1, 3, 4)
    out = out.reshape(num_tiles * tile, num_heads, head_dim)[batch.tile_row_of_token_N]
    return out.to(q_NHD.dtype)


def _sdpa_attention(
    q_NHD: torch.Tensor, k_pages: torch.Tensor, v_pages: torch.Tensor, batch: AttentionBatch, scale: float
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
        out[tokens] = _sdpa_group(q_NHD, k_pages, v_pages, batch, scale, seqs, [lengths[s] for s in seqs], tokens)
    return out


def _sdpa_group(
    q_NHD: torch.Tensor,
    k_pages: torch.Tensor,
    v_pages: torch.Tensor,
    batch: AttentionBatch,
    scale: float,
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
    mask = (key_pos[None, None, :] <= q_pos[:, :, None]) | (q_pos[:, :, None] < 0)  # pad rows see all: no NaN
    out = F.scaled_dot_product_attention(
        q_SQHD.transpose(1, 2), k_SHLD, v_SHLD, attn_mask=mask[:, None], scale=scale,
        enable_gqa=num_heads != num_kv_heads,
    ).transpose(1, 2)  # fmt: skip
    return out[seq_of_row, slot]


# Deterministic mode needs a batch-invariant backend; fast mode takes the fastest usable one. GPU kernels
# (FA3 and friends) register here with an `is_available` check in a later issue.
register_backend("attention:deterministic", "torch-blocked", _blocked_attention)
register_backend("attention:fast", "torch-sdpa", _sdpa_attention)
