"""MoE in the trainer: the engine's recorded routing (routing replay), the routing metrics of a step, and the
load-balancing auxiliary losses (docs/true-on-policy.md, "MoE and routing replay").

- Recorded routing: a sample's `routed_experts` is SGLang's base64 int32 array (num_tokens - 1, L, K): the experts
  the rollout engine chose for each of its tokens but the last, in every layer (dense layers 0). `recorded_routing`
  lays the samples of a micro-batch out on its packed rows (`MicroBatch.sequence_rows`), -1 where nothing was
  recorded; with `routing_replay` the forward uses it (`CausalLM.forward_hidden(routing_NLK=)`, ops/moe.py).
- Metrics of each MoE layer on the trainer's forward: load balance (max / mean tokens per expert; 1 is perfect),
  router entropy (of the softmax probabilities, or of the sigmoid scores normalized to sum to 1), and, where the
  samples carry the engine's routing, the fraction of (token, layer) pairs whose expert set the trainer's router
  chose differently (`moe_routing_flip_frac`: 0 in deterministic mode, where both sides compute the same bits).
- Load-balancing losses (`PolicyLossConfig.moe_aux_loss`, off by default in RL), Megatron-Core's conventions, each
  1.0 at perfectly uniform routing, summed over MoE layers and weighted by `moe_aux_loss_coef`; p = the router's
  probabilities (softmax; sigmoid scores / their sum for GLM-4.5 / DeepSeek-V3), c_e = tokens routed to expert e,
  T tokens, E experts, K per token:
  - `aux_loss` (Switch Transformer, Qwen3-MoE; Megatron `aux_loss`): E * sum_e (c_e / (T K)) * mean_t p_{t,e}
    (transformers' Qwen3-MoE `load_balancing_loss_func` is K times this);
  - `seq_aux_loss` (DeepSeek-V3 / GLM-4.5; Megatron `seq_aux_loss`): the same, per sample (its T_s tokens,
    prompt included), averaged over samples.
  The counts c_e carry no gradient; the probabilities do, so the router learns to balance.
- Router z-loss (`PolicyLossConfig.moe_z_loss_coef`, off by default; ST-MoE, Megatron-Core's `z_loss_func`): per MoE
  layer the mean over tokens of logsumexp(router logits)^2, summed over MoE layers: it keeps the logits small.
Shapes: N packed rows, L layers, K experts per token, E experts.
"""

from __future__ import annotations

import base64
from collections.abc import Sequence

import torch

from miles_contracts import Sample, SampleStatus
from miles_kernels import CausalLM

MOE_AUX_LOSSES = ("none", "aux_loss", "seq_aux_loss")


def moe_shape(model: CausalLM) -> tuple[int, int] | None:
    """(layers, experts per token) of an MoE model's recorded routing; None for a dense model."""
    config = model.config
    return (config.num_hidden_layers, config.num_experts_per_tok) if config.is_moe else None


def decode_routed_experts(sample: Sample, num_layers: int, top_k: int) -> torch.Tensor:
    """A sample's recorded routing as int32 (num_tokens - 1, num_layers, top_k); ValueError if it is absent or has
    another shape."""
    if sample.routed_experts is None:
        raise ValueError(
            f"sample {sample.index} carries no routed experts: routing replay needs the engine's (the rollout "
            "requests return_routed_experts; a custom rollout_fn must copy meta_info.routed_experts to the sample)"
        )
    data = bytearray(base64.b64decode(sample.routed_experts))
    rows = sample.num_tokens - 1
    if len(data) != rows * num_layers * top_k * 4:
        raise ValueError(
            f"sample {sample.index}: routed_experts holds {len(data) // 4} int32 values; its {sample.num_tokens} "
            f"tokens need {rows} x {num_layers} layers x {top_k} = {rows * num_layers * top_k} (SGLang's layout, "
            "routed_experts_start_len = 0)"
        )
    return torch.frombuffer(data, dtype=torch.int32).view(rows, num_layers, top_k)


def recorded_routing(
    samples: Sequence[Sample], sequence_rows: Sequence[Sequence[int]], num_rows: int, num_layers: int, top_k: int
) -> torch.Tensor:
    """The samples' recorded routing on the packed rows of their micro-batch (N, L, K), -1 on rows none records.
    An aborted sample may come back without one (an engine returns none for a request aborted before it ran): its
    rows route by the trainer's router; any other sample without one is an error (`decode_routed_experts`)."""
    out = torch.full((num_rows, num_layers, top_k), -1, dtype=torch.int32)
    for sample, rows in zip(samples, sequence_rows, strict=True):
        if sample.routed_experts is None and sample.status == SampleStatus.ABORTED:
            continue
        out[torch.tensor(list(rows), dtype=torch.int64)] = decode_routed_experts(sample, num_layers, top_k)
    return out


def balance_probs(router: str, scores_NE: torch.Tensor) -> torch.Tensor:
    """(N, E) routing probabilities: softmax as is, sigmoid scores normalized per token (Megatron's aux-loss input);
    `router` is `ModelConfig.router`."""
    if router == "softmax":
        return scores_NE
    return scores_NE / (scores_NE.sum(dim=-1, keepdim=True) + 1e-20)


