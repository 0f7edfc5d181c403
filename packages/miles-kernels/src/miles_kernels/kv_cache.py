"""The engine's KV cache: paged K/V storage of every layer, shared with the attention kernel's page layout.

The rollout engine decides which sequence holds which page (`miles_rollout/page_allocator.py`, with prefix reuse in
`miles_rollout/radix_cache.py`); this module only holds the storage that `CausalLM.forward_hidden` writes into.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from miles_kernels.model_config import ModelConfig


@dataclass
class KVStore:
    """Paged K/V storage of every layer: `k[layer]`, `v[layer]` of shape (pages, Hkv, page_size, D).

    Layers 0 .. L - 1 are the trunk's; with `num_draft_layers`, layers L + i hold MTP module i's K/V (speculative
    decoding's draft) at the same pages and slots as the trunk's, so a sequence's pages hold both; `draft_kv`
    (KV heads, head dim) gives the draft layers a shape of their own (an EAGLE-3 draft: plain K and V, also beside
    a latent store).
    Zero-initialized (page 0 is the null page), so masked slots always hold finite values.
    Under multi-head latent attention (DeepSeek-V3) a layer holds one latent store of shape (pages, 1, page_size,
    kv_lora_rank + qk_rope_head_dim), which is both `k[layer]` and `v[layer]` (the same tensor; latent_attention.py,
    `LatentAttention`): `tensors()` lists each store once.
    """

    k: list[torch.Tensor]
    v: list[torch.Tensor]

    @classmethod
    def allocate(
        cls,
        config: ModelConfig,
        num_pages: int,
        page_size: int,
        dtype: torch.dtype,
        device: torch.device | str,
        num_draft_layers: int = 0,
        draft_kv: tuple[int, int] | None = None,
    ) -> KVStore:
        if draft_kv is not None:
            store = cls.allocate(config, num_pages, page_size, dtype, device)
            heads, dim = draft_kv
            for _ in range(num_draft_layers):
                store.k.append(torch.zeros((num_pages, heads, page_size, dim), dtype=dtype, device=device))
                store.v.append(torch.zeros((num_pages, heads, page_size, dim), dtype=dtype, device=device))
            return store
        num_layers = config.num_hidden_layers + num_draft_layers
        if config.is_mla:
            latent = [
                torch.zeros((num_pages, 1, page_size, config.kv_cache_width), dtype=dtype, device=device)
                for _ in range(num_layers)
            ]
            return cls(k=latent, v=list(latent))
        shape = (num_pages, config.num_key_value_heads, page_size, config.head_dim)
        return cls(
            k=[torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)],
            v=[torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)],
        )

    def tensors(self) -> list[torch.Tensor]:
        """Every storage tensor once: the layers' K, then their V (a latent store, K and V at once, listed once)."""
        return list({id(tensor): tensor for tensor in (*self.k, *self.v)}.values())

    @property
    def bytes_per_token(self) -> int:
        """Cache bytes one token takes over every layer (the draft's included); from the shapes, so it holds while the
        storage is released (`/release_memory_occupation`)."""
        return sum(t.shape[1] * t.shape[3] * t.element_size() for t in self.tensors())

    @property
    def num_pages(self) -> int:
        return int(self.k[0].shape[0]) if self.k else 0
