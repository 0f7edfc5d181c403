"""The engine's scheduler: continuous batching with chunked prefill over a paged KV cache and a radix prefix
cache, then sampling, log-probs and stop handling. It runs on the engine thread only (no locking here).

Each `step`:
1. admits waiting prompts while sequences and KV pages allow (pages are reserved for the whole generation at
   admission, so a running request never runs out; a request that waits is never over-allocated);
2. builds one mixed batch: one token for every decoding sequence, then prompt chunks under the step's token
   budget (chunked prefill), and runs one forward over it;
3. samples the next token of every sequence whose input ended this step, records its log-prob (the log-prob
   contract), and finishes sequences on EOS / stop token / stop string / max_new_tokens / context length.
A prompt with `n` samples is prefilled once, then forked: full pages are shared, the partial page is copied.
With speculative decoding (`EngineConfig.speculative_algorithm`; speculative.py) a decoding sequence brings its
last token and up to k draft tokens to the forward, and a step emits one or more tokens per sequence.
With `EngineConfig.enable_return_routed_experts` every forward's MoE routing is recorded per KV slot and a finished
sequence's is returned with it (routed_experts.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import deque
from collections.abc import Callable
from typing import Any

import torch

from miles_contracts import SamplingParams, WeightVersion
from miles_kernels import CausalLM, KernelConfig, KVStore, build_attention_batch
from miles_rollout.config import EngineConfig
from miles_rollout.detokenizer import IncrementalDetokenizer, IncrementalText
from miles_rollout.engine_error import EngineError
from miles_rollout.grammar import NO_TOKEN_FITS_THE_GRAMMAR, Grammars
from miles_rollout.page_allocator import PageAllocator
from miles_rollout.radix_cache import RadixCache
from miles_rollout.routed_experts import RoutedExperts
from miles_rollout.row_sampling import Row, SampledRows, record_input_logprobs, sample_rows
from miles_rollout.sequence import DraftState, Group, Sequence, build_delta, build_response, finish_reason
from miles_rollout.speculative import Drafter, accept_drafts, add_pending
from miles_rollout.stops import StopMatcher

logger = logging.getLogger("miles_rollout.scheduler")


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def _group_of(owner: Sequence | Group) -> Group:
    """The request (prompt group) a step's row owner belongs to."""
    return owner.group if isinstance(owner, Sequence) else owner