def _balance(probs_NE: torch.Tensor, expert_ids_NK: torch.Tensor) -> torch.Tensor:
    num_tokens, num_experts = probs_NE.shape
    top_k = expert_ids_NK.shape[1]
    counts = torch.bincount(expert_ids_NK.reshape(-1), minlength=num_experts).to(probs_NE.dtype)
    return num_experts * (counts / (num_tokens * top_k) * probs_NE.mean(dim=0)).sum()


def balance_loss(model: CausalLM, kind: str, sequence_rows: Sequence[Sequence[int]]) -> torch.Tensor:
    """The load-balancing loss of the model's last forward, summed over MoE layers (see the module docstring)."""
    if kind not in MOE_AUX_LOSSES[1:]:
        raise ValueError(f"moe_aux_loss={kind!r}: use one of {list(MOE_AUX_LOSSES)}")
    total: torch.Tensor | None = None
    for moe in model.moe_layers().values():
        assert moe.last_routing is not None
        routing = moe.last_routing
        loss = layer_balance(
            kind, balance_probs(model.config.router, routing.scores), routing.expert_ids, sequence_rows
        )
        total = loss if total is None else total + loss
    if total is None:
        raise ValueError(f"moe_aux_loss={kind!r} needs an MoE policy; {model.config.model_type} has no MoE layer")
    return total


def layer_balance(
    kind: str, probs_NE: torch.Tensor, expert_ids_NK: torch.Tensor, sequence_rows: Sequence[Sequence[int]]
) -> torch.Tensor:
    """One MoE layer's load-balancing loss `kind` over the micro-batch's N rows (`balance_probs`)."""
    if kind == "aux_loss":
        return _balance(probs_NE, expert_ids_NK)
    parts = []
    for rows in sequence_rows:
        index = torch.tensor(list(rows), dtype=torch.int64, device=probs_NE.device)
        parts.append(_balance(probs_NE[index], expert_ids_NK[index]))
    return torch.stack(parts).mean()


def router_z_loss(logits_NE: torch.Tensor) -> torch.Tensor:
    """One MoE layer's z-loss: the mean over its N tokens of logsumexp(router logits)^2."""
    return torch.logsumexp(logits_NE.float(), dim=-1).square().mean()


def z_loss(model: CausalLM) -> torch.Tensor:
    """The router z-loss of the model's last forward, summed over MoE layers (see the module docstring)."""
    total: torch.Tensor | None = None
    for moe in model.moe_layers().values():
        assert moe.last_routing is not None and moe.last_routing.logits is not None
        loss = router_z_loss(moe.last_routing.logits)
        total = loss if total is None else total + loss
    if total is None:
        raise ValueError(f"moe_z_loss_coef > 0 needs an MoE policy; {model.config.model_type} has no MoE layer")
    return total


@torch.no_grad()
def routing_metrics(model: CausalLM, recorded_NLK: torch.Tensor | None) -> dict[str, tuple[float, float]]:
    """name -> (value, weight) of the model's last forward: per layer `moe_load_imbalance_l{i}` (max / mean tokens
    per expert) and `moe_router_entropy_l{i}` (nats, mean over tokens), their means over layers, and with the
    engine's routing `moe_routing_flip_frac` (over the (row, layer) pairs it records)."""
    out: dict[str, tuple[float, float]] = {}
    flips = pairs = 0
    layers = model.moe_layers()
    for index, moe in layers.items():
        assert moe.last_routing is not None
        routing = moe.last_routing
        num_tokens, num_experts = routing.scores.shape
        counts = torch.bincount(routing.expert_ids.reshape(-1), minlength=num_experts).to(torch.float64)
        imbalance = float(counts.max() / counts.mean()) if num_tokens else 1.0
        probs = balance_probs(model.config.router, routing.scores)
        entropy = float(-(probs * probs.clamp_min(1e-30).log()).sum(-1).mean()) if num_tokens else 0.0
        out[f"moe_load_imbalance_l{index}"] = (imbalance, float(num_tokens))
        out[f"moe_router_entropy_l{index}"] = (entropy, float(num_tokens))
        if recorded_NLK is not None:
            recorded = recorded_NLK[:, index].to(routing.router_ids.device)
            valid = (recorded >= 0).all(dim=-1)
            mine = torch.sort(routing.router_ids[valid], dim=-1).values
            theirs = torch.sort(recorded[valid].to(mine.dtype), dim=-1).values
            flips += int((mine != theirs).any(dim=-1).sum())
            pairs += int(valid.sum())
    if layers:
        rows = out[f"moe_load_imbalance_l{next(iter(layers))}"][1]
        for name in ("moe_load_imbalance", "moe_router_entropy"):
            values = [out[f"{name}_l{i}"][0] for i in layers]
            out[name] = (sum(values) / len(values), rows)
    if pairs:
        out["moe_routing_flip_frac"] = (flips / pairs, float(pairs))
    return out
