"""Mixture-of-Experts routing and expert compute (Qwen3-MoE, GLM-4.5 MoE), batch-invariant.

- Routing: router scores in float32, then top-k by a *stable* descending sort, so equal scores always pick the
  lower expert id (and, in grouped routing, equal group scores the lower group): the stated tie rule, where
  transformers' `topk(sorted=False)` leaves tie order unspecified. Each token's choice depends on its own scores
  only, so routing is batch-invariant whenever the router logits are (the sigmoid is ops/activation.py's).
  - Qwen3-MoE (`select_experts`): probabilities = softmax(logits); the k most probable experts, weights = their
    probabilities, renormalized to sum to 1 when `normalize`.
  - GLM-4.5 / DeepSeek-V3 (`select_experts_grouped`): scores = sigmoid(logits); the choice ranks
    `scores + correction_bias` (the bias steers load balance, it never enters a weight): experts fall in
    `n_group` equal groups, a group's rank is the sum of its two best biased scores, only the `topk_group` best
    groups compete, and the k best biased scores among them win. Weights = the chosen *raw* scores, divided by
    their sum (+ 1e-20) when `normalize`, times `routed_scaling_factor`.
- Routing replay (`replay_NK`): a row of expert ids recorded by the rollout engine replaces the router's own choice
  for that token (rows holding a negative id route normally). The weights are then the same formula evaluated at
  the replayed ids, so the router still learns: the gradient reaches the gate weights through the replayed
  experts' scores (softmax: every logit of the token, through the normalization; sigmoid: the replayed experts'
  logits). Replaying the router's own choice changes no bit.
- `Routing` keeps the scores and the float32 router logits with the choice, for the trainer's routing metrics and
  its load-balancing and z losses (miles_trainer/moe.py).
- Experts: each expert's tokens go through tiled (fixed-shape) matmuls, so a token's expert output does not depend
  on how many or which other tokens chose the same expert.
- Combine: outputs are added in top-k rank order, one rank at a time, so the sum order is fixed per token.
Shapes: N tokens, H hidden, E experts, K experts per token, I expert intermediate size.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from miles_kernels.config import KernelConfig
from miles_kernels.ops.activation import sigmoid, swiglu
from miles_kernels.ops.linear import linear, rows_matmul


class Routing(NamedTuple):
    """One MoE layer's routing of N tokens."""

    expert_ids: torch.Tensor  # (N, K) the experts that ran, in rank order (replayed where replay was given)
    weights: torch.Tensor  # (N, K) their combine weights, in the model dtype
    router_ids: torch.Tensor  # (N, K) the router's own choice (equal to expert_ids without replay)
    scores: torch.Tensor  # (N, E) float32: softmax probabilities or sigmoid scores (metrics, auxiliary losses)
    logits: torch.Tensor | None = None  # (N, E) float32 router logits (the router z-loss)


def _descending(values: torch.Tensor, count: int) -> torch.Tensor:
    """Indices of the `count` largest values of each row, largest first, ties to the lower index."""
    return torch.sort(values, dim=-1, descending=True, stable=True).indices[..., :count]


def _replayed(router_ids_NK: torch.Tensor, replay_NK: torch.Tensor | None, num_experts: int) -> torch.Tensor:
    if replay_NK is None:
        return router_ids_NK
    if replay_NK.shape != router_ids_NK.shape:
        raise ValueError(
            f"replayed routing has shape {tuple(replay_NK.shape)}, the layer routes {tuple(router_ids_NK.shape)}"
        )
    replay_NK = replay_NK.to(device=router_ids_NK.device, dtype=router_ids_NK.dtype)
    if replay_NK.numel() and int(replay_NK.max()) >= num_experts:
        raise ValueError(
            f"replayed expert id {int(replay_NK.max())} is out of range: the layer has {num_experts} experts"
        )
    use = (replay_NK >= 0).all(dim=-1, keepdim=True)
    return torch.where(use, replay_NK, router_ids_NK)


def _weights(
    scores_NE: torch.Tensor, expert_ids_NK: torch.Tensor, normalize: bool, eps: float, scale: float, dtype: torch.dtype
) -> torch.Tensor:
    weights = scores_NE.gather(1, expert_ids_NK)
    if normalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + eps)  # eps 0 adds an exact zero
    if scale != 1.0:
        weights = weights * scale
    return weights.to(dtype)


def route_softmax(
    router_logits_NE: torch.Tensor,
    top_k: int,
    normalize: bool,
    dtype: torch.dtype,
    replay_NK: torch.Tensor | None = None,
) -> Routing:
    """Qwen3-MoE routing (see the module docstring)."""
    logits = router_logits_NE.to(torch.float32)
    probs = torch.softmax(logits, dim=-1)
    router_ids = _descending(probs, top_k)
    expert_ids = _replayed(router_ids, replay_NK, probs.shape[-1])
    return Routing(expert_ids, _weights(probs, expert_ids, normalize, 0.0, 1.0, dtype), router_ids, probs, logits)