class Scheduler:
    """Waiting, prefilling and running requests, and the KV pages they hold."""

    def __init__(
        self, model: CausalLM, config: EngineConfig, kernel: KernelConfig, tokenizer: Any, context_length: int
    ) -> None:
        self.model = model
        self.config = config
        self.kernel = kernel
        self.tokenizer = tokenizer
        self.context_length = context_length
        self.page_size = kernel.page_size
        self.eos_ids = set(model.config.eos_token_ids())
        if tokenizer is not None and tokenizer.eos_token_id is not None:
            self.eos_ids.add(int(tokenizer.eos_token_id))
        self.drafter: Drafter | None = None
        self._grammars: Grammars | None = None
        if config.num_draft_steps:
            tile = kernel.attention_query_tile
            self.drafter = Drafter(model, config.num_draft_steps, self.page_size, tile, config.device, self.eos_ids)
        self.store = self._allocate_store()
        self.routed_experts: RoutedExperts | None = None
        if config.enable_return_routed_experts:
            self.routed_experts = RoutedExperts(model, config.num_kv_pages, self.page_size, config.device)
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
        self.weight_version: WeightVersion = None  # the engine's, kept current by `Engine.commit_weights`
        self.num_generated_tokens = 0
        self.num_prefill_tokens = 0

    def _allocate_store(self) -> KVStore:
        return KVStore.allocate(
            self.model.config, self.config.num_kv_pages, self.page_size, self.kernel.torch_dtype,
            self.config.device, num_draft_layers=1 if self.drafter is not None else 0,
        )  # fmt: skip

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
            self._cache_pages(group.prompt_ids[: group.num_computed], group.prefill_pages)
            group.prefill_pages, group.num_computed, group.cached_tokens = [], 0, 0
            self._reserved -= group.reserved_pages
            group.reserved_pages = group.total_pages
            self._waiting.appendleft(group)
        self._prefilling = []
        for seq in [*self._refilling, *self._running]:
            seq.resume_at = max(seq.resume_at, seq.num_computed)
            self._cache_pages(seq.tokens[: seq.num_computed], seq.pages)
            seq.pages, seq.num_computed, seq.draft = [], 0, DraftState()
            self._reserved -= seq.reserved_pages
            seq.reserved_pages = 0
            self._retracted.append(seq)
        self._refilling, self._running = [], []
        return count

    def _cache_pages(self, tokens: list[int], pages: list[int]) -> None:
        """Hand a request's pages to the radix cache (full pages of `tokens` stay cached) and drop its hold."""
        if pages:
            self.radix.insert(tokens, pages)
            self.allocator.release(pages)

    def submit(self, groups: list[Group]) -> None:
        self._waiting.extend(groups)

    def forget_kv(self) -> None:
        """Forget every cached page (no request may be running): the KV store's memory is about to be dropped
        (the engine's offload manager, tag `kv_cache`)."""
        assert not self.is_busy
        self.radix.reset()
        self.allocator.reset()

    def kv_tensors(self) -> list[torch.Tensor]:
        """The KV store's tensors (the trunk's layers, then the draft's)."""
        return [*self.store.k, *self.store.v]

    def stats(self) -> dict[str, int]:
        return {
            "num_running": len(self._running),
            "num_prefilling": len(self._prefilling),
            "num_waiting": len(self._waiting),
            "num_retracted": len(self._retracted) + len(self._refilling),
            "num_used_pages": self.allocator.num_used,
            "num_cached_pages": self.radix.num_cached_pages,
            "num_steps": self.num_steps,
            "num_generated_tokens": self.num_generated_tokens,
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
                self._complete_group(group)
            for group in [g for g in self._prefilling if rid is None or g.rid == rid]:
                self._prefilling.remove(group)
                self.allocator.release(group.prefill_pages)
                self._reserved -= group.reserved_pages
                group.sequences = [Sequence(group, i, group.seed + i) for i in range(group.params.n)]
                for seq in group.sequences:
                    seq.finish = finish_reason("abort", message="aborted during prefill")
                self._complete_group(group)
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
        if group.future is not None and group.loop is not None:
            deliver(group.loop, set_exception, group.future, EngineError(message, 500))

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
            if group.future is not None and group.loop is not None:
                deliver(group.loop, set_exception, group.future, EngineError(message, 500))

    def _admit(self) -> None:
        self._admit_retracted()
        while self._waiting and not self._retracted:
            group = self._waiting[0]
            in_batch = len(self._running) + len(self._prefilling) + len(self._refilling)
            if in_batch + group.params.n > self.config.max_running_requests:
                return
            limit = len(group.prompt_ids) - 1
            if group.needs_input_logprobs:
                limit = min(limit, max(group.logprob_start_len - 1, 0))
            matched = self.radix.match(group.prompt_ids[:limit])
            available = self.allocator.num_free + self.radix.num_evictable() - self._reserved
            needed = group.reserved_pages - len(matched)
            if needed > available:
                self.allocator.release(matched)
                return  # admission waits for pages
            self._waiting.popleft()
            group.weight_version = self.weight_version  # the weights it is computed with
            group.reserved_pages = needed
            self._reserved += needed
            group.prefill_pages = matched
            group.num_computed = group.cached_tokens = len(matched) * self.page_size
            group.draft = DraftState(computed=group.num_computed)
            self._prefilling.append(group)

    def _admit_retracted(self) -> None:
        """Re-admit retracted sequences first, in order, when sequences and pages allow."""
        while self._retracted:
            seq = self._retracted[0]
            in_batch = len(self._running) + len(self._prefilling) + len(self._refilling)
            if in_batch + 1 > self.config.max_running_requests:
                return
            matched = self.radix.match(seq.tokens[: seq.resume_at])
            max_tokens = min(len(seq.group.prompt_ids) + seq.group.params.max_new_tokens, self.context_length)
            needed = ceil_div(max_tokens, self.page_size) - len(matched)
            if needed > self.allocator.num_free + self.radix.num_evictable() - self._reserved:
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

    def _grow_pages(self, owner: Any, pages: list[int], num_tokens: int) -> None:
        """Grow `owner`'s page list in place (from its reservation) to hold `num_tokens` tokens."""
        extra = ceil_div(num_tokens, self.page_size) - len(pages)
        if extra > 0:
            pages += self._take_pages(extra)
            owner.reserved_pages -= extra

    def _propose_drafts(self) -> list[list[int]]:
        """Each running sequence's draft tokens (none without speculative decoding). A sequence drafts at most
        k tokens, and fewer near its end: a step emits at most drafts + 1 tokens, within max_new_tokens and the
        context length, so its verify rows stay inside the pages reserved at admission."""
        if self.drafter is None:
            return [[] for _ in self._running]
        budgets = [self.drafter.budget(seq, self.context_length) for seq in self._running]
        for seq, budget in zip(self._running, budgets, strict=True):
            self._grow_pages(seq, seq.pages, seq.num_computed + 1 + budget)
        return self.drafter.propose(self.store, self._running, budgets)

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
        ids: list[int] = []
        query_lens: list[int] = []
        prefix_lens: list[int] = []
        tables: list[list[int]] = []
        # (kind, seq or group, first row, its tokens): "decode" | "refill" | "prefill"
        owners: list[tuple[str, Any, int, list[int]]] = []

        def add(kind: str, owner: Any, chunk: list[int], pages: list[int]) -> None:
            """Rows for `chunk`, the next tokens of `owner`; its page list (`pages`, grown in place) covers them."""
            self._grow_pages(owner, pages, owner.num_computed + len(chunk))
            owners.append((kind, owner, len(ids), chunk))
            ids.extend(chunk)
            query_lens.append(len(chunk))
            prefix_lens.append(owner.num_computed)
            tables.append(pages)

        for seq, drafts in zip(self._running, self._propose_drafts(), strict=True):
            add("decode", seq, seq.tokens[-1:] + drafts, seq.pages)
        budget = max(self.config.max_prefill_tokens - len(ids), 1)
        for seq in self._refilling:
            if budget <= 0:
                break
            chunk = seq.tokens[seq.num_computed : min(seq.resume_at, seq.num_computed + budget)]
            budget -= len(chunk)
            self.num_prefill_tokens += len(chunk)
            add("refill", seq, chunk, seq.pages)
        for group in self._prefilling:
            if budget <= 0:
                break
            chunk = group.prompt_ids[group.num_computed : group.num_computed + budget]
            budget -= len(chunk)
            self.num_prefill_tokens += len(chunk)
            add("prefill", group, chunk, group.prefill_pages)
        try:
            hidden = self._forward(ids, query_lens, prefix_lens, tables)
        except Exception as error:
            if len({id(_group_of(owner)) for _, owner, _, _ in owners}) == 1:
                self._fail_groups({id(_group_of(owners[0][1])): (_group_of(owners[0][1]), error)})
                return
            logger.warning("an engine step failed (%s: %s): running its requests one by one", type(error).__name__,
                           error)  # fmt: skip
            hidden, owners, query_lens = self._forward_each(owners, query_lens, prefix_lens, tables)
            if not owners:
                return
        self._after_forward(hidden, owners, query_lens)

    def _forward(
        self, ids: list[int], query_lens: list[int], prefix_lens: list[int], tables: list[list[int]]
    ) -> torch.Tensor:
        """The trunk's forward over a step's rows (their K/V written to the store); the hidden states (rows, H)."""
        device = self.config.device
        batch = build_attention_batch(
            query_lens, prefix_lens, tables, self.page_size, self.kernel.attention_query_tile, device
        )
        hidden = self.model.forward_hidden(torch.tensor(ids, device=device), batch, self.store)
        if self.routed_experts is not None:  # before the draft's forwards (their MoE layers are not the trunk's)
            self.routed_experts.record(batch, self.model.last_routing())
        return hidden

    def _forward_each(
        self,
        owners: list[tuple[str, Any, int, list[int]]],
        query_lens: list[int],
        prefix_lens: list[int],
        tables: list[list[int]],
    ) -> tuple[torch.Tensor, list[tuple[str, Any, int, list[int]]], list[int]]:
        """A failed step's forward again, one request at a time: a request whose own forward fails is failed alone,
        the others go on with their rows (the same bits in deterministic mode: every op is batch-invariant)."""
        failed: dict[int, tuple[Group, BaseException]] = {}
        kept: list[tuple[int, torch.Tensor]] = []
        for k, (_, owner, _, chunk) in enumerate(owners):
            group = _group_of(owner)
            if id(group) in failed:
                continue
            try:
                kept.append((k, self._forward(chunk, [query_lens[k]], [prefix_lens[k]], [tables[k]])))
            except Exception as error:
                failed[id(group)] = (group, error)
        kept = [(k, hidden) for k, hidden in kept if id(_group_of(owners[k][1])) not in failed]
        self._fail_groups(failed)
        new_owners, new_lens, start = [], [], 0
        for k, _ in kept:
            kind, owner, _, chunk = owners[k]
            new_owners.append((kind, owner, start, chunk))
            new_lens.append(query_lens[k])
            start += query_lens[k]
        if not kept:
            return torch.empty(0), [], []
        return torch.cat([hidden for _, hidden in kept]), new_owners, new_lens

    def _after_forward(
        self, hidden: torch.Tensor, owners: list[tuple[str, Any, int, list[int]]], query_lens: list[int]
    ) -> None:
        # Rows whose logits are needed: every decode / verify row, the last row of a finished prompt.
        to_sample: list[tuple[Sequence | Group, int, list[int]]] = []  # (owner, first row, its draft tokens)
        extended: list[Sequence | Group] = []  # prompt / recomputed chunks: their draft rows (speculative.py)
        for (kind, owner, start, chunk), length in zip(owners, query_lens, strict=True):
            if kind == "decode":  # its last token, then its draft tokens (rolled back in `_sample` if rejected)
                owner.num_computed += length
                to_sample.append((owner, start, chunk[1:]))
                continue
            if self.drafter is not None:
                add_pending(owner.draft, hidden[start : start + length])
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
                record_input_logprobs(self.model, group, hidden[start : start + length], first_position)
            if group.is_prefilled:
                to_sample.append((group, start + length - 1, []))
        if self.drafter is not None and extended:
            self.drafter.extend(self.store, [
                (o.draft, o.prompt_ids if isinstance(o, Group) else o.tokens,
                 o.prefill_pages if isinstance(o, Group) else o.pages, o.num_computed) for o in extended
            ])  # fmt: skip
        if to_sample:
            self._sample(hidden, to_sample)

    def _sample(self, hidden: torch.Tensor, to_sample: list[tuple[Sequence | Group, int, list[int]]]) -> None:
        """Sample every row; a sequence appends one token, or what `accept_drafts` emits from its verify rows."""
        index = [start + i for _, start, drafts in to_sample for i in range(len(drafts) + 1)]
        logits = self.model.logits(hidden[torch.tensor(index, device=hidden.device)])
        entries: list[tuple[Sequence, int, list[int], bool]] = []  # (sequence, first row, drafts, is decoding)
        first = 0
        for owner, _, drafts in to_sample:
            if isinstance(owner, Group):  # its samples start, with the prompt's draft state (`_fork`)
                entries += [(seq, first, drafts, False) for seq in self._fork(owner)]
            else:
                entries.append((owner, first, drafts, True))
            first += len(drafts) + 1
        for seq, *_ in entries:
            if seq.group.params.max_new_tokens == 0:
                self._finish(seq, finish_reason("length", length=0))
        entries = [entry for entry in entries if entry[0].group.params.max_new_tokens > 0]
        if not entries:
            return
        failed: dict[int, tuple[Group, BaseException]] = {}
        per_entry = self._sample_entries(logits, entries, failed)
        for (seq, first, drafts, is_decoding), sampled in zip(entries, per_entry, strict=True):
            if sampled is None or id(seq.group) in failed:
                continue
            try:
                emitted = accept_drafts(drafts, sampled.tokens)
                computed = seq.num_computed - len(drafts)  # with the row that samples the first token
                for i, token in enumerate(emitted):
                    seq.num_computed = computed + i  # the rows up to the one that sampled `token` are kept
                    self._append_token(seq, token, sampled.logprobs[i], sampled.top[i])
                    if seq.finish is not None:
                        break
                if self.drafter is not None and is_decoding:
                    kept = hidden[torch.tensor(index[first : first + len(emitted)], device=hidden.device)]
                    self.drafter.verified(seq, len(drafts), len(emitted), kept)
            except Exception as error:  # one sample's stop, detokenization or grammar: its request alone fails
                failed[id(seq.group)] = (seq.group, error)
        self._fail_groups(failed)

    def _sample_entries(
        self,
        logits: torch.Tensor,
        entries: list[tuple[Sequence, int, list[int], bool]],
        failed: dict[int, tuple[Group, BaseException]],
    ) -> list[SampledRows | None]:
        """Each entry's sampled rows (its decode or verify rows), sampled as one batch; if that fails, entry by entry,
        so that a request whose own sampling fails is failed alone (`failed`, its entries None) and the others keep
        their tokens (the same bits: sampling is row by row)."""

        def sample(chosen: list[tuple[Sequence, int, list[int], bool]]) -> SampledRows:
            row_index = [first + i for _, first, drafts, _ in chosen for i in range(len(drafts) + 1)]
            rows = [Row(seq, drafts[:i]) for seq, _, drafts, _ in chosen for i in range(len(drafts) + 1)]
            constrain = self.grammars().mask if any(row.seq.matcher is not None for row in rows) else None
            return sample_rows(logits[torch.tensor(row_index, device=logits.device)], rows, self.eos_ids, constrain)

        try:
            whole = sample(entries)
        except Exception as error:
            if len({id(seq.group) for seq, *_ in entries}) == 1:
                failed[id(entries[0][0].group)] = (entries[0][0].group, error)
                return [None] * len(entries)
            out: list[SampledRows | None] = []
            for entry in entries:
                try:
                    out.append(sample([entry]))
                except Exception as entry_error:
                    failed[id(entry[0].group)] = (entry[0].group, entry_error)
                    out.append(None)
            return out
        per_entry: list[SampledRows | None] = []
        at = 0
        for _, _, drafts, _ in entries:
            end = at + len(drafts) + 1
            per_entry.append(SampledRows(whole.tokens[at:end], whole.logprobs[at:end], whole.top[at:end]))
            at = end
        return per_entry

    def num_shared_pages(self, prompt_length: int) -> int:
        """Prompt pages a group's samples share; the rest is copied per sample. With a draft, the page of the last
        prompt position is always copied: each sample writes its own draft row there (speculative.py)."""
        return (prompt_length - (self.drafter is not None)) // self.page_size

    def _fork(self, group: Group) -> list[Sequence]:
        """The prompt is computed: start its n samples on its pages (full pages shared, the partial one copied)."""
        self._prefilling.remove(group)
        length = len(group.prompt_ids)
        num_full = self.num_shared_pages(length)
        self.radix.insert(group.prompt_ids, group.prefill_pages[:num_full])
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
                seq.matcher = self.grammars().matcher(group.grammar)
            share = group.reserved_pages // (group.params.n - i)
            seq.reserved_pages, group.reserved_pages = share, group.reserved_pages - share
            children.append(seq)
        if copies:  # one copy per layer and K/V for all the samples (was one per sample)
            targets = torch.tensor(copies, device=self.store.k[0].device)
            for pages in (*self.store.k, *self.store.v):
                pages[targets] = pages[partial[0]].clone()
            if self.routed_experts is not None:
                self.routed_experts.copy_page(partial[0], copies)
        self.allocator.release(group.prefill_pages)
        group.prefill_pages = []
        group.sequences = children
        self._running += children
        return children

    def grammars(self) -> Grammars:
        """The structured-output backend (xgrammar over the tokenizer), made at the first request with a grammar."""
        if self._grammars is None:
            self._grammars = Grammars(self.tokenizer, self.model.config.vocab_size, sorted(self.eos_ids))
        return self._grammars

    def _append_token(self, seq: Sequence, token: int, logprob: float, top: list[tuple[float, int]]) -> None:
        params = seq.group.params
        if seq.matcher is not None and not seq.matcher.accept_token(token):
            # The grammar's mask allowed no token of the vocabulary (each logit -inf, the sampler's choice
            # meaningless): the sample ends here rather than emit a token the grammar forbids.
            self._finish(seq, finish_reason("abort", message=NO_TOKEN_FITS_THE_GRAMMAR))
            return
        seq.output_ids.append(token)
        grammar_done = seq.matcher is not None and seq.matcher.is_terminated()
        seq.output_logprobs.append(logprob)
        if seq.group.top_logprobs_num > 0 and seq.group.return_logprob:
            seq.output_top_logprobs.append(top)
        self.num_generated_tokens += 1
        new_text = self._decode_new(seq)
        may_stop = len(seq.output_ids) >= params.min_new_tokens  # SGLang: no stop before min_new_tokens
        is_eos = token in self.eos_ids and not params.ignore_eos
        if may_stop and (is_eos or (params.stop_token_ids and token in params.stop_token_ids)):
            self._finish(seq, finish_reason("stop", matched=token))
        elif may_stop and new_text and (found := self._find_stop(seq, len(new_text))) is not None:
            seq.stop_match = found
            self._finish(seq, finish_reason("stop", matched=found[1]))
        elif grammar_done:  # the grammar is complete and accepted its end token
            self._finish(seq, finish_reason("stop", matched=token))
        elif len(seq.output_ids) >= params.max_new_tokens:
            self._finish(seq, finish_reason("length", length=len(seq.output_ids)))
        elif len(seq.tokens) >= self.context_length:
            self._finish(seq, finish_reason("length", length=len(seq.output_ids), message="context length reached"))
        if seq.finish is None and seq.group.on_progress is not None:
            self._stream_progress(seq)

    def _decode_new(self, seq: Sequence) -> str:
        """The text a sample's newest token added, when it has stops or streams (decoded token by token, at a cost
        that does not grow with its length: detokenizer.py); "" otherwise (its text is decoded once, at the end)."""
        group = seq.group
        if seq.text_so_far is None:
            if self.tokenizer is None or not (_has_stops(group.params) or group.on_progress is not None):
                return ""
            params = group.params
            if group.stops is None and _has_stops(params):
                group.stops = StopMatcher(params, self.config.limits.stop_regex_window_chars)
            detokenizer = IncrementalDetokenizer(
                self.tokenizer, params.skip_special_tokens, params.spaces_between_special_tokens
            )
            seq.text_so_far = IncrementalText(detokenizer, group.stops.num_context_chars if group.stops else 0)
        return seq.text_so_far.add(seq.output_ids)

    def _find_stop(self, seq: Sequence, num_new: int) -> tuple[int, str] | None:
        """The first stop string or regex match that the sample's newest `num_new` characters complete (stops.py)."""
        if seq.group.stops is None:
            return None
        text = seq.text_so_far
        assert text is not None
        found: tuple[int, str] | None = seq.group.stops.find(text.tail, text.tail_start, num_new)
        return found

    def _stream_progress(self, seq: Sequence) -> None:
        """Hand what a streaming sample gained with its newest token to its listener (`StreamDelta`: new ids and
        log-prob entries, new text), at a cost that does not grow with its length. The text holds back the last
        characters a stop could still trim (`StopMatcher.num_held_chars`) and a trailing partial UTF-8 character
        (detokenizer.py), so streamed text is always a prefix of the final text."""
        group = seq.group
        text = ""
        if seq.text_so_far is not None:
            end = seq.text_so_far.num_chars - (group.stops.num_held_chars if group.stops is not None else 0)
            if end > seq.num_streamed_chars:
                text = seq.text_so_far.between(seq.num_streamed_chars, end)
                seq.num_streamed_chars = end
        delta = build_delta(seq, text, self._token_text_for(group))
        seq.num_streamed_tokens = len(seq.output_ids)
        assert group.on_progress is not None
        group.on_progress(seq.sample_index, delta, False)

    def _decode(self, ids: list[int], params: SamplingParams) -> str:
        """`ids` decoded whole, as the sample's params ask."""
        return str(
            self.tokenizer.decode(
                ids,
                skip_special_tokens=params.skip_special_tokens,
                spaces_between_special_tokens=params.spaces_between_special_tokens,
            )
        )

    def _final_text(self, seq: Sequence) -> str:
        """A finished sample's text: its output ids decoded once, whole (per-token decoding matched stops on, and
        streamed, this text up to a held-back partial character), cut where its stop starts unless no_stop_trim."""
        if self.tokenizer is None:
            return ""
        params = seq.group.params
        text = self._decode(seq.output_ids, params)
        if seq.stop_match is None or params.no_stop_trim:
            return text
        start, matched = seq.stop_match
        if text[start : start + len(matched)] != matched:  # a decoder that rewrites earlier text: SGLang's rule
            start = text.find(matched)
        return text[:start] if start >= 0 else text

    def _token_text(self, token: int) -> str:
        return str(self.tokenizer.decode([token], skip_special_tokens=False))

    def _finish(self, seq: Sequence, reason: Any) -> None:
        seq.text = self._final_text(seq)
        seq.finish = reason
        if seq in self._running:
            self._running.remove(seq)
        if seq.group.return_routed_experts and self.routed_experts is not None:
            seq.routed_experts = self._routed_experts_of(seq)
        if seq.pages:
            self.radix.insert(seq.tokens[: seq.num_computed], seq.pages)
            self.allocator.release(seq.pages)
            seq.pages = []
        self._reserved -= seq.reserved_pages
        seq.reserved_pages = 0
        group = seq.group
        if all(s.finish is not None for s in group.sequences):
            self._reserved -= group.reserved_pages
            group.reserved_pages = 0
            self._complete_group(group)

    def _routed_experts_of(self, seq: Sequence) -> str | None:
        """The routing of positions [routed_experts_start_len, seqlen - 1) (SGLang's range: the last token never
        went through a forward); None when the sequence no longer holds all of them (aborted while it waited to be
        admitted again or recomputed its KV, as SGLang returns none for a request aborted in its waiting queue)."""
        assert self.routed_experts is not None
        end = len(seq.tokens) - 1
        if seq.num_computed < end:
            return None
        assert len(seq.pages) * self.page_size >= end
        start = min(seq.group.routed_experts_start_len, end)
        return self.routed_experts.gather(seq.pages, start, end)

    def _token_text_for(self, group: Group) -> Any:
        return self._token_text if group.return_text_in_logprobs and self.tokenizer is not None else None

    def _complete_group(self, group: Group) -> None:
        responses = [build_response(s, self._token_text_for(group)) for s in group.sequences]
        if group.on_progress is not None:
            for seq, response in zip(group.sequences, responses, strict=True):
                group.on_progress(seq.sample_index, response, True)
        if group.future is not None and group.loop is not None:
            deliver(group.loop, set_result, group.future, responses)


def _has_stops(params: SamplingParams) -> bool:
    return bool(params.stop_strings() or params.stop_regexes())


def deliver(
    loop: asyncio.AbstractEventLoop,
    callback: Callable[[asyncio.Future[Any], Any], None],
    future: asyncio.Future[Any],
    value: Any,
) -> None:
    """Engine thread: hand `value` to `future` on its loop (`callback`: `set_result` or `set_exception`). A closed loop
    means its caller is gone (an in-process caller's `asyncio.run` returned, say, once it had what it streamed):
    nothing to hand over, and never an error of the engine's step, which would fail every other caller's requests."""
    with contextlib.suppress(RuntimeError):
        loop.call_soon_threadsafe(callback, future, value)


def set_result(future: asyncio.Future[Any], value: Any) -> None:
    if not future.done():
        future.set_result(value)


def set_exception(future: asyncio.Future[Any], error: BaseException) -> None:
    if not future.done():
        future.set_exception(error)
