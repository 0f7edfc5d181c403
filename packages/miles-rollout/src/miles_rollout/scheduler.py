"""The engine's scheduler: continuous batching with chunked prefill over a paged KV cache and a radix prefix cache.
It runs on the engine thread only (no locking here) and owns the requests in flight, their KV pages and the served
weight version; the model runner (model_runner.py) runs the forwards and sampling, the output stage (output.py) turns
sampled tokens into text, stop decisions and responses.

Each `step`:
1. admits waiting prompts while sequences and KV pages allow (pages are reserved for the whole generation at
   admission, so a running request never runs out; a request that waits is never over-allocated);
2. builds one mixed batch: one token for every decoding sequence, then prompt chunks under the step's token
   budget (chunked prefill), and has the model runner run one forward over it;
3. has the runner sample the next token of every sequence whose input ended this step (the log-prob contract), hands
   each to the output stage, and finishes the sequences it says end (EOS / stop token / stop string /
   max_new_tokens / context length): their pages go to the radix cache, their group completes.
A prompt with `n` samples is prefilled once, then forked: full pages are shared, the partial page is copied.
With speculative decoding (`EngineConfig.speculative_algorithm`; speculative.py) a decoding sequence brings its
last token and up to k draft tokens to the forward, and a step emits one or more tokens per sequence.
With `EngineConfig.enable_return_routed_experts` every forward's MoE routing is recorded per KV slot and a finished
sequence's is returned with it (routed_experts.py). With LoRA adapters served per request (served_loras.py) each
request's rows run with its adapter, the radix cache keeps each adapter's K/V apart, and a step holds at most
`max_loras_per_batch` adapters (the base model counted): a request of another one waits while later ones go ahead,
as SGLang's scheduler skips it.
"""

from __future__ import annotations

import logging
from collections import deque
from typing import Any

import torch

from miles_contracts import WeightVersion
from miles_rollout.batch_results import BatchResults
from miles_rollout.config import EngineConfig
from miles_rollout.draft_tree import Branch, DraftTree
from miles_rollout.model_runner import ForwardPart, ModelRunner
from miles_rollout.output import OutputStage
from miles_rollout.page_allocator import OutOfPages, PageAllocator, ceil_div
from miles_rollout.radix_cache import RadixCache
from miles_rollout.sequence import DraftState, Group, Sequence, finish_reason
from miles_rollout.speculative import Drafter

logger = logging.getLogger("miles_rollout.scheduler")


def _group_of(owner: Sequence | Group) -> Group:
    """The request (prompt group) a step's row owner belongs to."""
    return owner.group if isinstance(owner, Sequence) else owner


