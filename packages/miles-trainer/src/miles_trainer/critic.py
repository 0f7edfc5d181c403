"""PPO's critic: a value model and the gradient pass of its clipped value loss (docs/architecture.md, "PPO with a
critic"). The FSDP2 backend builds, shards, optimizes, offloads and checkpoints it (`FSDP2Backend(critic=...)`).

The value of response token t is V(s_t), read from the hidden state of the packed row that predicts token t (the
row whose logits give its log-prob; verl's `values[:, -response_length - 1:-1]`), through a linear value head:

    V(s_t) = w . h_t + b,    h_t the final-norm hidden state,  w = 0, b = 0 at the start (the first values are 0)

`CriticConfig.kind` chooses what h comes from:
- "separate": the critic's own copy of the policy's checkpoint (verl, OpenRLHF and TRL's PPO default), trained
  by the value loss alone with its own optimizer.
- "value_head": the policy's own hidden states; the head has its own optimizer and the value loss, weighted by
  `vf_coef`, joins the policy loss in one backward pass, so it trains the shared trunk too (one model in memory).

Values, returns and the loss are float32. Shapes: K response tokens of a micro-batch, H hidden size.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from miles_contracts import Sample
from miles_kernels import CausalLM, KernelConfig
from miles_trainer.config import CriticConfig
from miles_trainer.losses import Count, aggregate_loss, check_same_shape, masked_mean
from miles_trainer.packing import MicroBatch, pack_samples, padded_lists, padded_passes, rows_to_padded

__all__ = [
    "JointValueLoss",
    "ValueHead",
    "ValueModel",
    "accumulate_value_gradients",
    "critic_values",
    "explained_variance",
    "value_loss",
]


class ValueHead(nn.Module):
    """A linear map of hidden states to scalar values, float32, zero at the start."""

    def __init__(self, hidden_size: int, device: torch.device | str) -> None:
        super().__init__()
        self.score = nn.Linear(hidden_size, 1, device=device, dtype=torch.float32)
        nn.init.zeros_(self.score.weight)
        nn.init.zeros_(self.score.bias)

    def forward(self, hidden_KH: torch.Tensor) -> torch.Tensor:
        values: torch.Tensor = self.score(hidden_KH.float()).squeeze(-1)
        return values


class ValueModel(nn.Module):
    """The "separate" critic: a `CausalLM` backbone (its lm_head unused) and a `ValueHead`."""

    def __init__(self, backbone: CausalLM) -> None:
        super().__init__()
        self.backbone = backbone
        self.value_head = ValueHead(backbone.config.hidden_size, next(backbone.parameters()).device)

    def forward(self, micro: MicroBatch) -> torch.Tensor:
        """The value of each response token of the micro-batch (K,)."""
        device = next(self.value_head.parameters()).device
        hidden = self.backbone.forward_hidden(micro.input_ids_N.to(device), micro.batch)
        values: torch.Tensor = self.value_head(hidden[micro.score_rows_K.to(device)])
        return values


def value_loss(
    values_BT: torch.Tensor,
    old_values_BT: torch.Tensor,
    returns_BT: torch.Tensor,
    mask_BT: torch.Tensor,
    *,
    clip: float | None = 0.5,
    agg_mode: str = "token-mean",
    global_num_tokens: Count | None = None,
    global_num_seqs: Count | None = None,
    max_response_len: int | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PPO's clipped value loss (verl 0.9.1 `core_algos.compute_value_loss`, itself TRL's PPO value loss):

        V_clip = clamp(V, V_old - clip, V_old + clip)
        loss_t = max((V - R)^2, (V_clip - R)^2)
        loss   = 0.5 * aggregate_loss(loss_t, mask, agg_mode)

    V = values (with grad), V_old = the values the critic gave when the batch was made, R = the returns (GAE's
    targets). clip=None: the plain squared error. Metrics: vf_clip_fraction (share of valid tokens where the
    clipped branch is the larger, verl's vf_clipfrac) and value_mean (mean of V).
    """
    check_same_shape(values_BT=values_BT, old_values_BT=old_values_BT, returns_BT=returns_BT, mask_BT=mask_BT)
    if clip is not None and clip <= 0:
        raise ValueError(f"clip (the value clip range) must be > 0 or None, got {clip}")
    is_valid = mask_BT.bool()
    zeros = torch.zeros_like(values_BT)
    returns = torch.where(is_valid, returns_BT.detach(), zeros)
    old = torch.where(is_valid, old_values_BT.detach(), zeros)
    unclipped_BT = (values_BT - returns).square()
    loss_BT = unclipped_BT
    clipped_BT = unclipped_BT
    if clip is not None:
        clipped_BT = (torch.maximum(torch.minimum(values_BT, old + clip), old - clip) - returns).square()
        loss_BT = torch.maximum(unclipped_BT, clipped_BT)
    loss = 0.5 * aggregate_loss(
        loss_BT,
        mask_BT,
        agg_mode,
        global_num_tokens=global_num_tokens,
        global_num_seqs=global_num_seqs,
        max_response_len=max_response_len,
    )
    with torch.no_grad():
        metrics = {
            "vf_clip_fraction": masked_mean((clipped_BT > unclipped_BT).float(), is_valid),
            "value_mean": masked_mean(values_BT.detach().float(), is_valid),
        }
    return loss, metrics


