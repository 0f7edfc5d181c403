"""`PagedRunner`: the smallest engine-like driver of the model over a paged KV store.

It owns a `KVStore`, gives each sequence pages as it grows, can start a sequence on another's pages (prefix
reuse, whole pages only, as a radix cache shares them) and runs one forward per `step` over
{sequence: new token ids}. The rollout engine adds scheduling, a radix cache and sampling on top; tests of the
kernels and the trainer use this runner as the reference paged-decode path. `packed_logits` is the
trainer-style counterpart (packed sequences, no cache).
"""

from __future__ import annotations

import torch

from miles_kernels.kv_cache import KVStore
from miles_kernels.model import CausalLM
from miles_kernels.ops.attention_batch import build_attention_batch, build_packed_batch


class PagedRunner:
    """Runs a `CausalLM` step by step over a paged KV store."""

    def __init__(self, model: CausalLM, num_pages: int = 512) -> None:
        self.model = model
        self.page_size = model.kernel.page_size
        device = next(model.parameters()).device
        self.store = KVStore.allocate(model.config, num_pages, self.page_size, model.kernel.torch_dtype, device)
        self.next_page = 1  # page 0 is the null page
        self.tables: dict[int, list[int]] = {}
        self.cached: dict[int, int] = {}

    def _ensure_pages(self, seq: int, total: int) -> None:
        table = self.tables.setdefault(seq, [])
        while len(table) * self.page_size < total:
            if self.next_page >= self.store.num_pages:
                raise RuntimeError(f"KV store full ({self.store.num_pages} pages); allocate more pages")
            table.append(self.next_page)
            self.next_page += 1

    def share_prefix(self, seq: int, donor: int, num_tokens: int) -> int:
        """Start `seq` on the donor's pages for its first `num_tokens` (whole pages); returns tokens reused."""
        num_pages = num_tokens // self.page_size
        self.tables[seq] = list(self.tables[donor][:num_pages])
        self.cached[seq] = num_pages * self.page_size
        return self.cached[seq]

    def step(self, chunks: dict[int, torch.Tensor]) -> dict[int, torch.Tensor]:
        """One forward over {seq: new token ids}; returns {seq: float32 logits of those tokens}."""
        seqs = list(chunks)
        for seq in seqs:
            self._ensure_pages(seq, self.cached.get(seq, 0) + len(chunks[seq]))
        batch = build_attention_batch(
            [len(chunks[s]) for s in seqs],
            [self.cached.get(s, 0) for s in seqs],
            [self.tables[s] for s in seqs],
            self.page_size,
            self.model.kernel.attention_query_tile,
            self.store.k[0].device,
        )
        ids = torch.cat([chunks[s] for s in seqs]).to(self.store.k[0].device)
        with torch.no_grad():
            logits = self.model.logits(self.model.forward_hidden(ids, batch, self.store))
        out = dict(zip(seqs, torch.split(logits, [len(chunks[s]) for s in seqs]), strict=True))
        for seq in seqs:
            self.cached[seq] = self.cached.get(seq, 0) + len(chunks[seq])
        return out


def packed_logits(model: CausalLM, seqs: list[torch.Tensor]) -> list[torch.Tensor]:
    """Trainer-style forward of packed sequences (no cache); float32 logits per sequence."""
    lens = [len(s) for s in seqs]
    batch = build_packed_batch(lens, model.kernel.page_size, model.kernel.attention_query_tile, seqs[0].device)
    with torch.no_grad():
        logits = model.logits(model.forward_hidden(torch.cat(seqs), batch))
    return list(torch.split(logits, lens))


def greedy_generate(
    model: CausalLM, prompts: list[list[int]], max_new_tokens: int, eos_ids: set[int] | list[int]
) -> list[list[int]]:
    """Greedy continuations of `prompts` (all decoded together, each up to and including its first EOS token, or
    `max_new_tokens` tokens): a quick probe of a model, without an engine."""
    page_size = model.kernel.page_size
    longest = max((len(p) for p in prompts), default=0) + max_new_tokens
    runner = PagedRunner(model, num_pages=len(prompts) * -(-longest // page_size) + 1)
    device = runner.store.k[0].device
    outputs: list[list[int]] = [[] for _ in prompts]
    chunks = {i: torch.tensor(p, device=device) for i, p in enumerate(prompts)}
    while chunks:
        logits = runner.step(chunks)
        chunks = {}
        for i, rows in logits.items():
            token = int(rows[-1].argmax())
            outputs[i].append(token)
            if token not in eos_ids and len(outputs[i]) < max_new_tokens:
                chunks[i] = torch.tensor([token], device=device)
    return outputs