class Scheduler(BatchResults):
    """Waiting, prefilling and running requests, and the KV pages they hold."""

    def __init__(
        self, runner: ModelRunner, output: OutputStage, config: EngineConfig, context_length: int,
        drafter: Drafter | None, max_loras_per_batch: int | None = None,
    ) -> None:  # fmt: skip
        self.runner = runner
        self.output = output
        self.config = config
        self.context_length = context_length
        self.page_size = runner.page_size
        self.drafter = drafter
        self.max_loras_per_batch = max_loras_per_batch  # None: the engine serves no LoRA adapters
        self.allocator = PageAllocator(config.num_kv_pages)
        self.radix = RadixCache(self.allocator, self.page_size)
        self._waiting: deque[Group] = deque()
        self._prefilling: list[Group] = []
        self._running: list[Sequence] = []
        # Retracted sequences (`retract`): their KV was freed; they wait for pages, then recompute it (`_refilling`)
        # up to `seq.resume_at` tokens and rejoin the running batch where they left it.
        self._retracted: deque[Sequence] = deque()
        self._refilling: list[Sequence] = []
        self._reserved = 0
        self.num_steps = 0
        # The served weights' version, this engine's one record of it (SGLang's "default", None, until an update
        # names one): each admitted request is computed with it.
        self.weight_version: WeightVersion = None
        self.num_prefill_tokens = 0

    @property
    def is_busy(self) -> bool:
        """Requests hold KV pages (prefilling, recomputing a retracted sequence's KV, or decoding)."""
        return bool(self._prefilling or self._refilling or self._running)

    @property
    def has_work(self) -> bool:
        return bool(self._waiting or self._retracted or self._prefilling or self._refilling or self._running)

    @property
    def num_in_flight(self) -> int:
        """Requests (prompt groups) not finished yet."""
        groups = {id(s.group) for s in (*self._running, *self._retracted, *self._refilling)}
        return len(self._waiting) + len(self._prefilling) + len(groups)

    def retract(self) -> int:
        """Take every request out of the batch and free its KV pages (SGLang's `retract` pause): a prefilling
        prompt starts its prefill again, a decoding sequence keeps its tokens and recomputes their KV when it is
        admitted again, then continues where it stopped (the same tokens in deterministic mode: the KV of a
        recomputed prefix has the same bits). Full pages go to the radix cache, so a re-admitted request reuses
        them while they are cached. Returns the number of requests retracted."""
        count = self.num_in_flight - len(self._waiting)
        for group in reversed(self._prefilling):
            self._cache_pages(group.prompt_ids[: group.num_computed], group.prefill_pages, group.lora_id)
            group.prefill_pages, group.num_computed, group.cached_tokens = [], 0, 0
            self._reserved -= group.reserved_pages
            group.reserved_pages = group.total_pages
            self._waiting.appendleft(group)
        self._prefilling = []
        for seq in [*self._refilling, *self._running]:
            seq.resume_at = max(seq.resume_at, seq.num_computed)
            self._cache_pages(seq.tokens[: seq.num_computed], seq.pages, seq.group.lora_id)
            seq.pages, seq.num_computed, seq.draft = [], 0, DraftState()
            self._reserved -= seq.reserved_pages
            seq.reserved_pages = 0
            self._retracted.append(seq)
        self._refilling, self._running = [], []
        return count

    def _cache_pages(self, tokens: list[int], pages: list[int], adapter: str | None) -> None:
        """Hand a request's pages to the radix cache (full pages of `tokens` stay cached, under its adapter) and drop
        its hold."""
        if pages:
            self.radix.insert(tokens, pages, adapter)
            self.allocator.release(pages)

    def adapters_in_flight(self) -> set[str | None]:
        """The LoRA adapters (ids; None: the base model) of every request not finished yet."""
        sequences = (*self._running, *self._retracted, *self._refilling)
        return {g.lora_id for g in (*self._waiting, *self._prefilling, *(s.group for s in sequences))}

    def _batch_adapters(self) -> set[str | None]:
        """The LoRA adapters of the requests in the batch (prefilling, recomputing or decoding)."""
        return {g.lora_id for g in (*self._prefilling, *(s.group for s in (*self._running, *self._refilling)))}

    def _adapter_fits(self, adapter: str | None, in_batch: set[str | None]) -> bool:
        limit = self.max_loras_per_batch
        return limit is None or adapter in in_batch or len(in_batch) < limit

    def submit(self, groups: list[Group]) -> None:
        self._waiting.extend(groups)

    def forget_kv(self) -> None:
        """Forget every cached page (no request may be running): the KV store's memory is about to be dropped
        (the engine's offload manager, tag `kv_cache`)."""
        assert not self.is_busy
        self.radix.reset()
        self.allocator.reset()

    def commit_weights(self, version: WeightVersion) -> WeightVersion:
        """New weights are loaded: serve them as `version` (None: the version stays, as SGLang keeps it when an update
        names none); the radix cache is emptied, its K/V came from the old weights. Returns the served version."""
        if version is not None:
            self.weight_version = version
        self.radix.reset()
        return self.weight_version

    def stats(self) -> dict[str, int]:
        return {
            "num_running": len(self._running),
            "num_prefilling": len(self._prefilling),
            "num_waiting": len(self._waiting),
            "num_retracted": len(self._retracted) + len(self._refilling),
            "num_used_pages": self.allocator.num_used,
            "num_cached_pages": self.radix.num_cached_pages,
            "num_steps": self.num_steps,
            "num_generated_tokens": self.output.num_generated_tokens,
            "num_prefill_tokens": self.num_prefill_tokens,
            **(self.drafter.stats() if self.drafter is not None else {}),
        }

    def process_aborts(self, aborts: list[str | None]) -> None:
        """Finish aborted requests (None: all) with `abort`, wherever they are."""
        for rid in aborts:
            for group in [g for g in self._waiting if rid is None or g.rid == rid]:
                self._waiting.remove(group)
                group.sequences = [Sequence(group, i, group.seed + i) for i in range(group.params.n)]
                for seq in group.sequences:
                    seq.finish = finish_reason("abort", message="aborted before it started")
                self.output.complete(group)
            for group in [g for g in self._prefilling if rid is None or g.rid == rid]:
                self._prefilling.remove(group)
                self.allocator.release(group.prefill_pages)
                self._reserved -= group.reserved_pages
                group.sequences = [Sequence(group, i, group.seed + i) for i in range(group.params.n)]
                for seq in group.sequences:
                    seq.finish = finish_reason("abort", message="aborted during prefill")
                self.output.complete(group)
            for seq in [s for s in self._retracted if rid is None or s.group.rid == rid or s.rid == rid]:
                self._retracted.remove(seq)
                self._finish(seq, finish_reason("abort", message="aborted"))
            for seq in [s for s in self._refilling if rid is None or s.group.rid == rid or s.rid == rid]:
                self._refilling.remove(seq)
                self._finish(seq, finish_reason("abort", message="aborted"))
            for seq in [s for s in self._running if rid is None or s.group.rid == rid or s.rid == rid]:
                self._finish(seq, finish_reason("abort", message="aborted"))

    @property
    def num_waiting(self) -> int:
        """Prompts waiting for admission (read by the request side to refuse work past the queue limit)."""
        return len(self._waiting)

    def fail_group(self, group: Group, message: str) -> None:
        """Fail one request (its future raises `message`, a 500) and free everything it holds, wherever it is; the
        other requests keep their KV and continue. Its pages are released without entering the radix cache: the
        failed step may have left them half written."""
        if group in self._waiting:
            self._waiting.remove(group)
        if group in self._prefilling:
            self._prefilling.remove(group)
            self.allocator.release(group.prefill_pages)
            group.prefill_pages = []
        for seq in group.sequences:
            for queue in (self._running, self._refilling, self._retracted):
                if seq in queue:
                    queue.remove(seq)
            if seq.pages:
                self.allocator.release(seq.pages)
                seq.pages = []
            self._reserved -= seq.reserved_pages
            seq.reserved_pages = 0
            if seq.finish is None:
                seq.finish = finish_reason("abort", message=message)
        self._reserved -= group.reserved_pages
        group.reserved_pages = 0
        self.output.fail(group, message)

    def _fail_groups(self, failed: dict[int, tuple[Group, BaseException]]) -> None:
        for group, error in failed.values():
            logger.error("request %s failed in an engine step: %s: %s", group.rid, type(error).__name__, error)
            self.fail_group(group, f"the engine failed on this request: {type(error).__name__}: {error}")

    def fail_all(self, message: str) -> None:
        sequences = [*self._running, *self._retracted, *self._refilling]
        groups = {id(g): g for g in [*self._waiting, *self._prefilling, *(s.group for s in sequences)]}
        self._waiting.clear()
        self._prefilling.clear()
        self._running.clear()
        self._retracted.clear()
        self._refilling.clear()
        self.radix.reset()
        self.allocator.reset()
        self._reserved = 0
        for group in groups.values():
            self.output.fail(group, message)

    def _admit(self) -> None:
        self._admit_retracted()
        adapters = self._batch_adapters() if self.max_loras_per_batch is not None else set()
        skipped: list[Group] = []  # requests whose adapter the batch has no room for: they keep their place
        try:
            while self._waiting and not self._retracted:
                group = self._waiting[0]
                if not self._adapter_fits(group.lora_id, adapters):
                    skipped.append(self._waiting.popleft())
                    continue
                if not self._admit_group(group):
                    return
                adapters.add(group.lora_id)
        finally:
            self._waiting.extendleft(reversed(skipped))

    def _admit_group(self, group: Group) -> bool:
        """Start prefilling `group`, the first waiting request, if sequences and pages allow."""
        in_batch = len(self._running) + len(self._prefilling) + len(self._refilling)
        if in_batch + group.params.n > self.config.max_running_requests:
            return False
        limit = len(group.prompt_ids) - 1
        if group.needs_input_logprobs:
            limit = min(limit, max(group.logprob_start_len - 1, 0))
        matched = self.radix.match(group.prompt_ids[:limit], group.lora_id)
        needed = group.reserved_pages - len(matched)
        if not self._pages_fit(needed):
            self.allocator.release(matched)
            return False  # admission waits for pages
        self._waiting.popleft()
        group.weight_version = self.weight_version  # the weights it is computed with
        group.reserved_pages = needed
        self._reserved += needed
        group.prefill_pages = matched
        group.num_computed = group.cached_tokens = len(matched) * self.page_size
        group.draft = DraftState(computed=group.num_computed)
        self._prefilling.append(group)
        return True

    def _admit_retracted(self) -> None:
        """Re-admit retracted sequences first, in order, when sequences and pages allow."""
        while self._retracted:
            seq = self._retracted[0]
            in_batch = len(self._running) + len(self._prefilling) + len(self._refilling)
            if in_batch + 1 > self.config.max_running_requests:
                return
            if not self._adapter_fits(seq.group.lora_id, self._batch_adapters()):
                return
            matched = self.radix.match(seq.tokens[: seq.resume_at], seq.group.lora_id)
            max_tokens = min(len(seq.group.prompt_ids) + seq.group.params.max_new_tokens, self.context_length)
            needed = ceil_div(max_tokens, self.page_size) - len(matched)
            if not self._pages_fit(needed):
                self.allocator.release(matched)
                return
            self._retracted.popleft()
            if seq.version_starts[-1][0] != self.weight_version:  # weights were updated while it was retracted
                seq.version_starts.append((self.weight_version, len(seq.output_ids)))
            seq.pages, seq.num_computed = matched, len(matched) * self.page_size
            seq.draft = DraftState(computed=seq.num_computed)
            seq.reserved_pages = needed
            self._reserved += needed
            (self._running if seq.num_computed == seq.resume_at else self._refilling).append(seq)

    def _pages_fit(self, needed: int) -> bool:
        """`needed` more pages can be reserved: free ones beyond the reservations, or ones the radix cache can evict
        (counted only as far as the shortfall)."""
        shortfall = needed - (self.allocator.num_free - self._reserved)
        return shortfall <= 0 or self.radix.num_evictable(at_least=shortfall) >= shortfall

    def _grow_pages(self, owner: Any, pages: list[int], num_tokens: int) -> None:
        """Grow `owner`'s page list in place (from its reservation) to hold `num_tokens` tokens."""
        extra = ceil_div(num_tokens, self.page_size) - len(pages)
        if extra > 0:
            pages += self._take_pages(extra)
            owner.reserved_pages -= extra

    def _propose_drafts(self) -> list[DraftTree]:
        """Each running sequence's draft tree (a chain with topk 1; a lone root without speculative decoding). A
        sequence drafts at most k tokens deep, and fewer near its end: a step emits at most depth + 1 tokens, within
        max_new_tokens and the context length, so its verify rows stay inside the pages reserved at admission."""
        if self.drafter is None:
            return [DraftTree.chain(seq.last_token, []) for seq in self._running]
        budgets = [self.drafter.budget(seq, self.context_length) for seq in self._running]
        for seq, budget in zip(self._running, budgets, strict=True):
            self._grow_pages(seq, seq.pages, seq.num_computed + 1 + budget)
        store, topk = self.runner.store, self.config.speculative_eagle_topk or 1
        if topk > 1:
            return self.drafter.propose_trees(store, self._running, budgets, topk, self.config.num_draft_tokens,
                                              self._take_scratch, self.allocator.release)  # fmt: skip
        drafts = self.drafter.propose(store, self._running, budgets)
        return [DraftTree.chain(seq.last_token, d) for seq, d in zip(self._running, drafts, strict=True)]

    def _take_scratch(self, count: int) -> list[int]:
        """Pages a draft tree uses for one step (its beams' and branches' keys): free pages beyond every
        reservation, never the radix cache's (OutOfPages when there are too few)."""
        if self.allocator.num_free - self._reserved < count:
            raise OutOfPages(f"need {count} scratch KV pages, {self.allocator.num_free - self._reserved} spare")
        return self.allocator.allocate(count)

    def _verify_part(self, seq: Sequence, tree: DraftTree) -> tuple[DraftTree, ForwardPart]:
        """A decoding sequence's rows: its draft tree's nodes, each branch a sequence of the attention batch (its
        scratch pages taken now; a tree they do not fit shrinks to its first branch)."""
        n = seq.num_computed
        if not tree.num_drafts:  # a plain decode row: the last token on the sequence's own pages, nothing to copy
            self._grow_pages(seq, seq.pages, n + 1)
            tree.branches = [Branch(0, n, seq.pages)]
            return tree, ForwardPart.chunk(tree.tokens, n, seq.pages, seq.group.lora_id)
        self._grow_pages(seq, seq.pages, n + 1 + tree.depth)
        try:
            tree.lay_out(n, seq.pages, self.page_size, self._take_scratch)
        except OutOfPages:
            self.allocator.release(tree.scratch_pages())
            first = tree.path_nodes(tree.leaves()[0])
            tree = DraftTree.chain(tree.tokens[0], [tree.tokens[node] for node in first[1:]])
            tree.lay_out(n, seq.pages, self.page_size, self._take_scratch)
        self.runner.copy_pages(tree.page_copies(self.page_size))
        branches = tree.branches
        part = ForwardPart(tree.tokens, tree.own_lengths(), [b.prefix for b in branches], [b.table for b in branches],
                           seq.group.lora_id, tree.copy_writes(n, self.page_size))  # fmt: skip
        return tree, part

    def _take_pages(self, count: int) -> list[int]:
        if count > self.allocator.num_free:
            self.radix.evict(count - self.allocator.num_free)
        self._reserved -= count
        return self.allocator.allocate(count)

    def step(self, may_admit: bool) -> None:
        """Admit (unless draining), then run one forward over decode tokens and prompt chunks, and sample."""
        if may_admit:
            self._admit()
        if not self.is_busy:
            return
        with torch.no_grad():
            self._step()
        self.num_steps += 1

    def _step(self) -> None:
        # (kind, seq or group, first row, its tree: a decode's draft tree, a chunk's None) and its forward part
        owners: list[tuple[str, Any, int, DraftTree | None]] = []
        parts: list[ForwardPart] = []
        rows = 0

        def add(kind: str, owner: Any, tree: DraftTree | None, part: ForwardPart) -> None:
            nonlocal rows
            owners.append((kind, owner, rows, tree))
            parts.append(part)
            rows += len(part.ids)

        for seq, tree in zip(self._running, self._propose_drafts(), strict=True):
            add("decode", seq, *self._verify_part(seq, tree))
        budget = max(self.config.max_prefill_tokens - rows, 1)
        for seq in self._refilling:
            if budget <= 0:
                break
            chunk = seq.tokens[seq.num_computed : min(seq.resume_at, seq.num_computed + budget)]
            budget -= len(chunk)
            self.num_prefill_tokens += len(chunk)
            add("refill", seq, None, self._chunk(seq, chunk, seq.pages))
        for group in self._prefilling:
            if budget <= 0:
                break
            chunk = group.prompt_ids[group.num_computed : group.num_computed + budget]
            budget -= len(chunk)
            self.num_prefill_tokens += len(chunk)
            add("prefill", group, None, self._chunk(group, chunk, group.prefill_pages))
        scratch = [page for _, _, _, tree in owners if tree is not None for page in tree.scratch_pages()]
        try:
            self._forward_step(owners, parts)
        finally:
            self.allocator.release(scratch)

    def _chunk(self, owner: Any, chunk: list[int], pages: list[int]) -> ForwardPart:
        """Rows for `chunk`, the next tokens of `owner`; its page list (`pages`, grown in place) covers them."""
        self._grow_pages(owner, pages, owner.num_computed + len(chunk))
        return ForwardPart.chunk(chunk, owner.num_computed, pages, _group_of(owner).lora_id)

    def _forward_step(self, owners: list[tuple[str, Any, int, DraftTree | None]], parts: list[ForwardPart]) -> None:
        try:
            hidden = self.runner.forward(parts)
        except Exception as error:
            if len({id(_group_of(owner)) for _, owner, _, _ in owners}) == 1:
                self._fail_groups({id(_group_of(owners[0][1])): (_group_of(owners[0][1]), error)})
                return
            logger.warning("an engine step failed (%s: %s): running its requests one by one", type(error).__name__,
                           error)  # fmt: skip
            hidden, owners, parts = self._forward_each(owners, parts)
            if not owners:
                return
        self._after_forward(hidden, owners, [len(part.ids) for part in parts])

    def _forward_each(
        self, owners: list[tuple[str, Any, int, DraftTree | None]], parts: list[ForwardPart]
    ) -> tuple[torch.Tensor, list[tuple[str, Any, int, DraftTree | None]], list[ForwardPart]]:
        """A failed step's forward again, one request at a time (`ModelRunner.forward_each`): a request whose own
        forward fails is failed alone, the others go on with their rows."""
        groups = [_group_of(owner) for _, owner, _, _ in owners]
        errors, kept = self.runner.forward_each([(id(group), part) for group, part in zip(groups, parts, strict=True)])
        self._fail_groups({id(g): (g, errors[id(g)]) for g in groups if id(g) in errors})
        new_owners, new_parts, start = [], [], 0
        for k, _ in kept:
            kind, owner, _, tree = owners[k]
            new_owners.append((kind, owner, start, tree))
            new_parts.append(parts[k])
            start += len(parts[k].ids)
        if not kept:
            return torch.empty(0), [], []
        return torch.cat([hidden for _, hidden in kept]), new_owners, new_parts
