"""The engine's model runner, SGLang's `ModelRunner`: the served model and the memory its forwards use, the KV store
(and, with `enable_return_routed_experts`, the per-slot record of MoE routing: routed_experts.py), and the calls one
engine step makes on them: the trunk's forward over the step's rows (`forward`, each row with its request's LoRA
adapter when the engine serves adapters: served_loras.py), the logits of the rows to sample, and their sampling
(`sample`: row_sampling.py, with a structured-output sample's grammar mask).

It decides nothing about requests: the scheduler (scheduler.py) picks the rows and the pages they read and write, and
hands what was sampled to the output stage (output.py).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

import torch

from miles_kernels import AdapterSlots, CausalLM, KernelConfig, KVStore, build_attention_batch
from miles_rollout.config import EngineConfig
from miles_rollout.draft_tree import DraftTree
from miles_rollout.routed_experts import RoutedExperts
from miles_rollout.row_sampling import Row, SampledRows, sample_rows

if TYPE_CHECKING:
    from miles_rollout.grammar import Grammars
    from miles_rollout.sequence import Sequence

# (sequence, its first row in the step's sampled rows, its draft tree, whether it was decoding)
Entry = tuple["Sequence", int, DraftTree, bool]


@dataclass
class ForwardPart:
    """One owner's rows in a step's forward: its token ids, laid out as one or more sequences of the attention batch
    (`query_lens`, `prefix_lens`, `tables`: a chunk is one, a draft tree's branches several; draft_tree.py), its
    copy writes (row of the part, page, offset) and its LoRA adapter (None: the base model)."""

    ids: list[int]
    query_lens: list[int]
    prefix_lens: list[int]
    tables: list[list[int]]
    adapter: str | None = None
    copies: list[tuple[int, int, int]] = field(default_factory=list)

    @classmethod
    def chunk(cls, ids: list[int], prefix_len: int, table: list[int], adapter: str | None) -> ForwardPart:
        """Consecutive tokens after `prefix_len` cached ones."""
        return cls(ids, [len(ids)], [prefix_len], [table], adapter)


class ModelRunner:
    """`model` with its KV store of `config.num_kv_pages` pages (and one draft layer's when `has_draft`)."""

    def __init__(
        self, model: CausalLM, config: EngineConfig, kernel: KernelConfig, eos_ids: set[int],
        grammars: Callable[[], Grammars], has_draft: bool, adapters: AdapterSlots | None = None,
    ) -> None:  # fmt: skip
        self.model = model
        self.adapters = adapters  # the per-request LoRA adapters on the trunk (None: the engine serves none)
        self.device = config.device
        self.page_size = kernel.page_size
        self.query_tile = kernel.attention_query_tile
        self.eos_ids = eos_ids
        self.grammars = grammars
        draft_kv = model.eagle3.kv_shape if model.eagle3 is not None else None  # its own shape (an MLA target's too)
        self.store = KVStore.allocate(
            model.config, config.num_kv_pages, self.page_size, kernel.torch_dtype, config.device,
            num_draft_layers=1 if has_draft else 0, draft_kv=draft_kv,
        )  # fmt: skip
        self.routed_experts: RoutedExperts | None = None
        if config.enable_return_routed_experts:
            self.routed_experts = RoutedExperts(model, config.num_kv_pages, self.page_size, config.device)

    def kv_tensors(self) -> list[torch.Tensor]:
        """The KV store's tensors, each once (the trunk's layers, then the draft's; MLA: one latent store a layer)."""
        return self.store.tensors()

    def forward(self, parts: list[ForwardPart]) -> torch.Tensor:
        """The trunk's forward over a step's rows (`parts`, each an owner's, with its LoRA adapter; their K/V written
        to the store, copy writes included); the rows' states: the hidden states (rows, H), followed with an EAGLE-3
        draft by its features (rows, H + 3H; `hidden_states` takes the first part)."""
        query_lens = [n for part in parts for n in part.query_lens]
        prefix_lens = [n for part in parts for n in part.prefix_lens]
        tables = [t for part in parts for t in part.tables]
        batch = build_attention_batch(query_lens, prefix_lens, tables, self.page_size, self.query_tile, self.device)
        copies, start = [], 0
        for part in parts:
            copies += [(start + row, page, offset) for row, page, offset in part.copies]
            start += len(part.ids)
        if copies:
            tokens, pages, offsets = (torch.tensor(c, dtype=torch.int64, device=self.device)
                                      for c in zip(*copies, strict=True))  # fmt: skip
            batch = replace(batch, copy_tokens_C=tokens, copy_pages_C=pages, copy_offsets_C=offsets)
        adapters = [part.adapter for part in parts]
        slots = self.adapters if any(a is not None for a in adapters) else None
        if slots is not None:
            slots.set_rows([part.adapter for part in parts for _ in part.ids])
        ids = [t for part in parts for t in part.ids]
        try:
            hidden = self.model.forward_hidden(torch.tensor(ids, device=self.device), batch, self.store)
        finally:
            if slots is not None:  # the draft's forwards and the LM head run without adapters
                slots.clear_rows()
        if self.routed_experts is not None:  # before the draft's forwards (their MoE layers are not the trunk's)
            self.routed_experts.record(batch, self.model.last_routing())
        features = self.model.last_draft_features if self.model.eagle3 is not None else None
        return hidden if features is None else torch.cat((hidden, features), dim=-1)

    def forward_each(
        self, parts: list[tuple[int, ForwardPart]]
    ) -> tuple[dict[int, BaseException], list[tuple[int, torch.Tensor]]]:
        """A failed step's forward again, one part at a time (`parts`: its request's key and the part): the requests
        whose own forward fails (key -> error; their later parts are skipped), and each other part's rows by index
        (the same bits in deterministic mode: every op is batch-invariant)."""
        failed: dict[int, BaseException] = {}
        kept: list[tuple[int, torch.Tensor]] = []
        for k, (key, part) in enumerate(parts):
            if key in failed:
                continue
            try:
                kept.append((k, self.forward([part])))
            except Exception as error:
                failed[key] = error
        return failed, [(k, hidden) for k, hidden in kept if parts[k][0] not in failed]

    def hidden_states(self, rows: torch.Tensor) -> torch.Tensor:
        """The final hidden states (N, H) of a step's rows (`forward`)."""
        return rows[:, : self.model.config.hidden_size]

    def logits(self, hidden: torch.Tensor, rows: list[int]) -> torch.Tensor:
        """The LM head's logits of `rows` of a step's rows (`forward`)."""
        return self.model.logits(self.hidden_states(hidden[torch.tensor(rows, device=hidden.device)]))

    def copy_pages(self, pairs: list[tuple[int, int]]) -> None:
        """Copy each (source, target) page's K/V (and recorded routing) into its target: one gather and one scatter
        per store tensor for all of them (a chain, a target that is also a source, is copied pair by pair, in
        order)."""
        if not pairs:
            return
        if {target for _, target in pairs} & {source for source, _ in pairs}:
            for pair in pairs:
                self.copy_pages([pair])
            return
        sources, targets = (torch.tensor(pages, device=self.store.k[0].device) for pages in zip(*pairs, strict=True))
        for store in self.store.tensors():
            store.index_copy_(0, targets, store.index_select(0, sources))
        if self.routed_experts is not None:
            self.routed_experts.copy_pages(sources.cpu(), targets.cpu())

    def sample(
        self, logits: torch.Tensor, entries: list[Entry], failed: dict[int, tuple[Any, BaseException]]
    ) -> list[SampledRows | None]:
        """Each entry's sampled rows (its decode or verify rows), sampled as one batch; if that fails, entry by entry,
        so that a request whose own sampling fails is failed alone (`failed`, by group id: its entries None) and the
        others keep their tokens (the same bits: sampling is row by row)."""

        def sample(chosen: list[Entry]) -> SampledRows:
            row_index = [first + i for _, first, tree, _ in chosen for i in range(len(tree.tokens))]
            rows = [Row(seq, tree.drafted(i)) for seq, _, tree, _ in chosen for i in range(len(tree.tokens))]
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
        for _, _, tree, _ in entries:
            end = at + len(tree.tokens)
            per_entry.append(SampledRows(whole.tokens[at:end], whole.logprobs[at:end], whole.top[at:end]))
            at = end
        return per_entry

    def routing_of(self, seq: Sequence) -> str | None:
        """A finished sequence's recorded routing of positions [routed_experts_start_len, seqlen - 1) (SGLang's
        range: the last token never went through a forward); None when the sequence no longer holds all of them
        (aborted while it waited to be admitted again or recomputed its KV, as SGLang returns none for a request
        aborted in its waiting queue)."""
        assert self.routed_experts is not None
        end = seq.num_tokens - 1
        if seq.num_computed < end:
            return None
        assert len(seq.pages) * self.page_size >= end
        start = min(seq.group.routed_experts_start_len, end)
        return self.routed_experts.gather(seq.pages, start, end)
