"""The Gumbel-max sampler of `miles_kernels.ops.sampling` as one Triton kernel: per row, the counter-based noise
(splitmix64 of the row's key and the token id, a float64 uniform, -log(-log(u))), `logits / T` plus that noise in
float64, and the first maximum, fused over fixed `BLOCK`-wide vocabulary chunks walked from token 0. A row's token
depends only on its logits, temperature and key (seed, position): batch-invariant, the noise the torch sampler's.
Filtered tokens (top-k / top-p / min-p) come in as -inf logits.

Importing this module imports Triton.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from miles_kernels.ops.sampling import RowSampling, row_keys
from miles_kernels.triton_ops import interpreting

BLOCK = 1024  # vocabulary entries per chunk


@triton.jit
def _gumbel_argmax_kernel(logits_ptr, keys_ptr, temperatures_ptr, out_ptr, V, stride_row, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    key = tl.load(keys_ptr + row).to(tl.uint64, bitcast=True)
    temperature = tl.load(temperatures_ptr + row)
    best_score = tl.full((), float("-inf"), dtype=tl.float64)  # typed: a loop-carried value keeps one type
    best_token = tl.full((), 0, dtype=tl.int32)
    for v0 in range(0, V, BLOCK):
        tokens = v0 + tl.arange(0, BLOCK)
        bits = key ^ tokens.to(tl.uint64)
        bits = bits + 0x9E3779B97F4A7C15
        bits = (bits ^ (bits >> 30)) * 0xBF58476D1CE4E5B9
        bits = (bits ^ (bits >> 27)) * 0x94D049BB133111EB
        bits = bits ^ (bits >> 31)
        uniform = ((bits >> 11).to(tl.float64) + 0.5) * (1.0 / 9007199254740992.0)
        noise = -tl.log(-tl.log(uniform))
        logits = tl.load(logits_ptr + row * stride_row + tokens, mask=tokens < V, other=float("-inf"))
        scores = tl.where(tokens < V, logits.to(tl.float64) / temperature + noise, float("-inf"))
        chunk_best = tl.max(scores, axis=0)
        chunk_token = v0 + tl.argmax(scores, axis=0, tie_break_left=True)
        if chunk_best > best_score:  # strictly greater: the first maximum wins across chunks too
            best_score = chunk_best
            best_token = chunk_token
    tl.store(out_ptr + row, best_token)


def gumbel_argmax(logits_MV: torch.Tensor, rows: Sequence[RowSampling]) -> torch.Tensor:
    """The sampled token of each (non-greedy) row: argmax of `logits / T + gumbel(seed, position, token)`."""
    if not (logits_MV.is_cuda or interpreting()):
        raise RuntimeError("the Triton sampler runs on CUDA tensors (or on the CPU under TRITON_INTERPRET=1)")
    if len(rows) != logits_MV.shape[0] or any(r.is_greedy for r in rows):
        raise ValueError("give one non-greedy RowSampling per logit row (greedy rows take the argmax)")
    device = logits_MV.device
    logits = logits_MV.contiguous()
    keys = row_keys(rows, device)
    temperatures = torch.tensor([r.temperature for r in rows], dtype=torch.float64, device=device)
    out = torch.empty(len(rows), dtype=torch.int64, device=device)
    if rows:
        vocab = logits.shape[1]
        _gumbel_argmax_kernel[(len(rows),)](logits, keys, temperatures, out, vocab, logits.stride(0),
                                            BLOCK=min(BLOCK, triton.next_power_of_2(vocab)))  # fmt: skip
    return out
