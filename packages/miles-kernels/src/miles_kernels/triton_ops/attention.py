"""Causal GQA attention over the paged KV store by a Triton kernel, batch-invariant and the same bits for a token
however it is computed (prefill, chunked prefill, verify, decode, the trainer's packed forward).

One program per (query token, KV head) takes that head's G query heads as one (G, D) tile and walks the token's
key blocks (`page_size` keys each, aligned to absolute positions, read through its sequence's block table) in
ascending order from the first block it may see, with an online softmax in float32: a running max, a running sum
and an accumulator, updated once per block. Keys after the token's position (and, with a sliding `window`, before
it) are masked inside their block. A token's arithmetic therefore depends only on its query, its position and its
sequence's keys: not on the other tokens of the call, their number, the chunk it came in, or the prefix cache.
This is `ops/attention.py`'s contract (the torch blocked attention), computed by another schedule: the two agree
within float32 rounding, not bit for bit, so engine and trainer must both run this backend
(`kernel.attention_backend=triton`; the fingerprint names it).

Shapes as in `ops/attention.py`: q (N, H, D), K/V pages (pages, Hkv, P, D), out (N, H, D). Importing this module
imports Triton.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from miles_kernels.ops.attention_batch import AttentionBatch
from miles_kernels.triton_ops import interpreting

MIN_DOT = 16  # tl.dot's smallest side on a GPU
# Keys per split of a long key range (aligned to absolute positions): a token whose keys span several splits has
# them walked by one program each, in parallel, and merged in ascending order; a token's splits depend only on its
# position, so prefill and decode split it alike (the same bits).
SPLIT_KEYS = 1024


@triton.jit
def _attention_kernel(
    q_ptr, k_ptr, v_ptr, out_ptr, part_max_ptr, part_sum_ptr, part_acc_ptr, positions_ptr, seqs_ptr, tables_ptr,
    stride_qn, stride_qh, stride_kp, stride_kh, stride_ko, stride_on, stride_oh, stride_table, max_splits,
    scale, window,
    G: tl.constexpr, BLOCK_G: tl.constexpr, P: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr,
    SPLIT_BLOCKS: tl.constexpr, HAS_WINDOW: tl.constexpr,
):  # fmt: skip
    token = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1).to(tl.int64)
    split = tl.program_id(2)
    position = tl.load(positions_ptr + token).to(tl.int32)  # int32 throughout: one type for the loop bounds
    last_block = position // P
    num_splits = last_block // SPLIT_BLOCKS + 1
    if split < num_splits:
        seq = tl.load(seqs_ptr + token).to(tl.int64)
        rows = tl.arange(0, BLOCK_G)
        dims = tl.arange(0, BLOCK_D)
        offsets = tl.arange(0, P)
        q = tl.load(q_ptr + token * stride_qn + (kv_head * G + rows)[:, None] * stride_qh + dims[None, :],
                    mask=(rows[:, None] < G) & (dims[None, :] < D), other=0.0).to(tl.float32)  # fmt: skip
        running_max = tl.full((BLOCK_G,), float("-inf"), dtype=tl.float32)
        running_sum = tl.zeros((BLOCK_G,), dtype=tl.float32)
        acc = tl.zeros((BLOCK_G, BLOCK_D), dtype=tl.float32)
        first_block = split * SPLIT_BLOCKS
        if HAS_WINDOW:
            first_block = tl.maximum(first_block, tl.maximum(position - window + 1, 0) // P)
        for block in range(first_block, tl.minimum(last_block, (split + 1) * SPLIT_BLOCKS - 1) + 1):
            page = tl.load(tables_ptr + seq * stride_table + block).to(tl.int64)
            kv_offsets = page * stride_kp + kv_head * stride_kh + offsets[:, None] * stride_ko + dims[None, :]
            k = tl.load(k_ptr + kv_offsets, mask=dims[None, :] < D, other=0.0).to(tl.float32)
            v = tl.load(v_ptr + kv_offsets, mask=dims[None, :] < D, other=0.0).to(tl.float32)
            scores = tl.dot(q, tl.trans(k), input_precision="ieee") * scale
            keys = block * P + offsets
            visible = keys <= position
            if HAS_WINDOW:
                visible = visible & (keys > position - window)
            scores = tl.where(visible[None, :], scores, float("-inf"))
            # a split's first block holds a key the token sees (its split's first key, or its window's first): the
            # max is finite from it on
            new_max = tl.maximum(running_max, tl.max(scores, axis=1))
            probs = tl.exp(scores - new_max[:, None])
            correction = tl.exp(running_max - new_max)
            running_sum = running_sum * correction + tl.sum(probs, axis=1)
            acc = acc * correction[:, None] + tl.dot(probs, v, input_precision="ieee")
            running_max = new_max
        head_rows = (kv_head * G + rows)[:, None]
        if num_splits == 1:
            tl.store(out_ptr + token * stride_on + head_rows * stride_oh + dims[None, :],
                     (acc / running_sum[:, None]).to(out_ptr.dtype.element_ty),
                     mask=(rows[:, None] < G) & (dims[None, :] < D))  # fmt: skip
        else:  # a split of a long key range: its state, merged by _combine_kernel (a split wholly before the window
            # leaves max -inf and sum 0)
            slot = ((token * tl.num_programs(1) + kv_head) * max_splits + split) * G
            tl.store(part_max_ptr + slot + rows, running_max, mask=rows < G)
            tl.store(part_sum_ptr + slot + rows, running_sum, mask=rows < G)
            tl.store(part_acc_ptr + (slot + rows)[:, None] * D + dims[None, :], acc,
                     mask=(rows[:, None] < G) & (dims[None, :] < D))  # fmt: skip


@triton.jit
def _combine_kernel(
    out_ptr, part_max_ptr, part_sum_ptr, part_acc_ptr, positions_ptr, stride_on, stride_oh, max_splits,
    G: tl.constexpr, BLOCK_G: tl.constexpr, P: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr,
    SPLIT_BLOCKS: tl.constexpr,
):  # fmt: skip
    token = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1).to(tl.int64)
    num_splits = (tl.load(positions_ptr + token).to(tl.int32) // P) // SPLIT_BLOCKS + 1
    if num_splits > 1:
        rows = tl.arange(0, BLOCK_G)
        dims = tl.arange(0, BLOCK_D)
        base = (token * tl.num_programs(1) + kv_head) * max_splits * G
        total_max = tl.full((BLOCK_G,), float("-inf"), dtype=tl.float32)
        for split in range(0, num_splits):
            part = tl.load(part_max_ptr + base + split * G + rows, mask=rows < G, other=float("-inf"))
            total_max = tl.maximum(total_max, part)
        shift = tl.where(total_max > float("-inf"), total_max, 0.0)  # padding rows saw nothing: no -inf - -inf
        total_sum = tl.zeros((BLOCK_G,), dtype=tl.float32)
        acc = tl.zeros((BLOCK_G, BLOCK_D), dtype=tl.float32)
        for split in range(0, num_splits):  # in ascending order: a fixed sum order per token
            slot = base + split * G + rows
            part_max = tl.load(part_max_ptr + slot, mask=rows < G, other=float("-inf"))
            weight = tl.exp(part_max - shift)  # 0 for a split that saw no key
            total_sum += weight * tl.load(part_sum_ptr + slot, mask=rows < G, other=0.0)
            part_acc = tl.load(part_acc_ptr + slot[:, None] * D + dims[None, :],
                               mask=(rows[:, None] < G) & (dims[None, :] < D), other=0.0)  # fmt: skip
            acc += weight[:, None] * part_acc
        tl.store(out_ptr + token * stride_on + (kv_head * G + rows)[:, None] * stride_oh + dims[None, :],
                 (acc / total_sum[:, None]).to(out_ptr.dtype.element_ty),
                 mask=(rows[:, None] < G) & (dims[None, :] < D))  # fmt: skip


def paged_attention(
    q_NHD: torch.Tensor,
    k_pages_PgHPD: torch.Tensor,
    v_pages_PgHPD: torch.Tensor,
    batch: AttentionBatch,
    scale: float,
    window: int | None = None,
) -> torch.Tensor:
    """Causal attention of the batch's query tokens over their sequences' stored keys (a sliding `window`: each
    query sees only its last `window` keys, itself included); returns (N, H, D) in q's dtype. Forward only."""
    if not (q_NHD.is_cuda or interpreting()):
        raise RuntimeError("the Triton attention runs on CUDA tensors (or on the CPU under TRITON_INTERPRET=1)")
    num_tokens, num_heads, head_dim = q_NHD.shape
    _, num_kv_heads, page, _ = k_pages_PgHPD.shape
    if q_NHD.is_cuda and page < MIN_DOT:
        raise ValueError(f"the Triton attention needs kernel.page_size >= {MIN_DOT} on a GPU (tl.dot); got {page}")
    q = q_NHD.contiguous()
    k_pages, v_pages = k_pages_PgHPD.contiguous(), v_pages_PgHPD.contiguous()
    out = torch.empty_like(q)
    if num_tokens == 0:
        return out
    seqs_N = torch.repeat_interleave(torch.arange(batch.num_seqs, device=q.device), batch.query_lens_S.to(q.device))
    positions = batch.positions_N.contiguous()
    tables = batch.block_tables_SB.contiguous()
    group = num_heads // num_kv_heads
    split_blocks = max(1, SPLIT_KEYS // page)
    max_splits = int(positions.max()) // page // split_blocks + 1
    shape = (num_tokens, num_kv_heads, max_splits, group) if max_splits > 1 else (1,)
    part_max = torch.empty(shape, dtype=torch.float32, device=q.device)
    part_sum = torch.empty_like(part_max)
    part_acc = torch.empty((*shape, head_dim) if max_splits > 1 else (1,), dtype=torch.float32, device=q.device)
    sizes = {"G": group, "BLOCK_G": max(MIN_DOT, triton.next_power_of_2(group)), "P": page, "D": head_dim,
             "BLOCK_D": max(MIN_DOT, triton.next_power_of_2(head_dim)), "SPLIT_BLOCKS": split_blocks}  # fmt: skip
    _attention_kernel[(num_tokens, num_kv_heads, max_splits)](
        q, k_pages, v_pages, out, part_max, part_sum, part_acc, positions, seqs_N, tables,
        q.stride(0), q.stride(1), k_pages.stride(0), k_pages.stride(1), k_pages.stride(2), out.stride(0),
        out.stride(1), tables.stride(0), max_splits, scale, window or 0, HAS_WINDOW=window is not None, **sizes,
    )  # fmt: skip
    if max_splits > 1:
        _combine_kernel[(num_tokens, num_kv_heads)](
            out, part_max, part_sum, part_acc, positions, out.stride(0), out.stride(1), max_splits, **sizes
        )
    return out
