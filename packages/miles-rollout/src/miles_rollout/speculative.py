"""Speculative decoding in the embedded engine: the policy's own MTP module drafts up to k tokens per running
sequence, the trunk verifies them in the scheduler's step (k + 1 rows per sequence inside the continuous batch),
and `accept_drafts` keeps the drafts that equal the target's own samples (docs/architecture.md, "Speculative
decoding").

Where it sits in a scheduler step (scheduler.py, batch_results.py): `Drafter.propose` runs before the batch is built (a
sequence's draft tokens become its verify rows), `Drafter.extend` after the forward for prompt and recomputed chunks,
and `accept_drafts` when the verify rows are sampled.

The draft (SGLang's NEXTN, EAGLE's chain with topk 1): MTP module 0, or an EAGLE-3 draft (EAGLE3), applied
recursively on its own output. Its row t combines the trunk's state at t (its final hidden state for MTP,
`CausalLM.mtp_hidden`; its three feature layers for EAGLE-3, `CausalLM.eagle3_hidden`) with token t + 1, and its
K/V sits in the KV store's layer L (`KVStore.allocate(num_draft_layers=1)`) at the sequence's own pages and slots, so
allocation, the prefix cache, retract, abort and memory release need nothing more. Per sequence, `DraftState`
(sequence.py) says which draft rows are exact (`computed`) and holds the trunk rows whose draft rows wait for their
next token (`pending`). One step of a sequence with n computed tokens and last sampled token x_n:
1. extend: draft rows for the pending positions (up to n - 1, whose next token x_n is now known): exact K/V, and
   the last row's output drafts d_1;
2. k - 1 recursive steps: row n + j - 2 takes the previous output and d_{j-1}, and drafts d_j (its K/V is
   provisional: the next extend rewrites those slots with the trunk's hidden states);
3. verify: the trunk computes rows [x_n, d_1 .. d_k]; `accept_drafts` picks the tokens; the rows after the last
   emitted one are rolled back by setting num_computed (their pages stay reserved to the sequence, and the radix
   cache only ever takes full pages of computed tokens); their hidden states become the new pending rows.
A prompt's n samples share its full pages but each copies the page of the last prompt position, where it writes
its own draft row (`page_allocator.num_shared_pages`). Where the draft's K/V is approximate — acceptance only, never
the output: the last slot of a prefix reused from the radix cache keeps the draft row its writer computed, with
that writer's next token.
"""

from __future__ import annotations

from typing import Literal

import torch

from miles_kernels import CausalLM, Eagle3Draft, KVStore, build_attention_batch
from miles_rollout.row_sampling import Row, sample_tokens
from miles_rollout.sequence import DraftState, Sequence, SpecCounts


def add_pending(draft: DraftState, hidden_NH: torch.Tensor) -> None:
    """Trunk hidden states of newly computed positions join the rows waiting for their draft rows."""
    draft.pending = hidden_NH if draft.pending is None else torch.cat((draft.pending, hidden_NH))


def accept_drafts(drafts: list[int], targets: list[int]) -> list[int]:
    """The tokens one verify step emits: one or more, ending with a token of the target's own.

    `targets[i]` is the target's sample at draft i's position (i < k), from its logits after the sequence and
    drafts[:i], drawn with the sampler's per-(seed, position) noise; `targets[k]` is its sample after all k drafts.
    The draft sampled `drafts[i]` with the same noise at the same position, so where the two agree the draft's
    token *is* the target's sample: accept it and go on. At the first disagreement the target's sample replaces
    the draft and the rest is dropped (those rows were computed after a token the sequence does not have). When
    all k agree, the target's sample after them comes free (the bonus token).

    Every emitted token is the target's own sample at its position, so a speculative run emits exactly the tokens
    decoding without a draft samples from the same logits: the draft decides how many tokens a step emits, never
    which. (The acceptance rate is how often the two samples coincide under the shared noise.)
    """
    emitted = []
    for draft, target in zip(drafts, targets, strict=False):
        emitted.append(target)
        if draft != target:
            return emitted
    emitted.append(targets[len(drafts)])
    return emitted


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
        left = min(seq.group.params.max_new_tokens - len(seq.output_ids), context_length - len(seq.tokens))
        return max(min(self.num_steps, left - 1), 0)

    def add_rows(self, draft: DraftState, rows: torch.Tensor) -> None:
        """Newly computed positions' rows of a step (`ModelRunner.forward`) wait for their draft rows."""
        add_pending(draft, self.features(rows))

    def features(self, rows: torch.Tensor) -> torch.Tensor:
        """What the draft reads of the trunk's rows: the final hidden states (MTP) or the feature layers (EAGLE-3)."""
        hidden_size = self.model.config.hidden_size
        return rows[:, hidden_size:] if self.kind == "eagle3" else rows[:, :hidden_size]

    def verified(self, seq: Sequence, proposed: int, emitted: int, kept_rows: torch.Tensor) -> None:
        """After `seq`'s decode step: `proposed` drafts, `emitted` tokens (`accept_drafts`), `kept_rows` the trunk's
        rows kept. Counts the drafts, and the kept rows wait for their draft rows."""
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
        # 1. extend: the pending rows, whose last next token is the sequence's last sampled one
        outs = self._forward(
            store,
            [seqs[i].draft.pending for i in active],
            [seqs[i].draft.computed for i in active],
            [seqs[i].tokens[seqs[i].draft.computed + 1 :] for i in active],
            [seqs[i].pages for i in active],
            from_trunk=True,
        )
        for i in active:
            seqs[i].draft.computed, seqs[i].draft.pending = seqs[i].num_computed, None
        last = torch.stack([out[-1] for out in outs])
        # 2. sample d_j from the last output; then module 0 again on (its output, d_j) one slot further
        while True:
            logits = self.model.mtp_logits(last) if self.kind == "mtp" else self._eagle3().logits(last)
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
            out = self.model.eagle3_hidden(torch.cat(hidden), ids, batch, project=from_trunk, kv_store=store)
        else:
            out = self.model.mtp_hidden(torch.cat(hidden), ids, batch, 0, kv_store=store)
        return list(torch.split(out, lengths))

    def _eagle3(self) -> Eagle3Draft:
        assert self.model.eagle3 is not None
        return self.model.eagle3
