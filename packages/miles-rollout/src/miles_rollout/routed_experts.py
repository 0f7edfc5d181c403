"""Routed experts (routing replay, "R3"): the MoE experts each token was routed to, recorded by the engine and
returned with the response as SGLang 0.5.23 returns them (`--enable-return-routed-experts`,
`sglang/srt/state_capturer/routed_experts.py`).

Where it sits: after every trunk forward the scheduler writes `CausalLM.last_routing()` into a host buffer indexed
by KV slot (page * page_size + offset, the slot where the token's K/V went), so the routing lives and dies with the
KV it belongs to: a prefix-cache hit reads the routing recorded when its KV was computed, a prompt's partial page
copied for each of its n samples is copied here too (`Scheduler._fork`), a recomputed or rejected (speculative)
row is overwritten when its position is computed again. When a sequence finishes, before its pages are released,
the slots of positions [routed_experts_start_len, seqlen - 1) are gathered (the last token never went through a
forward) and sent as SGLang's `meta_info.routed_experts`: base64 of the int32 array's bytes, [rows, L, K], dense
layers' entries 0.

Memory: num_kv_pages * page_size * L * K * 4 bytes on the host (pinned next to a GPU), reported under
`routed_experts` in `/get_server_info`'s `memory_bytes`.
Shapes: N rows of a forward, L num_hidden_layers, K num_experts_per_tok, S KV slots.
"""

from __future__ import annotations

import base64

import torch

from miles_kernels import AttentionBatch, CausalLM


class RoutedExperts:
    """The host buffer of every KV slot's routing (S, L, K) int32, zero until a forward writes the slot."""

    def __init__(self, model: CausalLM, num_kv_pages: int, page_size: int, device: str) -> None:
        config = model.config
        if not config.is_moe:
            raise ValueError(
                f"enable_return_routed_experts: this {config.model_type} model has no MoE layer, so no token is "
                "routed to experts; drop --enable-return-routed-experts or serve an MoE model"
            )
        self.page_size = page_size
        self.num_layers = config.num_hidden_layers
        self.top_k = config.num_experts_per_tok
        is_pinned = torch.device(device).type == "cuda" and torch.cuda.is_available()
        self.buffer_SLK = torch.zeros(
            num_kv_pages * page_size, self.num_layers, self.top_k, dtype=torch.int32, pin_memory=is_pinned
        )

    @property
    def num_bytes(self) -> int:
        return self.buffer_SLK.numel() * self.buffer_SLK.element_size()

    def record(self, batch: AttentionBatch, routing_NLK: torch.Tensor | None) -> None:
        """Write a forward's routing (`last_routing()`) to the slots its rows' K/V went to."""
        assert routing_NLK is not None and routing_NLK.shape[0] == batch.num_tokens, "a trunk forward routes every row"
        slots_N = batch.write_pages_N * self.page_size + batch.write_offsets_N
        self.buffer_SLK[slots_N.cpu()] = routing_NLK.cpu()
        if batch.copy_tokens_C.numel():  # a draft tree's rows also written where other branches read them
            copies_C = batch.copy_pages_C * self.page_size + batch.copy_offsets_C
            self.buffer_SLK[copies_C.cpu()] = routing_NLK[batch.copy_tokens_C].cpu()

    def copy_pages(self, sources: torch.Tensor, targets: torch.Tensor) -> None:
        """Copy page `sources[i]`'s slots to page `targets[i]` (where the scheduler copies its K/V; no target is a
        source)."""
        pages = self.buffer_SLK.view(-1, self.page_size, self.num_layers, self.top_k)
        pages.index_copy_(0, targets, pages.index_select(0, sources))

    def gather(self, pages: list[int], start: int, end: int) -> str:
        """SGLang's `meta_info.routed_experts` for positions [start, end) of a sequence laid out on `pages`: base64
        (standard alphabet) of the int32 array [end - start, L, K] in native (little-endian) byte order."""
        positions = torch.arange(start, end)
        slots = torch.tensor(pages, dtype=torch.int64)[positions // self.page_size] * self.page_size
        rows_NLK = self.buffer_SLK[slots + positions % self.page_size]
        return base64.b64encode(rows_NLK.numpy().tobytes()).decode("ascii")
