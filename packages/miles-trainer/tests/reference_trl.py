"""TRL's GRPO / RLOO formulas re-typed as small pure-torch functions: the group advantages, the vLLM
importance-sampling ratio, the k3 per-token KL and the clipped loss aggregated per loss_type.

No TRL import at test time: each function cites the package, version, file and function it is transcribed from;
test-only changes to a transcription (one process, no gradient accumulation) are marked "test-only". The
test_reference_*.py files compare miles_trainer against them.

References:
- TRL 1.16.0: trl/trainer/grpo_trainer.py (GRPOTrainer._generate_and_score_completions: scale_rewards and the vLLM
  importance-sampling ratio; GRPOTrainer._compute_loss: loss_type grpo / bnpo / dr_grpo / dapo, token and sequence
  importance_sampling_level, the k3 per_token_kl), trl/trainer/rloo_trainer.py
  (RLOOTrainer._generate_and_score_completions), trl/trainer/utils.py (nanstd). TRL 1.16 has no PPOTrainer, so the
  value loss and GAE are compared with verl's (which verl copied from TRL's former ppo_trainer.py).
"""

from __future__ import annotations

import math
from typing import Any

import torch


# trl 1.16.0, trl/trainer/utils.py, nanstd
def trl_nanstd(tensor: torch.Tensor, dim: Any = None, keepdim: bool = False) -> torch.Tensor:
    mean = torch.nanmean(tensor, dim=dim, keepdim=True)
    variance = torch.nanmean((tensor - mean) ** 2, dim=dim, keepdim=True)
    count = torch.sum(~torch.isnan(tensor), dim=dim, keepdim=True)
    correction = count / (count - 1)
    correction = torch.where(count > 1, correction, torch.full_like(correction, float("nan")))
    variance *= correction
    std = torch.sqrt(variance)
    if keepdim:
        return std
    return std.squeeze(dim) if dim is not None else std.squeeze()


# trl 1.16.0, trl/trainer/grpo_trainer.py, GRPOTrainer._generate_and_score_completions
# (multi_objective_aggregation="sum_then_normalize", one reward function of weight 1, every reward scorable)
def trl_grpo_advantages(rewards: torch.Tensor, num_generations: int, scale_rewards: str) -> torch.Tensor:
    mean_grouped_rewards = torch.nanmean(rewards.view(-1, num_generations), dim=1)
    mean_grouped_rewards = mean_grouped_rewards.repeat_interleave(num_generations, dim=0)
    if scale_rewards in ["group", "none"]:
        if num_generations > 1:
            std_rewards = trl_nanstd(rewards.view(-1, num_generations), dim=1)
            std_rewards = std_rewards.repeat_interleave(num_generations, dim=0)
        else:
            std_rewards = torch.zeros_like(rewards)
    elif scale_rewards == "batch":
        std_rewards = trl_nanstd(rewards).expand_as(rewards) if rewards.numel() > 1 else torch.zeros_like(rewards)
    else:
        raise ValueError(scale_rewards)
    advantages = rewards - mean_grouped_rewards
    if scale_rewards != "none":
        advantages = advantages / (std_rewards + 1e-4)
    return advantages


# trl 1.16.0, trl/trainer/rloo_trainer.py, RLOOTrainer._generate_and_score_completions (normalize_advantages=False,
# every reward scorable)
def trl_rloo_advantages(rewards: torch.Tensor, num_generations: int) -> torch.Tensor:
    grouped_rewards = rewards.view(-1, num_generations)
    scorable_counts = (~torch.isnan(grouped_rewards)).sum(dim=1, keepdim=True)
    grouped_sum = torch.nansum(grouped_rewards, dim=1, keepdim=True)
    if num_generations > 1:
        baselines = (grouped_sum - grouped_rewards) / (scorable_counts - 1)
        advantages = rewards - baselines.view(-1)
    else:
        advantages = torch.zeros_like(rewards)
    return torch.nan_to_num(advantages, nan=0.0)