def route_grouped_sigmoid(
    router_logits_NE: torch.Tensor,
    correction_bias_E: torch.Tensor,
    top_k: int,
    n_group: int,
    topk_group: int,
    normalize: bool,
    scaling: float,
    dtype: torch.dtype,
    replay_NK: torch.Tensor | None = None,
) -> Routing:
    """GLM-4.5 / DeepSeek-V3 routing (see the module docstring)."""
    logits = router_logits_NE.to(torch.float32)
    scores = sigmoid(logits)
    choice = scores + correction_bias_E.to(torch.float32)
    num_tokens, num_experts = choice.shape
    if topk_group < n_group:
        grouped = choice.view(num_tokens, n_group, num_experts // n_group)
        group_scores = torch.sort(grouped, dim=-1, descending=True, stable=True).values[..., :2].sum(dim=-1)
        kept = torch.zeros_like(group_scores, dtype=torch.bool).scatter(1, _descending(group_scores, topk_group), True)
        choice = choice.masked_fill(~kept.repeat_interleave(num_experts // n_group, dim=1), float("-inf"))
    router_ids = _descending(choice, top_k)
    expert_ids = _replayed(router_ids, replay_NK, num_experts)
    weights = _weights(scores, expert_ids, normalize, 1e-20, scaling, dtype)
    return Routing(expert_ids, weights, router_ids, scores, logits)


def select_experts(
    router_logits_NE: torch.Tensor, top_k: int, normalize: bool, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """Qwen3-MoE top-k expert ids (N, K) by descending probability (ties: lower id) and their weights (N, K) in
    `dtype`."""
    routing = route_softmax(router_logits_NE, top_k, normalize, dtype)
    return routing.expert_ids, routing.weights


def _expert_linear(x: torch.Tensor, weight: torch.Tensor, config: KernelConfig) -> torch.Tensor:
    if config.is_deterministic:
        return rows_matmul(x, weight, config, config.moe_tile)
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
    if config.is_deterministic and config.linear_backend == "triton":
        per_rank = _grouped_experts(x_NH, order, counts, weights_NK, (gate_proj, up_proj, down_proj), config, per_rank)
        return combine_ranks(per_rank)
    start = 0
    for expert, count in enumerate(counts):
        if count == 0:
            continue
        pairs = order[start : start + count]
        start += count
        tokens, ranks = pairs // top_k, pairs % top_k
        y = expert_mlp(x_NH[tokens], gate_proj[expert], up_proj[expert], down_proj[expert], config)
        per_rank = per_rank.index_put((ranks, tokens), y * weights_NK[tokens, ranks][:, None])
    return combine_ranks(per_rank)


def expert_mlp(
    x_MH: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor, config: KernelConfig
) -> torch.Tensor:
    """One expert on its rows, down(swiglu(gate(x), up(x))), unweighted: in deterministic mode fixed-shape
    `moe_tile` GEMMs, so a row's output does not depend on the other rows (any grouping of an expert's rows, on any
    rank, gives the same bits)."""
    hidden = swiglu(_expert_linear(x_MH, gate, config), _expert_linear(x_MH, up, config))
    return _expert_linear(hidden, down, config)


def combine_ranks(per_rank_KNH: torch.Tensor) -> torch.Tensor:
    """The experts' outputs added in top-k rank order, one rank at a time (a fixed sum order per token)."""
    out = per_rank_KNH[0]
    for rank in range(1, per_rank_KNH.shape[0]):
        out = out + per_rank_KNH[rank]
    return out


def _grouped_experts(
    x_NH: torch.Tensor, order: torch.Tensor, counts: list[int], weights_NK: torch.Tensor,
    projections: tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor]], config: KernelConfig,
    per_rank: torch.Tensor,
) -> torch.Tensor:  # fmt: skip
    """`experts_forward` on the Triton grouped GEMM (kernel.linear_backend=triton): every expert's rows in one
    launch per projection (miles_kernels/triton_ops/grouped.py), each row's arithmetic its own."""
    from miles_kernels.triton_ops.grouped import grouped_matmul

    gate_proj, up_proj, down_proj = projections
    top_k = weights_NK.shape[1]
    tokens, ranks = order // top_k, order % top_k
    x_sorted = x_NH[tokens]
    hidden = swiglu(grouped_matmul(x_sorted, counts, gate_proj, config.moe_tile),
                    grouped_matmul(x_sorted, counts, up_proj, config.moe_tile))  # fmt: skip
    y = grouped_matmul(hidden, counts, down_proj, config.moe_tile) * weights_NK[tokens, ranks][:, None]
    return per_rank.index_put((ranks, tokens), y)
