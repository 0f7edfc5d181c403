"""What the scheduler does with a step's forward (scheduler.py), SGLang's scheduler output processor: prompts whose
last chunk was computed fork into their samples (full pages shared, the partial one copied), the rows to sample are
sampled by the model runner, speculative drafts are accepted or rolled back, each emitted token goes to the output
stage, and a sample it ends is finished: its text and routing, its pages to the radix cache, its group completed.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from miles_contracts import FinishReason
from miles_rollout.draft_tree import DraftTree
from miles_rollout.model_runner import Entry, ModelRunner
from miles_rollout.output import OutputStage
from miles_rollout.page_allocator import PageAllocator, num_shared_pages
from miles_rollout.radix_cache import RadixCache
from miles_rollout.row_sampling import record_input_logprobs
from miles_rollout.sequence import DraftState, Group, Sequence, finish_reason
from miles_rollout.speculative import Drafter


class BatchResults:
    """The `Scheduler`'s handling of a forward's results (a mixin: it works on the scheduler's queues and pages)."""

    runner: ModelRunner
    output: OutputStage
    drafter: Drafter | None
    allocator: PageAllocator
    radix: RadixCache
    page_size: int
    _prefilling: list[Group]
    _running: list[Sequence]
    _refilling: list[Sequence]
    _reserved: int

    if TYPE_CHECKING:

        def _take_pages(self, count: int) -> list[int]: ...
        def _fail_groups(self, failed: dict[int, tuple[Group, BaseException]]) -> None: ...

    def _after_forward(
        self, hidden: torch.Tensor, owners: list[tuple[str, Any, int, DraftTree | None]], query_lens: list[int]
    ) -> None:
        # Rows whose logits are needed: every decode / verify row, the last row of a finished prompt.
        to_sample: list[tuple[Sequence | Group, int, DraftTree]] = []  # (owner, first row, its rows' tree)
        extended: list[Sequence | Group] = []  # prompt / recomputed chunks: their draft rows (speculative.py)
        for (kind, owner, start, tree), length in zip(owners, query_lens, strict=True):
            if tree is not None:  # decoding: its last token, then its draft tree (rolled back in `_sample`)
                owner.num_computed += tree.depth + 1
                to_sample.append((owner, start, tree))
                continue
            if self.drafter is not None:
                self.drafter.add_rows(owner.draft, hidden[start : start + length])
                extended.append(owner)
            if kind == "refill":  # a retracted sequence's KV recomputed: it decodes again from the next step
                owner.num_computed += length
                if owner.num_computed == owner.resume_at:
                    self._refilling.remove(owner)
                    self._running.append(owner)
                continue
            group: Group = owner
            first_position = group.num_computed
            group.num_computed += length
            if group.needs_input_logprobs:
                rows = self.runner.hidden_states(hidden[start : start + length])
                record_input_logprobs(self.runner.model, group, rows, first_position)
            if group.is_prefilled:
                to_sample.append((group, start + length - 1, DraftTree.chain(group.prompt_ids[-1], [])))
        if self.drafter is not None and extended:
            self.drafter.extend(self.runner.store, [
                (o.draft, o.prompt_ids if isinstance(o, Group) else o.tokens,
                 o.prefill_pages if isinstance(o, Group) else o.pages, o.num_computed) for o in extended
            ])  # fmt: skip
        if to_sample:
            self._sample(hidden, to_sample)

    def _sample(self, hidden: torch.Tensor, to_sample: list[tuple[Sequence | Group, int, DraftTree]]) -> None:
        """Sample every row; a sequence appends one token, or the tokens its draft tree's accepted path emits."""
        index = [start + i for _, start, tree in to_sample for i in range(len(tree.tokens))]
        logits = self.runner.logits(hidden, index)
        entries: list[Entry] = []
        first = 0
        copies: list[tuple[int, int]] = []  # the forks' partial prompt pages, copied at once
        try:
            for owner, _, tree in to_sample:
                if isinstance(owner, Group):  # its samples start, with the prompt's draft state (`_fork`)
                    entries += [(seq, first, tree, False) for seq in self._fork(owner, copies)]
                else:
                    entries.append((owner, first, tree, True))
                first += len(tree.tokens)
        finally:  # the groups forked before a failure hold their copies too
            self.runner.copy_pages(copies)
        for seq, *_ in entries:
            if seq.group.params.max_new_tokens == 0:
                self._finish(seq, finish_reason("length", length=0))
        entries = [entry for entry in entries if entry[0].group.params.max_new_tokens > 0]
        if not entries:
            return
        failed: dict[int, tuple[Group, BaseException]] = {}
        per_entry = self.runner.sample(logits, entries, failed)
        for (seq, first, tree, is_decoding), sampled in zip(entries, per_entry, strict=True):
            if sampled is None or id(seq.group) in failed:
                continue
            try:
                path = tree.accept_path(sampled.tokens)  # root first: each node's row samples the next token
                computed = seq.num_computed - tree.depth  # with the row that samples the first token
                if len(tree.branches) > 1:  # the accepted path's keys into the sequence's own pages
                    self.runner.copy_pages(tree.pages_to_keep(path, self.page_size, computed - 1, seq.pages))
                for i, node in enumerate(path):
                    seq.num_computed = computed + i  # the rows up to the one that sampled the token are kept
                    reason = self.output.append_token(seq, sampled.tokens[node], sampled.logprobs[node],
                                                      sampled.top[node])  # fmt: skip
                    if reason is not None:
                        self._finish(seq, reason)
                        break
                if self.drafter is not None and is_decoding:
                    kept = hidden[torch.tensor([index[first + node] for node in path], device=hidden.device)]
                    self.drafter.verified(seq, tree.depth, len(path), kept)
            except Exception as error:  # one sample's stop, detokenization or grammar: its request alone fails
                failed[id(seq.group)] = (seq.group, error)
        self._fail_groups(failed)

    def _fork(self, group: Group, page_copies: list[tuple[int, int]]) -> list[Sequence]:
        """The prompt is computed: start its n samples on its pages (full pages shared, the partial one to be copied:
        its (source, target) pairs are added to `page_copies`)."""
        self._prefilling.remove(group)
        length = len(group.prompt_ids)
        num_full = num_shared_pages(length, self.page_size, self.drafter is not None)
        self.radix.insert(group.prompt_ids, group.prefill_pages[:num_full], group.lora_id)
        partial = group.prefill_pages[num_full:]
        children = []
        copies: list[int] = []  # pages that receive a copy of the partial page
        for i in range(group.params.n):
            seq = Sequence(group=group, sample_index=i, seed=group.seed + i, num_computed=length,
                           version_starts=[(group.weight_version, 0)],
                           draft=DraftState(group.draft.computed, group.draft.pending))  # fmt: skip
            shared = group.prefill_pages[:num_full]
            self.allocator.retain(shared)
            if partial and i == 0:
                own = list(partial)
                self.allocator.retain(own)
            elif partial:
                own = self._take_pages(1)
                group.reserved_pages -= 1
                copies += own
            else:
                own = []
            seq.pages = shared + own
            if group.grammar is not None:
                seq.matcher = self.runner.grammars().matcher(group.grammar)
            share = group.reserved_pages // (group.params.n - i)
            seq.reserved_pages, group.reserved_pages = share, group.reserved_pages - share
            children.append(seq)
        page_copies += [(partial[0], page) for page in copies]
        self.allocator.release(group.prefill_pages)
        group.prefill_pages = []
        group.sequences = children
        self._running += children
        return children

    def _finish(self, seq: Sequence, reason: FinishReason) -> None:
        """`seq` ends with `reason`: its text, its routing, its pages to the radix cache; its group completes when it
        was the last sample."""
        seq.text = self.output.final_text(seq)
        seq.finish = reason
        if seq in self._running:
            self._running.remove(seq)
        if seq.group.return_routed_experts and self.runner.routed_experts is not None:
            seq.routed_experts = self.runner.routing_of(seq)
        if seq.pages:
            self.radix.insert(seq.tokens[: seq.num_computed], seq.pages, seq.group.lora_id)
            self.allocator.release(seq.pages)
            seq.pages = []
        self._reserved -= seq.reserved_pages
        seq.reserved_pages = 0
        group = seq.group
        if all(s.finish is not None for s in group.sequences):
            self._reserved -= group.reserved_pages
            group.reserved_pages = 0
            self.output.complete(group)