# trl 1.16.0, trl/trainer/grpo_trainer.py, GRPOTrainer._generate_and_score_completions (the vLLM importance
# sampling ratio; vllm_importance_sampling_mode, _clip_min, _clip_max)
def trl_vllm_importance_sampling_ratio(
    old_per_token_logps: torch.Tensor,
    sampling_per_token_logps: torch.Tensor,
    mask: torch.Tensor,
    mode: str,
    clip_min: float | None,
    clip_max: float | None,
) -> torch.Tensor:
    per_token_logps_diff = (old_per_token_logps - sampling_per_token_logps) * mask
    per_token_logps_diff = torch.nan_to_num(per_token_logps_diff, nan=0.0)
    sequence_level_is = mode in ["sequence_mask", "sequence_truncate"]
    logps_diff = per_token_logps_diff.sum(dim=-1, keepdim=True) if sequence_level_is else per_token_logps_diff
    ratio = torch.exp(logps_diff)
    if mode in ["sequence_truncate", "token_truncate"]:
        ratio = torch.clamp(ratio, min=clip_min, max=clip_max)
    else:
        min_val = clip_min if clip_min is not None else -math.inf
        max_val = clip_max if clip_max is not None else math.inf
        invalid_mis_mask = (ratio < min_val) | (ratio > max_val)
        ratio = ratio.masked_fill(invalid_mis_mask, value=0.0)
    return ratio


# trl 1.16.0, trl/trainer/grpo_trainer.py, GRPOTrainer._compute_loss (per_token_kl, k3)
def trl_per_token_kl(per_token_logps: torch.Tensor, ref_per_token_logps: torch.Tensor) -> torch.Tensor:
    return torch.exp(ref_per_token_logps - per_token_logps) - (ref_per_token_logps - per_token_logps) - 1


# trl 1.16.0, trl/trainer/grpo_trainer.py, GRPOTrainer._compute_loss (loss_type in grpo / bnpo / dr_grpo / dapo;
# test-only: one process, no gradient accumulation (the normalizer is 1 and dapo's is num_items_in_batch), no
# entropy mask, no off-policy mask, delta=None)
def trl_grpo_compute_loss(
    per_token_logps: torch.Tensor,
    old_per_token_logps: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    loss_type: str,
    epsilon_low: float,
    epsilon_high: float,
    importance_sampling_level: str = "token",
    importance_sampling_ratio: torch.Tensor | None = None,
    beta: float = 0.0,
    ref_per_token_logps: torch.Tensor | None = None,
    use_bias_correction_kl: bool = False,
    max_completion_length: int | None = None,
    num_items_in_batch: Any = None,
) -> torch.Tensor:
    mask = mask.to(per_token_logps.dtype)
    if advantages.dim() == 1:
        advantages = advantages.unsqueeze(1)
    log_ratio = per_token_logps - old_per_token_logps
    if importance_sampling_level == "token":
        log_importance_weights = log_ratio
    else:
        log_importance_weights = (log_ratio * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)
        log_importance_weights = log_importance_weights.unsqueeze(-1)
    coef_1 = torch.exp(log_importance_weights)
    per_token_kl = None
    if beta != 0.0:
        assert ref_per_token_logps is not None
        per_token_kl = trl_per_token_kl(per_token_logps, ref_per_token_logps)
        if use_bias_correction_kl:
            per_token_kl = per_token_kl * coef_1
    coef_2 = torch.clamp(coef_1, 1 - epsilon_low, 1 + epsilon_high)
    per_token_loss1 = coef_1 * advantages
    per_token_loss2 = coef_2 * advantages
    per_token_loss = -torch.min(per_token_loss1, per_token_loss2)
    if importance_sampling_ratio is not None:
        per_token_loss = per_token_loss * importance_sampling_ratio
    if per_token_kl is not None:
        per_token_loss = per_token_loss + beta * per_token_kl
    return trl_aggregate_loss(per_token_loss, mask, loss_type, max_completion_length, num_items_in_batch)


# trl 1.16.0, trl/trainer/grpo_trainer.py, GRPOTrainer._compute_loss (the aggregation of per_token_loss by
# loss_type; one process, no gradient accumulation: the normalizer is 1 and dapo's is num_items_in_batch)
def trl_aggregate_loss(
    per_token_loss: torch.Tensor,
    mask: torch.Tensor,
    loss_type: str,
    max_completion_length: int | None = None,
    num_items_in_batch: Any = None,
) -> torch.Tensor:
    mask = mask.to(per_token_loss.dtype)
    if loss_type == "grpo":
        return ((per_token_loss * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).mean()
    if loss_type == "bnpo":
        return (per_token_loss * mask).sum() / mask.sum().clamp(min=1.0)
    if loss_type == "dr_grpo":
        return (per_token_loss * mask).sum() / (per_token_loss.size(0) * max_completion_length)
    if loss_type == "dapo":
        return (per_token_loss * mask).sum() / torch.as_tensor(num_items_in_batch).clamp(min=1.0)
    raise ValueError(loss_type)
