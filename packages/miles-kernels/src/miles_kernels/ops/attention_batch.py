"""Where the query tokens of one attention call sit, and which KV pages hold their keys: `AttentionBatch`, its
builders (`build_attention_batch` for the engine's cache, `build_packed_batch` for the trainer's packed sequences)
and the per-key-block plans of the blocked attention, grouped into chunks (`AttentionBatch.block_chunks`).

The attention itself, and why it is laid out this way, is `ops/attention.py`. Shapes as there: N query tokens,
S sequences, NT query tiles, Tq tile rows, A active tiles of a block, X (tile, block) pairs of a chunk, P page size.
Page 0 of every store is a zero "null" page that block tables are padded with.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field, fields, replace

import torch

NULL_PAGE = 0
_NO_COPIES = torch.zeros(0, dtype=torch.int64)


@dataclass(frozen=True)
class BlockPlan:
    """The query tiles that see key block `block`, their pages, and which (row, key) pairs are visible."""

    block: int
    num_active: int  # tiles are sorted by descending last position, so the active ones are a prefix
    pages_A: torch.Tensor  # page holding this block for each active tile's sequence
    visible_A_rows_P: torch.Tensor  # row position - window < key position <= row position, rows = (t, g) pairs


@dataclass(frozen=True)
class BlockChunk:
    """Consecutive key blocks whose (tile, block) pairs run in one set of batched ops, block-major: block b's pairs
    are its active tiles 0..A_b - 1 (X pairs in all)."""

    plans: list[BlockPlan]
    starts: list[int]  # where each block's pairs start (len(plans) + 1 entries)
    pair_tiles_X: torch.Tensor  # the query tile of each pair
    pair_blocks_X: torch.Tensor  # the pair's block, counted from the chunk's first
    pair_pages_X: torch.Tensor  # the page holding the pair's key block
    hidden_X_rows_P: torch.Tensor | None  # key after the row's position (None: every key is visible)


@dataclass(frozen=True)
class AttentionBatch:
    """Where the query tokens of one forward call sit, and which KV pages each sequence owns.

    Built once per forward and shared by every layer (the query tiles and block plans are computed lazily, once).
    """

    positions_N: torch.Tensor  # absolute position of each query token (int64)
    write_pages_N: torch.Tensor  # page where each token's K/V is stored
    write_offsets_N: torch.Tensor  # offset of the token inside that page
    block_tables_SB: torch.Tensor  # page ids of each sequence's key blocks, padded with NULL_PAGE
    kv_lens_S: torch.Tensor  # keys per sequence after this call (prefix + new tokens)
    query_lens_S: torch.Tensor  # new query tokens per sequence (packed in sequence order)
    page_size: int
    query_tile: int  # rows of the blocked attention's query tiles (`tile_tokens_NT_Tq`, ...)
    # Extra K/V writes (trainer batches with shared prompts): token copy_tokens_C[c]'s K/V also goes to page
    # copy_pages_C[c] at copy_offsets_C[c] (a prompt's partial page, copied for each sequence that continues it).
    copy_tokens_C: torch.Tensor = field(default_factory=lambda: _NO_COPIES)
    copy_pages_C: torch.Tensor = field(default_factory=lambda: _NO_COPIES)
    copy_offsets_C: torch.Tensor = field(default_factory=lambda: _NO_COPIES)
    _plans: dict[tuple[int, int, int | None], list[BlockChunk]] = field(
        default_factory=dict, repr=False, compare=False
    )
    _derived: dict[str, torch.Tensor] = field(default_factory=dict, repr=False, compare=False)  # token_seqs, ...

    @property
    def num_tokens(self) -> int:
        return int(self.positions_N.shape[0])

    def to(self, device: torch.device | str) -> AttentionBatch:
        """This batch with its tensors on `device` (itself when they are there already)."""
        if self.positions_N.device == torch.device(device):
            return self
        tensors = [f.name for f in fields(self) if f.name not in ("page_size", "query_tile", "_plans", "_derived")]
        tiles = {name: t.to(device) for name, t in self._derived.items() if name.startswith("tile_")}  # if built
        return replace(self, **{name: getattr(self, name).to(device) for name in tensors}, _plans={}, _derived=tiles)

    def compacted(self, num_pages: int) -> tuple[torch.Tensor, AttentionBatch]:
        """The pages this batch reads or writes, ascending from the null page (U,), and this batch with its page ids
        renumbered 0 .. U - 1 to match: attention over a store of just those pages (`num_pages`: the full store's)
        gives the same rows. For a form of the keys computed per page (MLA's expanded K / V, latent_attention.py)."""
        copies = self.copy_pages_C.to(self.write_pages_N)
        used = torch.cat((self.block_tables_SB.flatten(), self.write_pages_N, copies))
        used = torch.unique(torch.cat((used.new_zeros(1), used)))  # sorted: the null page first
        renumber = used.new_zeros(num_pages)
        renumber[used] = torch.arange(len(used), device=used.device)
        pages = {"block_tables_SB": self.block_tables_SB, "write_pages_N": self.write_pages_N,
                 "copy_pages_C": self.copy_pages_C.to(used.device)}  # fmt: skip
        return used, replace(self, **{name: renumber[ids] for name, ids in pages.items()}, _plans={}, _derived={})

    @property
    def num_seqs(self) -> int:
        return int(self.kv_lens_S.shape[0])

    def block_chunks(self, group: int, max_pairs: int, window: int | None = None) -> list[BlockChunk]:
        """The key blocks, in ascending order, grouped into chunks of at most `max_pairs` (tile, block) pairs (a
        block with more active tiles is a chunk of its own), for `group` query heads per KV head and a sliding
        `window` (a row sees its last `window` keys, itself included; None: every earlier key); computed once per
        batch and shared by every layer with that window.

        A block's active tiles are those whose last row reaches it, windowed or not: the blocks before a row's
        window are fully masked for it (ops/attention.py keeps them exact no-ops), so the active tiles stay a
        prefix of the tile list. A windowed layer therefore costs what a full-attention one does."""
        key = (group, max_pairs, window)
        if key not in self._plans:
            self._plans[key] = _chunk_plans(self._make_block_plans(group, window), max_pairs)
        return self._plans[key]

    def token_seqs(self) -> torch.Tensor:
        """The sequence of each query token (N,): tokens are packed in sequence order (computed once per batch)."""
        if "seqs" not in self._derived:
            seqs = torch.arange(self.num_seqs, device=self.query_lens_S.device)
            self._derived["seqs"] = torch.repeat_interleave(seqs, self.query_lens_S)
        return self._derived["seqs"]

    def kv_write_slots(self, kv_heads: int) -> torch.Tensor:
        """Where each written K/V row goes in a page store of `kv_heads` heads viewed as rows ((pages x heads x
        slots), D): (N + C) x kv_heads indices, the tokens' rows then their copies' (`copy_tokens_C`), each token's
        heads in order (computed once per batch and head count, shared by every layer)."""
        key = f"kv_slots_{kv_heads}"
        if key not in self._derived:
            pages, offsets = self.write_pages_N, self.write_offsets_N
            if self.copy_tokens_C.numel():
                pages = torch.cat((pages, self.copy_pages_C.to(pages.device)))
                offsets = torch.cat((offsets, self.copy_offsets_C.to(offsets.device)))
            heads = torch.arange(kv_heads, device=pages.device)
            slots = (pages[:, None] * kv_heads + heads[None, :]) * self.page_size + offsets[:, None]
            self._derived[key] = slots.flatten()
        return self._derived[key]

    def slot_rows(self, num_pages: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K/V kept as the batch's own rows (N, Hkv, D) instead of a temporary page store (the trainer's native
        attention): the row each slot (page, offset) of a `num_pages` store would hold — token t's write slot row t,
        copy c's slot row copy_tokens_C[c] — and the row its gradient goes to (t; N + c for copy c), (num_pages, P)
        each, 0 where nothing is written (never read). Computed once per batch, shared by the layers."""
        key = f"slot_rows_{num_pages}"
        if key not in self._derived:
            device, tokens = self.write_pages_N.device, self.num_tokens
            where = self.write_pages_N * self.page_size + self.write_offsets_N
            copies = self.copy_pages_C.to(device) * self.page_size + self.copy_offsets_C.to(device)
            rows, grad_rows = (torch.zeros(num_pages * self.page_size, dtype=torch.int64, device=device)
                               for _ in range(2))  # fmt: skip
            rows[where] = grad_rows[where] = torch.arange(tokens, device=device)
            rows[copies] = self.copy_tokens_C.to(device)
            grad_rows[copies] = torch.arange(tokens, tokens + len(copies), device=device)
            self._derived[key] = rows.view(num_pages, -1)
            self._derived[key + "_grad"] = grad_rows.view(num_pages, -1)
        return self._derived[key], self._derived[key + "_grad"]

    # Query tiles (the blocked attention's; built on first use, once: the native attention never reads them, and a
    # decode step of 64 sequences spent ~1 ms building them): token index of each tile row, the row's position, the
    # tile's sequence (padding rows repeat the tile's last token), where each token sits in the flattened tiles.
    @property
    def tile_tokens_NT_Tq(self) -> torch.Tensor:
        return self._tiles()[0]

    @property
    def tile_positions_NT_Tq(self) -> torch.Tensor:
        return self._tiles()[1]

    @property
    def tile_seq_NT(self) -> torch.Tensor:
        return self._tiles()[2]

    @property
    def tile_row_of_token_N(self) -> torch.Tensor:
        return self._tiles()[3]

    def _tiles(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        if "tile_tokens" not in self._derived:
            tiles = _query_tiles(self.query_lens_S.tolist(), self.positions_N.tolist(), self.query_tile)
            tokens, positions, seqs, rows = (torch.tensor(t, dtype=torch.int64, device=self.positions_N.device)
                                             for t in tiles)  # fmt: skip
            tile = self.query_tile
            self._derived.update(tile_tokens=tokens.reshape(-1, tile), tile_positions=positions.reshape(-1, tile),
                                 tile_seq=seqs, tile_row_of_token=rows)  # fmt: skip
        d = self._derived
        return d["tile_tokens"], d["tile_positions"], d["tile_seq"], d["tile_row_of_token"]

    def token_tile_rows(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(tile, row in the tile) of each token: where its query and output sit in the tiles."""
        tile = self.tile_tokens_NT_Tq.shape[1]
        return self.tile_row_of_token_N // tile, self.tile_row_of_token_N % tile

    def _make_block_plans(self, group: int, window: int | None) -> list[BlockPlan]:
        page = self.page_size
        row_positions = self.tile_positions_NT_Tq.repeat_interleave(group, dim=1)  # rows are (t, g), g fastest
        tile_max_position = self.tile_positions_NT_Tq.max(dim=1).values
        tile_tables = self.block_tables_SB[self.tile_seq_NT]
        key_offsets = torch.arange(page, device=row_positions.device)
        plans = []
        for block in range(int(tile_max_position.max().item()) // page + 1):
            num_active = int((tile_max_position >= block * page).sum().item())
            keys = (block * page + key_offsets)[None, None, :]
            rows = row_positions[:num_active, :, None]
            visible = keys <= rows
            if window is not None:
                visible &= keys > rows - window
            plans.append(BlockPlan(block, num_active, tile_tables[:num_active, block], visible))
        return plans


def _chunk_plans(plans: list[BlockPlan], max_pairs: int) -> list[BlockChunk]:
    groups: list[list[BlockPlan]] = []
    pairs = 0
    for plan in plans:
        if not groups or pairs + plan.num_active > max_pairs:
            groups.append([])
            pairs = 0
        groups[-1].append(plan)
        pairs += plan.num_active
    chunks = []
    for group in groups:
        starts = [0, *itertools.accumulate(plan.num_active for plan in group)]
        device = group[0].pages_A.device
        tiles = torch.cat([torch.arange(plan.num_active, device=device) for plan in group])
        blocks = torch.cat([torch.full((plan.num_active,), b, device=device) for b, plan in enumerate(group)])
        visible = torch.cat([plan.visible_A_rows_P for plan in group])
        hidden = None if bool(visible.all()) else ~visible
        chunks.append(BlockChunk(group, starts, tiles, blocks, torch.cat([plan.pages_A for plan in group]), hidden))
    return chunks


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
    num_blocks = max((len(t) for t in block_tables), default=0)
    for s, (num_new, prefix, pages) in enumerate(zip(query_lens, prefix_lens, block_tables, strict=True)):
        if num_new < 1:
            raise ValueError(f"sequence {s} brings no query tokens; every sequence needs at least one")
        if len(pages) * page_size < prefix + num_new:
            raise ValueError(f"sequence {s}: {len(pages)} pages of {page_size} cannot hold {prefix + num_new} tokens")
        positions += range(prefix, prefix + num_new)
        pages_of_token += [pages[p // page_size] for p in range(prefix, prefix + num_new)]
    padded_tables = [list(t) + [NULL_PAGE] * (num_blocks - len(t)) for t in block_tables]

    def as_tensor(values: list[int] | list[list[int]]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int64, device=device)

    positions_N = as_tensor(positions)
    return AttentionBatch(
        positions_N=positions_N,
        write_pages_N=as_tensor(pages_of_token),
        write_offsets_N=positions_N % page_size,
        block_tables_SB=as_tensor(padded_tables).reshape(len(block_tables), num_blocks),
        kv_lens_S=as_tensor([p + n for p, n in zip(prefix_lens, query_lens, strict=True)]),
        query_lens_S=as_tensor(query_lens),
        page_size=page_size,
        query_tile=query_tile,
    )


def _query_tiles(
    query_lens: list[int], positions: list[int], query_tile: int
) -> tuple[list[list[int]], list[list[int]], list[int], list[int]]:
    """The query tiles of sequences bringing `query_lens[s]` tokens at `positions` (packed in sequence order):
    `AttentionBatch.tile_tokens_NT_Tq`, `tile_positions_NT_Tq`, `tile_seq_NT` and `tile_row_of_token_N` as lists."""
    tile_tokens: list[list[int]] = []
    tile_positions: list[list[int]] = []
    tile_seq: list[int] = []
    row_of_token: list[int] = []
    token = 0
    for s, num_new in enumerate(query_lens):
        seq_positions = positions[token : token + num_new]
        for start in range(0, num_new, query_tile):
            rows = list(range(token + start, token + min(start + query_tile, num_new)))
            row_of_token += [len(tile_tokens) * query_tile + r for r in range(len(rows))]
            pad = query_tile - len(rows)
            tile_tokens.append(rows + [rows[-1]] * pad)
            row_positions = seq_positions[start : start + len(rows)]
            tile_positions.append(row_positions + [row_positions[-1]] * pad)
            tile_seq.append(s)
        token += num_new
    # Longest-reaching tiles first, so the tiles that see key block j are always a prefix (views, not gathers).
    order = sorted(range(len(tile_tokens)), key=lambda i: -tile_positions[i][-1])
    new_index = {old: new for new, old in enumerate(order)}
    row_of_token = [new_index[r // query_tile] * query_tile + r % query_tile for r in row_of_token]
    return ([tile_tokens[i] for i in order], [tile_positions[i] for i in order], [tile_seq[i] for i in order],
            row_of_token)  # fmt: skip


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
