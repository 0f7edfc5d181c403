"""Speculative decoding in the embedded engine: a draft proposes up to k tokens per running sequence — a chain, or
a tree with `speculative_eagle_topk` > 1 — the trunk verifies them in the scheduler's step (one row per draft token
inside the continuous batch, tree attention for a tree: draft_tree.py), and `DraftTree.accept_path` keeps the drafts
that equal the target's own samples (docs/architecture.md, "Speculative decoding").

Where it sits in a scheduler step (scheduler.py, batch_results.py): `Drafter.propose` (a chain) or `propose_trees`
runs before the batch is built (a sequence's draft tokens become its verify rows), `Drafter.extend` after the
forward for prompt and recomputed chunks, and `accept_path` when the verify rows are sampled.

The draft (SGLang's NEXTN / EAGLE): MTP module 0, or an EAGLE-3 draft (EAGLE3), applied recursively on its own
output. Its row t combines the trunk's state at t (its final hidden state for MTP, `CausalLM.mtp_hidden`; its three
feature layers for EAGLE-3, `miles_kernels.eagle3_hidden`) with token t + 1, and its K/V sits in the KV store's layer L
(`KVStore.allocate(num_draft_layers=1)`) at the sequence's own pages and slots, so allocation, the prefix cache,
retract, abort and memory release need nothing more. Per sequence, `DraftState` (sequence.py) says which draft rows
are exact (`computed`) and holds the trunk rows whose draft rows wait for their next token (`pending`). One step of
a sequence with n computed tokens and last sampled token x_n:
1. extend: draft rows for the pending positions (up to n - 1, whose next token x_n is now known): exact K/V, and
   the last row's output drafts d_1;
2. k - 1 recursive steps: row n + j - 2 takes the previous output and d_{j-1}, and drafts d_j (its K/V is
   provisional: the next extend rewrites those slots with the trunk's hidden states). A tree keeps the topk best
   paths (beams) per level and ranks candidates by the sampler's own scores (`row_sampling.candidate_probs`: the
   token plain sampling would draw, with the row's noise, first); each beam's provisional rows go to scratch pages
   of its own;
3. verify: the trunk computes one row per node ([x_n, d_1 .. d_k] for a chain); `accept_path` picks the tokens; the
   rows after the last emitted one are rolled back by setting num_computed (their pages stay reserved to the
   sequence, and the radix cache only ever takes full pages of computed tokens; a tree's accepted branch is copied
   into the sequence's pages first); their trunk rows become the new pending rows.
A prompt's n samples share its full pages but each copies the page of the last prompt position, where it writes
its own draft row (`page_allocator.num_shared_pages`). Where the draft's K/V is approximate — acceptance only, never
the output: the last slot of a prefix reused from the radix cache keeps the draft row its writer computed, with
that writer's next token.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal

import torch

from miles_kernels import CausalLM, Eagle3Draft, KVStore, build_attention_batch, eagle3_hidden
from miles_rollout.draft_tree import DraftTree
from miles_rollout.page_allocator import OutOfPages
from miles_rollout.row_sampling import Row, candidate_probs, sample_tokens
from miles_rollout.sequence import DraftState, Sequence, SpecCounts


def add_pending(draft: DraftState, hidden_NH: torch.Tensor) -> None:
    """Trunk hidden states of newly computed positions join the rows waiting for their draft rows."""
    draft.pending = hidden_NH if draft.pending is None else torch.cat((draft.pending, hidden_NH))


class Drafter:
    """Runs the draft for the scheduler: `extend` (prompt / recomputed chunks) and `propose` (decoding). `kind`:
    the model's MTP module 0, or its attached EAGLE-3 draft (`CausalLM.attach_eagle3`)."""

    def __init__(
        self,
        model: CausalLM,
        num_steps: int,
        page_size: int,
        query_tile: int,
        device: str,
        eos_ids: set[int],
        kind: Literal["mtp", "eagle3"] = "mtp",
    ) -> None:
        self.kind = kind
        if kind == "eagle3" and model.eagle3 is None:
            raise ValueError("EAGLE3 drafts with an EAGLE-3 draft attached (--speculative-draft-model-path)")
        if kind == "mtp" and not model.mtp_layers:
            raise ValueError(
                "speculative decoding drafts with the model's MTP layers, and this model has none "
                "(num_nextn_predict_layers = 0 in config.json, or MTP layers it declares and the checkpoint holds no "
                "tensor of, as transformers saves GLM-4.5): serve a model with MTP layers (miles-spec train adds "
                "them), or leave --speculative-algorithm unset"
            )
        self.model = model
        self.num_steps = num_steps
        self.page_size = page_size
        self.query_tile = query_tile
        self.device = device
        self.eos_ids = eos_ids
        # Totals (server metrics): verify steps with drafts, and drafts proposed / accepted per draft position.
        self.num_verify = 0
        self.proposed_at = [0] * num_steps
        self.correct_at = [0] * num_steps

    def budget(self, seq: Sequence, context_length: int) -> int:
        """How many tokens `seq` drafts this step: k, fewer near its end (a step emits at most drafts + 1 tokens,
        within max_new_tokens and the context length, so its verify rows stay inside its reserved pages), none
        without a pending draft row."""
        if seq.draft.num_pending == 0:
            return 0
        left = min(seq.group.params.max_new_tokens - len(seq.output_ids), context_length - seq.num_tokens)
        return max(min(self.num_steps, left - 1), 0)

    def add_rows(self, draft: DraftState, rows: torch.Tensor) -> None:
        """Newly computed positions' rows of a step (`ModelRunner.forward`) wait for their draft rows."""
        add_pending(draft, self.features(rows))

    def features(self, rows: torch.Tensor) -> torch.Tensor:
        """What the draft reads of the trunk's rows: the final hidden states (MTP) or the feature layers (EAGLE-3)."""
        hidden_size = self.model.config.hidden_size
        return rows[:, hidden_size:] if self.kind == "eagle3" else rows[:, :hidden_size]

    def verified(self, seq: Sequence, proposed: int, emitted: int, kept_rows: torch.Tensor) -> None:
        """After `seq`'s decode step: `proposed` draft levels, `emitted` tokens (`accept_path`), `kept_rows` the
        trunk's rows kept. Counts the drafts, and the kept rows wait for their draft rows."""
        if proposed:
            accepted = emitted - 1
            if seq.spec is None:
                seq.spec = SpecCounts()
            seq.spec.record(proposed, accepted)
            self.num_verify += 1
            for j in range(proposed):
                self.proposed_at[j] += 1
                self.correct_at[j] += j < accepted
        if seq.finish is None:
            self.add_rows(seq.draft, kept_rows)

    def stats(self) -> dict[str, int]:
        return {
            "spec_num_verify": self.num_verify,
            "spec_num_proposed_drafts": sum(self.proposed_at),
            "spec_num_correct_drafts": sum(self.correct_at),
        }

    def rates(self) -> dict[str, float | list[float]]:
        """Since start: tokens per verify step (SGLang's avg_spec_accept_length) and the accept rate per draft
        position: entry j - 1 is the share of verify steps that proposed j or more drafts and accepted at least j
        (the draft reaches position j only through the j - 1 before it)."""
        return {
            "avg_spec_accept_length": 1.0 + sum(self.correct_at) / self.num_verify if self.num_verify else 1.0,
            "spec_accept_rate_by_position": [c / p if p else 0.0 for c, p in zip(self.correct_at, self.proposed_at,
                                                                                  strict=True)],
        }  # fmt: skip

    def extend(self, store: KVStore, owners: list[tuple[DraftState, list[int], list[int], int]]) -> None:
        """Draft rows for every pending position but the last of each owner (draft state, its tokens, its pages,
        its num_computed): their next token is known. The last pending row waits for the next token."""
        work = [(d, tokens, pages, n) for d, tokens, pages, n in owners if d.num_pending >= 2]
        if not work:
            return
        self._forward(
            store,
            [d.pending[:-1] for d, _, _, _ in work],
            [d.computed for d, _, _, _ in work],
            [tokens[d.computed + 1 : n] for d, tokens, _, n in work],
            [pages for _, _, pages, _ in work],
            from_trunk=True,
        )
        for d, _, _, n in work:
            d.pending, d.computed = d.pending[-1:], n - 1

    def propose(self, store: KVStore, seqs: list[Sequence], budgets: list[int]) -> list[list[int]]:
        """Up to `budgets[i]` draft tokens for `seqs[i]` (none without a pending row); the sequences' pages must
        already cover their verify rows."""
        drafts: list[list[int]] = [[] for _ in seqs]
        active = [i for i, seq in enumerate(seqs) if budgets[i] > 0 and seq.draft.num_pending > 0]
        if not active:
            return drafts
        last = torch.stack([out[-1] for out in self._extend_pending(store, [seqs[i] for i in active])])
        # 2. sample d_j from the last output; then module 0 again on (its output, d_j) one slot further
        while True:
            logits = self._logits(last)
            rows = [Row(seqs[i], drafts[i]) for i in active]
            for i, token in zip(active, sample_tokens(logits, rows, self.eos_ids).tolist(), strict=True):
                drafts[i].append(token)
            keep = [j for j, i in enumerate(active) if len(drafts[i]) < budgets[i]]
            if not keep:
                return drafts
            active = [active[j] for j in keep]
            outs = self._forward(
                store,
                [last[j : j + 1] for j in keep],
                [seqs[i].num_computed + len(drafts[i]) - 1 for i in active],
                [drafts[i][-1:] for i in active],
                [seqs[i].pages for i in active],
                from_trunk=False,
            )
            last = torch.cat(outs)

    def _extend_pending(self, store: KVStore, seqs: list[Sequence]) -> list[torch.Tensor]:
        """Step 1 of a proposal: draft rows for every pending position (the last one's next token is the sequence's
        last sampled token), which makes the draft K/V exact up to the sequence's end; each sequence's output rows."""
        outs = self._forward(
            store,
            [seq.draft.pending for seq in seqs],
            [seq.draft.computed for seq in seqs],
            [seq.tokens[seq.draft.computed + 1 :] for seq in seqs],
            [seq.pages for seq in seqs],
            from_trunk=True,
        )
        for seq in seqs:
            seq.draft.computed, seq.draft.pending = seq.num_computed, None
        return outs

    def propose_trees(
        self,
        store: KVStore,
        seqs: list[Sequence],
        budgets: list[int],
        topk: int,
        num_nodes: int,
        take: Callable[[int], list[int]],
        release: Callable[[list[int]], None],
    ) -> list[DraftTree]:
        """A draft tree per sequence (SGLang's EAGLE tree, `speculative_eagle_topk` = topk): up to `budgets[i]` levels
        and `num_nodes` - 1 draft tokens. Level by level, the topk best candidates so far (beams, by the product of
        their tokens' `candidate_probs` along the path) each propose their topk likeliest children; the tree is the
        `num_nodes` - 1 best candidates, a parent always before its children. A beam's provisional draft K/V goes to
        scratch pages (`take`, a copy of its parent beam's), handed back with `release` before returning; when none
        are free the tree stops growing there."""
        trees = [DraftTree.chain(seq.last_token, []) for seq in seqs]
        active = [i for i, seq in enumerate(seqs) if budgets[i] > 0 and seq.draft.num_pending > 0]
        if not active:
            return trees
        outs = self._extend_pending(store, [seqs[i] for i in active])  # the last row's output ranks the first level
        # per sequence, every candidate: (score, depth, parent candidate or -1, token)
        candidates: dict[int, list[tuple[float, int, int, int]]] = {i: [] for i in active}
        # a level's rows to rank children by: (sequence, parent candidate, the row's output, its tail pages)
        level: list[tuple[int, int, torch.Tensor, list[int]]] = [
            (i, -1, out[-1:], []) for i, out in zip(active, outs, strict=True)
        ]
        scratch: list[int] = []
        depth = 1
        try:
            while level:
                logits = self._logits(torch.cat([h for _, _, h, _ in level]))
                rows = [Row(seqs[i], _path(candidates[i], parent)) for i, parent, _, _ in level]
                top_p, top_ids = candidate_probs(logits, rows, self.eos_ids).topk(topk, dim=-1)
                born: dict[int, list[tuple[int, torch.Tensor, list[int]]]] = {}
                for (i, parent, h, tail), p_k, ids_k in zip(level, top_p.tolist(), top_ids.tolist(), strict=True):
                    base = 1.0 if parent < 0 else candidates[i][parent][0]
                    for p, token in zip(p_k, ids_k, strict=True):
                        born.setdefault(i, []).append((len(candidates[i]), h, tail))
                        candidates[i].append((base * p, depth, parent, token))
                depth += 1
                expanding = []
                for i, new in born.items():
                    if depth <= budgets[i]:
                        scores = candidates[i]
                        expanding.append((i, sorted(new, key=lambda beam: -scores[beam[0]][0])[:topk]))
                level = self._expand(store, seqs, candidates, expanding, depth, take, scratch)
        finally:
            release(scratch)
        for i in active:
            trees[i] = _select_tree(seqs[i].last_token, candidates[i], num_nodes - 1)
        return trees

    def _expand(
        self,
        store: KVStore,
        seqs: list[Sequence],
        candidates: dict[int, list[tuple[float, int, int, int]]],
        expanding: list[tuple[int, list[tuple[int, torch.Tensor, list[int]]]]],
        depth: int,
        take: Callable[[int], list[int]],
        scratch: list[int],
    ) -> list[tuple[int, int, torch.Tensor, list[int]]]:
        """The draft one row further for each beam of each sequence (`expanding`: a sequence's candidates at depth - 1,
        each with the output of the row that ranked it and that row's tail), in one forward: row n + depth - 2 on
        (that output, the beam's token), its K/V in a tail of the beam's own (a copy of the tail it came from; for the
        first level, of the sequence's page at n). The next level's rows; none for a sequence when no scratch page is
        free."""
        rows: list[tuple[int, int, torch.Tensor, int, list[int], list[int]]] = []  # (seq, cand, h, pos, table, tail)
        pairs: list[tuple[int, int]] = []
        for i, beams in expanding:
            seq = seqs[i]
            n, page = seq.num_computed, self.page_size
            first = n // page
            count = (n + depth - 2) // page + 1 - first
            tails: list[list[int]] = []
            try:
                for _ in beams:
                    tails.append(take(count))
                    scratch += tails[-1]
            except OutOfPages:
                continue
            for (c, h, parent_tail), tail in zip(beams, tails, strict=True):
                pairs += list(zip(parent_tail or [seq.pages[first]], tail, strict=False))
                rows.append((i, c, h, n + depth - 2, seq.pages[:first] + tail, tail))
        if not rows:
            return []
        _copy_draft_pages(store, self.model.config.num_hidden_layers, pairs)
        outs = self._forward(
            store,
            [h for _, _, h, _, _, _ in rows],
            [position for _, _, _, position, _, _ in rows],
            [[candidates[i][c][3]] for i, c, _, _, _, _ in rows],
            [table for _, _, _, _, table, _ in rows],
            from_trunk=False,
        )
        return [(i, c, out, tail) for (i, c, _, _, _, tail), out in zip(rows, outs, strict=True)]

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The draft's logits over the target's vocabulary (MTP's shared LM head, or EAGLE-3's mapped back)."""
        return self.model.mtp_logits(hidden) if self.kind == "mtp" else self._eagle3().logits(hidden)

    def _forward(
        self,
        store: KVStore,
        hidden: list[torch.Tensor],
        first_positions: list[int],
        next_ids: list[list[int]],
        tables: list[list[int]],
        from_trunk: bool,
    ) -> list[torch.Tensor]:
        """The draft over rows first_positions[s] .. of each sequence s (writing their draft K/V); its output rows,
        split per sequence. `from_trunk`: `hidden` holds the trunk's rows (`features`), else the draft's outputs."""
        lengths = [len(ids) for ids in next_ids]
        batch = build_attention_batch(lengths, first_positions, tables, self.page_size, self.query_tile, self.device)
        ids = torch.tensor([t for row in next_ids for t in row], device=self.device)
        if self.kind == "eagle3":
            out = eagle3_hidden(self.model, torch.cat(hidden), ids, batch, from_trunk, store)
        else:
            out = self.model.mtp_hidden(torch.cat(hidden), ids, batch, 0, kv_store=store)
        return list(torch.split(out, lengths))

    def _eagle3(self) -> Eagle3Draft:
        assert self.model.eagle3 is not None
        return self.model.eagle3


def _path(candidates: list[tuple[float, int, int, int]], node: int) -> list[int]:
    """The draft tokens from the first level down to candidate `node` (none for -1, the root)."""
    tokens = []
    while node >= 0:
        tokens.append(candidates[node][3])
        node = candidates[node][2]
    return tokens[::-1]


def _select_tree(root: int, candidates: list[tuple[float, int, int, int]], size: int) -> DraftTree:
    """The `size` best candidates (by score; a tie goes to the shallower, then the earlier) whose parents are kept,
    as a tree in depth-first order, each node's children best first."""
    order = sorted(range(len(candidates)), key=lambda c: (-candidates[c][0], candidates[c][1], c))
    kept: list[int] = []
    chosen: set[int] = set()
    for c in order:
        if len(kept) == size:
            break
        if candidates[c][2] < 0 or candidates[c][2] in chosen:
            kept.append(c)
            chosen.add(c)
    children: dict[int, list[int]] = {}
    for c in kept:  # best first
        children.setdefault(candidates[c][2], []).append(c)
    tokens, parents = [root], [-1]
    stack = [(c, 0) for c in reversed(children.get(-1, []))]
    while stack:
        c, parent = stack.pop()
        node = len(tokens)
        tokens.append(candidates[c][3])
        parents.append(parent)
        stack += [(child, node) for child in reversed(children.get(c, []))]
    return DraftTree(tokens, parents)


def _copy_draft_pages(store: KVStore, layer: int, pairs: list[tuple[int, int]]) -> None:
    """Copy the draft layer's K/V of page `source` into page `target`, for each (source, target)."""
    if not pairs:
        return
    device = store.k[layer].device
    sources = torch.tensor([s for s, _ in pairs], device=device)
    targets = torch.tensor([t for _, t in pairs], device=device)
    for pages in {id(t): t for t in (store.k[layer], store.v[layer])}.values():
        pages[targets] = pages[sources]
