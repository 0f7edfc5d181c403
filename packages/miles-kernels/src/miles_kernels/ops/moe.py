"""Mixture-of-Experts routing and expert compute (Qwen3-MoE), batch-invariant.

- Routing: softmax over experts in float32, then top-k by a *stable* descending sort, so equal probabilities
  always pick the lower expert id. `select_experts` is the one place top-k happens: routing replay (a later
  issue) hooks in there.
- Experts: each expert's tokens go through tiled (fixed-shape) matmuls, so a token's expert output does not depend
  on how many or which other tokens chose the same expert.
- Combine: outputs are added in top-k rank order, one rank at a time, so the sum order is fixed per token.
Shapes: N tokens, H hidden, E experts, K experts per token, I expert intermediate size.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from miles_kernels.config import KernelConfig
from miles_kernels.ops.linear import linear, tiled_matmul


def select_experts(
    router_logits_NE: torch.Tensor, top_k: int, normalize: bool, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k expert ids (N, K) by descending probability (ties: lower id) and their weights (N, K) in `dtype`."""
    probs = torch.softmax(router_logits_NE.to(torch.float32), dim=-1)
    sorted_probs, sorted_ids = torch.sort(probs, dim=-1, descending=True, stable=True)
    weights, expert_ids = sorted_probs[:, :top_k], sorted_ids[:, :top_k]
    if normalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return expert_ids, weights.to(dtype)


def _expert_linear(x: torch.Tensor, weight: torch.Tensor, config: KernelConfig) -> torch.Tensor:
    if config.is_deterministic:
        return tiled_matmul(x, weight, config.moe_tile)
    return linear(x, weight, config)


def experts_forward(
    x_NH: torch.Tensor,
    expert_ids_NK: torch.Tensor,
    weights_NK: torch.Tensor,
    gate_proj: list[torch.Tensor],
    up_proj: list[torch.Tensor],
    down_proj: list[torch.Tensor],
    config: KernelConfig,
) -> torch.Tensor:
    """Sum over each token's K experts of weight * down(silu(gate(x)) * up(x))."""
    num_tokens, top_k = expert_ids_NK.shape
    per_rank = x_NH.new_zeros(top_k, num_tokens, x_NH.shape[1])
    flat_ids = expert_ids_NK.reshape(-1)
    order = torch.argsort(flat_ids, stable=True)  # group (token, rank) pairs by expert, token order kept
    counts = torch.bincount(flat_ids, minlength=len(gate_proj)).tolist()
    start = 0
    for expert, count in enumerate(counts):
        if count == 0:
            continue
        pairs = order[start : start + count]
        start += count
        tokens, ranks = pairs // top_k, pairs % top_k
        x_e = x_NH[tokens]
        hidden = F.silu(_expert_linear(x_e, gate_proj[expert], config)) * _expert_linear(x_e, up_proj[expert], config)
        y = _expert_linear(hidden, down_proj[expert], config) * weights_NK[tokens, ranks][:, None]
        per_rank = per_rank.index_put((ranks, tokens), y)
    out = per_rank[0]
    for rank in range(1, top_k):
        out = out + per_rank[rank]
    return out
