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


@triton.jit
def _attention_kernel(
    q_ptr, k_ptr, v_ptr, out_ptr, positions_ptr, seqs_ptr, tables_ptr,
    stride_qn, stride_qh, stride_kp, stride_kh, stride_ko, stride_on, stride_oh, stride_table,
    scale, window,
    G: tl.constexpr, BLOCK_G: tl.constexpr, P: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
):  # fmt: skip
    token = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1).to(tl.int64)
    position = tl.load(positions_ptr + token)
    seq = tl.load(seqs_ptr + token)
    rows = tl.arange(0, BLOCK_G)
    dims = tl.arange(0, BLOCK_D)
    offsets = tl.arange(0, P)
    q = tl.load(q_ptr + token * stride_qn + (kv_head * G + rows)[:, None] * stride_qh + dims[None, :],
                mask=(rows[:, None] < G) & (dims[None, :] < D), other=0.0).to(tl.float32)  # fmt: skip
    running_max = tl.full((BLOCK_G,), float("-inf"), dtype=tl.float32)
    running_sum = tl.zeros((BLOCK_G,), dtype=tl.float32)
    acc = tl.zeros((BLOCK_G, BLOCK_D), dtype=tl.float32)
    first_block = 0
    if HAS_WINDOW:
        first_block = tl.maximum(position - window + 1, 0) // P
    for block in range(first_block, position // P + 1):
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
        # the first block a token walks holds a key it sees (key 0, or its window's first): the max is finite
        new_max = tl.maximum(running_max, tl.max(scores, axis=1))
        probs = tl.exp(scores - new_max[:, None])
        correction = tl.exp(running_max - new_max)
        running_sum = running_sum * correction + tl.sum(probs, axis=1)
        acc = acc * correction[:, None] + tl.dot(probs, v, input_precision="ieee")
        running_max = new_max
    out = acc / running_sum[:, None]
    tl.store(out_ptr + token * stride_on + (kv_head * G + rows)[:, None] * stride_oh + dims[None, :],
             out.to(out_ptr.dtype.element_ty), mask=(rows[:, None] < G) & (dims[None, :] < D))  # fmt: skip


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
    tables = batch.block_tables_SB.contiguous()
    group = num_heads // num_kv_heads
    _attention_kernel[(num_tokens, num_kv_heads)](
        q, k_pages, v_pages, out, batch.positions_N.contiguous(), seqs_N, tables,
        q.stride(0), q.stride(1), k_pages.stride(0), k_pages.stride(1), k_pages.stride(2), out.stride(0),
        out.stride(1), tables.stride(0), scale, window or 0,
        G=group, BLOCK_G=max(MIN_DOT, triton.next_power_of_2(group)), P=page, D=head_dim,
        BLOCK_D=max(MIN_DOT, triton.next_power_of_2(head_dim)), HAS_WINDOW=window is not None,
    )  # fmt: skip
    return out
