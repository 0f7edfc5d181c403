"""The paged K/V store's writes and reads (ops/attention.py): where a forward's tokens put their K/V (`write_kv`, the
engine's cache and the trainer's temporary store alike), a temporary store holding a batch's own tokens
(`scratch_pages`), and the gradient of a write (`read_tokens`). The layout is `AttentionBatch`'s
(ops/attention_batch.py).

Shapes: N tokens, Hkv KV heads, D head dim, P page size; pages (pages, Hkv, P, D).
"""

from __future__ import annotations

import torch

from miles_kernels.ops.attention_batch import AttentionBatch


def write_kv(
    k_pages: torch.Tensor, v_pages: torch.Tensor, k_NKD: torch.Tensor, v_NKD: torch.Tensor, batch: AttentionBatch
) -> None:
    """Store each token's K/V at its page and offset, in place (and the batch's copy writes, see `AttentionBatch`).
    One store for both (`v_pages is k_pages`, MLA's latent cache) is written once. Contiguous stores take the rows as
    one `index_copy_` each at the batch's flat slots (`AttentionBatch.kv_write_slots`, shared by the layers)."""
    stores = (k_pages,) if v_pages is k_pages else (k_pages, v_pages)
    if not all(store.is_contiguous() and store.dim() == 4 and store.shape[2] == batch.page_size for store in stores):
        k_all, v_all, where = kv_writes(k_NKD, v_NKD, batch)
        k_pages.index_put_(where, k_all.to(k_pages.dtype))
        if v_pages is not k_pages:
            v_pages.index_put_(where, v_all.to(v_pages.dtype))
        return
    slots = batch.kv_write_slots(k_NKD.shape[1])
    for store, rows in zip(stores, (k_NKD, v_NKD), strict=False):
        if batch.copy_tokens_C.numel():
            rows = torch.cat((rows, rows[batch.copy_tokens_C]))
        store.view(-1, store.shape[-1]).index_copy_(0, slots, rows.reshape(-1, store.shape[-1]).to(store.dtype))


def kv_writes(
    k_NKD: torch.Tensor, v_NKD: torch.Tensor, batch: AttentionBatch
) -> tuple[torch.Tensor, torch.Tensor, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """The K/V rows a forward stores (the tokens', then their copies') and the (page, head, offset) index of each."""
    pages, offsets = batch.write_pages_N, batch.write_offsets_N
    if batch.copy_tokens_C.numel():
        k_NKD, v_NKD = torch.cat((k_NKD, k_NKD[batch.copy_tokens_C])), torch.cat((v_NKD, v_NKD[batch.copy_tokens_C]))
        pages, offsets = torch.cat((pages, batch.copy_pages_C)), torch.cat((offsets, batch.copy_offsets_C))
    heads = torch.arange(k_NKD.shape[1], device=k_NKD.device)
    return k_NKD, v_NKD, (pages[:, None], heads[None, :], offsets[:, None])


def scratch_pages(
    k_NKD: torch.Tensor, v_NKD: torch.Tensor, batch: AttentionBatch, num_pages: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """A temporary K/V page store (zeros, the null page included) holding the batch's own tokens, written in place
    (one store when the keys are the values, as MLA's latent is)."""
    shape = (num_pages, k_NKD.shape[1], batch.page_size, k_NKD.shape[2])
    k_pages = k_NKD.new_zeros(shape)
    v_pages = k_pages if v_NKD is k_NKD else v_NKD.new_zeros(shape)
    write_kv(k_pages, v_pages, k_NKD, v_NKD, batch)
    return k_pages, v_pages


def read_tokens(pages: torch.Tensor, batch: AttentionBatch) -> torch.Tensor:
    """The gradient of `write_kv`: each token's entry (N, Hkv, D), plus its copy writes' entries (a contiguous store:
    one gather at the batch's flat slots, `AttentionBatch.kv_write_slots`)."""
    if pages.is_contiguous() and pages.dim() == 4 and pages.shape[2] == batch.page_size:
        num_tokens, heads, dim = batch.num_tokens, pages.shape[1], pages.shape[-1]
        slots = batch.kv_write_slots(heads)[: num_tokens * heads]
        out = pages.view(-1, dim).index_select(0, slots).view(num_tokens, heads, dim)
    else:
        out = pages[batch.write_pages_N, :, batch.write_offsets_N]
    if batch.copy_tokens_C.numel():
        out.index_add_(0, batch.copy_tokens_C, pages[batch.copy_pages_C, :, batch.copy_offsets_C])
    return out