def explained_variance(values_N: torch.Tensor, returns_N: torch.Tensor) -> float:
    """1 - Var(R - V) / (Var(R) + 1e-5) over the valid tokens given (flattened; unbiased variances): 1 is a perfect
    critic, 0 no better than a constant, negative worse (verl 0.9.1 `metric_utils.compute_data_metrics`,
    critic/vf_explained_var). nan for fewer than 2 values."""
    values, returns = values_N.double().flatten(), returns_N.double().flatten()
    if returns.numel() < 2:
        return float("nan")
    return float(1.0 - (returns - values).var() / (returns.var() + 1e-5))


@dataclass(frozen=True)
class JointValueLoss:
    """The "value_head" critic's part of a policy pass: the head, the value targets and the loss settings."""

    head: ValueHead
    returns: Sequence[Sequence[float]]
    old_values: Sequence[Sequence[float]]
    config: CriticConfig


@torch.no_grad()
def critic_values(
    model: Callable[[MicroBatch], torch.Tensor],
    samples: Sequence[Sample],
    kernel: KernelConfig,
    max_tokens: int,
    num_passes: int = 0,
) -> list[list[float]]:
    """V(s_t) of every response token of every sample (masked tokens included), from `model` (a `ValueModel`, or
    any micro-batch -> (K,) values function). `num_passes`: run at least this many forward passes (repeating the
    last micro-batch), as sharded models need on every rank."""
    micro_batches = pack_samples(samples, kernel, max_tokens)
    out: list[list[float]] = [[] for _ in samples]
    for micro, weight in padded_passes(micro_batches, num_passes):
        values = micro.per_sample(model(micro))
        if weight:
            for i, row in zip(micro.sample_indices, values, strict=True):
                out[i] = row.tolist()
    return out


def value_loss_part(
    values_K: torch.Tensor,
    micro: MicroBatch,
    returns: Sequence[Sequence[float]],
    old_values: Sequence[Sequence[float]],
    config: CriticConfig,
    counts: dict[str, int | None],
) -> tuple[torch.Tensor, dict[str, torch.Tensor], torch.Tensor]:
    """The clipped value loss of one micro-batch's values (K,), and its metrics and mask."""
    values_BT, mask_BT = rows_to_padded(values_K, micro)
    device = values_BT.device
    rows = micro.sample_indices
    loss, metrics = value_loss(
        values_BT, padded_lists([old_values[i] for i in rows], device),
        padded_lists([returns[i] for i in rows], device), mask_BT,
        clip=config.value_clip, agg_mode=config.agg_mode, **counts,  # type: ignore[arg-type]
    )  # fmt: skip
    return loss, metrics, mask_BT


def accumulate_value_gradients(
    model: ValueModel,
    samples: Sequence[Sample],
    returns: Sequence[Sequence[float]],
    old_values: Sequence[Sequence[float]],
    kernel: KernelConfig,
    config: CriticConfig,
    max_tokens: int,
    *,
    global_num_tokens: int,
    global_num_seqs: int,
    max_response_len: int | None = None,
    loss_scale: float = 1.0,
    num_micro_batches: int | None = None,
) -> dict[str, float]:
    """Forward + backward of the "separate" critic's value loss over all micro-batches (normalized by the global
    batch's counts, like the policy loss); returns this rank's {vf_loss, vf_clip_fraction, value_mean, num_tokens}
    (vf_loss a sum over micro-batches, the others token-weighted sums to divide by num_tokens)."""
    _check_rows("returns", samples, returns)
    _check_rows("old_values", samples, old_values)
    counts: dict[str, int | None] = {"global_num_tokens": global_num_tokens, "global_num_seqs": global_num_seqs,
                                     "max_response_len": max_response_len}  # fmt: skip
    micro_batches = pack_samples(samples, kernel, max_tokens)
    stats = {"vf_loss": 0.0, "vf_clip_fraction": 0.0, "value_mean": 0.0, "num_tokens": 0.0}
    for micro, weight in padded_passes(micro_batches, num_micro_batches):
        loss, metrics, mask_BT = value_loss_part(model(micro), micro, returns, old_values, config, counts)
        (loss * loss_scale * weight).backward()  # type: ignore[no-untyped-call]
        if weight:
            num_valid = float(mask_BT.sum())
            stats["vf_loss"] += float(loss.detach())
            stats["num_tokens"] += num_valid
            for name in ("vf_clip_fraction", "value_mean"):
                stats[name] += float(metrics[name]) * num_valid
    return stats


def _check_rows(name: str, samples: Sequence[Sample], rows: Sequence[Sequence[float]]) -> None:
    if len(rows) != len(samples) or any(len(r) != len(s.response_tokens) for s, r in zip(samples, rows, strict=True)):
        raise ValueError(f"{name} needs one list per sample with one value per response token")
