"""miles_trainer's advantages and losses against the reference implementations they follow, verl and TRL.

The reference formulas are re-typed below as small pure-torch functions (no verl / TRL import at test time), each
citing the package, version, file and function it is transcribed from; test-only changes to a transcription (a
bound made a parameter, a config object replaced by arguments) are marked "test-only". Every advantage estimator,
aggregation mode, policy-loss variant (PPO clip, clip-higher, dual-clip, GSPO, IS weights), KL estimator,
importance-sampling mode (TIS / MIS / IcePop, token and sequence level, batch normalization), the clipped value
loss, explained variance and entropy are compared on random float64 inputs with ragged masks (rows of different
lengths, a row with a hole in its mask, an all-masked row) and extreme values (log-ratios of ±30, log-probs of -50
and -1e-9, rewards of ±1e6, advantages of both signs). Where Miles deliberately departs from a reference (its
docstrings say so), the agreement is tested where the two agree and the documented difference is asserted on an
input where they differ.

References:
- verl 0.9.1: verl/trainer/ppo/core_algos.py (agg_loss, compute_policy_loss_vanilla, compute_policy_loss_gspo,
  compute_value_loss, kl_penalty, kl_penalty_forward, compute_grpo_outcome_advantage,
  compute_rloo_outcome_advantage, compute_reinforce_plus_plus_outcome_advantage,
  compute_reinforce_plus_plus_baseline_outcome_advantage, compute_gae_advantage_return),
  verl/trainer/ppo/rollout_corr_helper.py (compute_rollout_correction_weights, _parse_rollout_is_threshold,
  compute_is_metrics), verl/trainer/ppo/metric_utils.py (compute_data_metrics: critic/vf_explained_var),
  verl/utils/torch_functional.py (masked_sum, masked_mean, masked_var, masked_whiten, clip_by_value,
  entropy_from_logits).
- verl 0.7.0: verl/trainer/ppo/core_algos.py (agg_loss "seq-mean-token-sum-norm" divided by L alone,
  compute_reinforce_plus_plus_outcome_advantage resetting the return at masked tokens).
- verl 0.6.0: verl/trainer/ppo/mismatch_helper.py (compute_rollout_importance_weights: MIS lower bound 1 / upper).
- TRL 1.16.0: trl/trainer/grpo_trainer.py (GRPOTrainer._generate_and_score_completions: scale_rewards and the vLLM
  importance-sampling ratio; GRPOTrainer._compute_loss: loss_type grpo / bnpo / dr_grpo / dapo, token and sequence
  importance_sampling_level, the k3 per_token_kl), trl/trainer/rloo_trainer.py
  (RLOOTrainer._generate_and_score_completions), trl/trainer/utils.py (nanstd). TRL 1.16 has no PPOTrainer, so the
  value loss and GAE are compared with verl's (which verl copied from TRL's former ppo_trainer.py).
"""

from __future__ import annotations

import math
import warnings
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import pytest
import torch

from miles_trainer.advantages import (
    compute_advantages,
    dr_grpo_advantages,
    estimator_kwargs,
    gae_advantages,
    grpo_advantages,
    reinforce_plus_plus_advantages,
    reinforce_plus_plus_baseline_advantages,
    rloo_advantages,
)
from miles_trainer.config import (
    ADVANTAGE_ESTIMATOR_NAMES,
    AGGREGATION_MODES,
    IS_LEVELS,
    IS_MODES,
    KL_KINDS,
    AdvantageConfig,
)
from miles_trainer.critic import explained_variance, value_loss
from miles_trainer.losses import (
    aggregate_loss,
    entropy_from_logits,
    importance_weight_sums,
    importance_weights,
    kl_estimate,
    normalize_importance_weights,
    policy_loss,
)

F64 = torch.float64

# ======================================================================================== shared inputs

# Ragged mask: full row, right-padded rows of 5, 1 and 3 tokens, a row with a hole (tool output), an all-masked row.
MASK = torch.tensor(
    [
        [1, 1, 1, 1, 1, 1, 1, 1],
        [1, 1, 1, 1, 1, 0, 0, 0],
        [1, 0, 0, 0, 0, 0, 0, 0],
        [1, 1, 0, 0, 1, 1, 1, 0],
        [0, 0, 0, 0, 0, 0, 0, 0],
        [1, 1, 1, 0, 0, 0, 0, 0],
    ],
    dtype=torch.bool,
)
N, T = MASK.shape
HOLE_ROW, EMPTY_ROW = 3, 4
# Masks whose every row is right-padded (no hole, no all-masked row): where verl <= 0.7 and Miles agree.
RIGHT_PADDED = torch.arange(T) < torch.tensor([8, 5, 1, 7, 2, 3]).unsqueeze(-1)
# Valid (row, column) positions of MASK that carry extreme log-ratios in `logprob_pair`.
EXTREME_LOG_RATIOS = {(0, 1): 30.0, (0, 2): -30.0, (1, 0): 25.0, (3, 4): -21.0, (5, 1): 19.5, (0, 6): -19.5}


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _quantize(x: torch.Tensor) -> torch.Tensor:
    """Round to a multiple of 1/64: differences and row sums of such values are exact in float32, so a float32
    computation (Miles' importance weights, entropy) differs from the float64 reference only by exp's rounding."""
    return torch.round(x * 64) / 64


def logprob_pair(seed: int, *, extreme: bool = True, garbage: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """(logp, old) float64 (N, T): log-ratios ~ N(0, 0.5) plus, with `extreme`, log-ratios of ±30, ±25, ±21, ±19.5
    between tiny (-50) and near-one (-1e-9) probabilities; with `garbage`, padding holds finite nonsense."""
    g = _gen(seed)
    old = -3.0 * torch.rand(N, T, generator=g, dtype=F64)
    logp = old + 0.5 * torch.randn(N, T, generator=g, dtype=F64)
    if extreme:
        for (i, t), log_ratio in EXTREME_LOG_RATIOS.items():
            if log_ratio > 0:  # pi_old tiny, pi near one
                old[i, t], logp[i, t] = -1e-9 - log_ratio, -1e-9
            else:  # pi_old near one, pi tiny
                old[i, t], logp[i, t] = -1e-9, -1e-9 + log_ratio
        old[2, 0], logp[2, 0] = -50.0, -49.0  # both tiny
    if garbage:
        logp = torch.where(MASK, logp, torch.full_like(logp, 7.0))
        old = torch.where(MASK, old, torch.full_like(old, -40.0))
    return logp, old


def token_advantages(seed: int) -> torch.Tensor:
    """Token advantages of both signs (N, T), a few exact zeros, large and small magnitudes."""
    adv = 2.0 * torch.randn(N, T, generator=_gen(seed), dtype=F64)
    adv[0, 3] = 0.0
    adv[1, 1] = 50.0
    adv[5, 2] = -1e-6
    return adv


def seq_advantages(seed: int) -> torch.Tensor:
    """One advantage per row, both signs (N,)."""
    adv = torch.randn(N, generator=_gen(seed), dtype=F64)
    adv[0], adv[1] = 1.5, -2.0
    return adv


def assert_close(actual: Any, expected: Any, *, rtol: float = 1e-7, atol: float = 1e-9) -> None:
    """Tight comparison; float32 Miles outputs are compared in float64 (pass a looser rtol for them)."""
    actual_t = torch.as_tensor(actual).to(F64)
    expected_t = torch.as_tensor(expected).to(F64)
    if expected_t.dim() == 0:  # a scalar expectation for every element
        expected_t = expected_t.expand_as(actual_t)
    torch.testing.assert_close(actual_t, expected_t, rtol=rtol, atol=atol, equal_nan=True)


def _grad(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(fn(x) detached, d fn(x) / dx) for a scalar fn."""
    x = x.detach().clone().requires_grad_(True)
    value = fn(x)
    (grad,) = torch.autograd.grad(value, x)
    return value.detach(), grad


# ======================================================================================== transcriptions: verl


# verl 0.9.1, verl/utils/torch_functional.py, masked_sum
def verl_masked_sum(values: torch.Tensor, mask: torch.Tensor, axis: Any = None) -> torch.Tensor:
    valid_values = torch.where(mask.bool(), values, 0.0)
    return (valid_values * mask).sum(axis=axis)


# verl 0.9.1, verl/utils/torch_functional.py, masked_mean
def verl_masked_mean(values: torch.Tensor, mask: torch.Tensor, axis: Any = None) -> torch.Tensor:
    s = verl_masked_sum(values, mask, axis)
    return s / (mask.sum(axis=axis) + 1e-8)


# verl 0.9.1, verl/utils/torch_functional.py, masked_var
def verl_masked_var(values: torch.Tensor, mask: torch.Tensor, unbiased: bool = True) -> torch.Tensor:
    mean = verl_masked_mean(values, mask)
    centered_values = values - mean
    variance = verl_masked_mean(centered_values**2, mask)
    if unbiased:
        mask_sum = mask.sum()
        bessel_correction = mask_sum / (mask_sum - 1)
        variance = variance * bessel_correction
    return variance


# verl 0.9.1, verl/utils/torch_functional.py, masked_whiten
def verl_masked_whiten(values: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True) -> torch.Tensor:
    mean, var = verl_masked_mean(values, mask), verl_masked_var(values, mask)
    whitened = (values - mean) * torch.rsqrt(var + 1e-8)
    if not shift_mean:
        whitened += mean
    return whitened


# verl 0.9.1, verl/utils/torch_functional.py, clip_by_value
def verl_clip_by_value(x: torch.Tensor, tensor_min: torch.Tensor, tensor_max: torch.Tensor) -> torch.Tensor:
    return torch.max(torch.min(x, tensor_max), tensor_min)


# verl 0.9.1, verl/utils/torch_functional.py, entropy_from_logits
def verl_entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    pd = torch.nn.functional.softmax(logits, dim=-1)
    return torch.logsumexp(logits, dim=-1) - torch.sum(pd * logits, dim=-1)


# verl 0.9.1, verl/trainer/ppo/core_algos.py, agg_loss
def verl_agg_loss(
    loss_mat: torch.Tensor,
    loss_mask: torch.Tensor,
    loss_agg_mode: str,
    dp_size: int = 1,
    batch_num_tokens: Any = None,
    global_batch_size: Any = None,
    loss_scale_factor: Any = None,
) -> torch.Tensor:
    loss_mask = loss_mask.to(loss_mat.dtype)
    if loss_agg_mode == "token-mean":
        if batch_num_tokens is None:
            batch_num_tokens = loss_mask.sum()
        loss = verl_masked_sum(loss_mat, loss_mask) / batch_num_tokens * dp_size
    elif loss_agg_mode == "token-sum":
        loss = verl_masked_sum(loss_mat, loss_mask) * dp_size
    elif loss_agg_mode in ["seq-mean-token-sum", "seq-mean-token-sum-norm"]:
        seq_losses = torch.sum(loss_mat * loss_mask, dim=-1)  # token-sum
        seq_mask = (torch.sum(loss_mask, dim=-1) > 0).float()  # exclude fully masked sequences
        if global_batch_size is None:
            global_batch_size = seq_mask.sum()
        loss = verl_masked_sum(seq_losses, seq_mask) / global_batch_size * dp_size  # seq-mean
        if loss_agg_mode == "seq-mean-token-sum-norm":
            if loss_scale_factor is None:
                loss_scale_factor = loss_mask.shape[-1]
            loss /= loss_scale_factor
    elif loss_agg_mode == "seq-mean-token-mean":
        seq_mask = torch.sum(loss_mask, dim=-1)  # per-sequence token count
        seq_losses = torch.sum(loss_mat * loss_mask, dim=-1) / (seq_mask + 1e-8)  # token-mean
        seq_mask = (seq_mask > 0).float()  # exclude fully masked sequences
        if global_batch_size is None:
            global_batch_size = seq_mask.sum()
        loss = verl_masked_sum(seq_losses, seq_mask) / global_batch_size * dp_size  # seq-mean
    else:
        raise ValueError(f"Invalid loss_agg_mode: {loss_agg_mode}")
    return loss


# verl 0.7.0, verl/trainer/ppo/core_algos.py, agg_loss (loss_agg_mode="seq-mean-token-sum-norm": sum / L alone)
def verl070_agg_loss_seq_mean_token_sum_norm(
    loss_mat: torch.Tensor, loss_mask: torch.Tensor, loss_scale_factor: Any = None
) -> torch.Tensor:
    loss_mask = loss_mask.to(loss_mat.dtype)
    seq_losses = torch.sum(loss_mat * loss_mask, dim=-1)
    if loss_scale_factor is None:
        loss_scale_factor = loss_mask.shape[-1]
    return torch.sum(seq_losses) / loss_scale_factor


def reference_agg(loss_mat: torch.Tensor, loss_mask: torch.Tensor, mode: str, **global_info: Any) -> torch.Tensor:
    """Miles' mode -> the verl agg_loss that defines it: token-sum-norm is verl 0.7.0's seq-mean-token-sum-norm,
    every other mode verl 0.9.1's of the same name."""
    if mode == "token-sum-norm":
        return verl070_agg_loss_seq_mean_token_sum_norm(loss_mat, loss_mask, global_info.get("loss_scale_factor"))
    return verl_agg_loss(loss_mat, loss_mask, mode, **global_info)


# verl 0.9.1, verl/trainer/ppo/core_algos.py, compute_policy_loss_vanilla (the per-token part and its metrics; the
# agg_loss call is `reference_agg`; test-only: config.clip_ratio_low / _high / clip_ratio_c are arguments)
def verl_policy_loss_vanilla_per_token(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    cliprange_low: float,
    cliprange_high: float,
    clip_ratio_c: float,
    rollout_is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    negative_approx_kl = log_prob - old_log_prob
    negative_approx_kl = torch.clamp(negative_approx_kl, min=-20.0, max=20.0)
    ratio = torch.exp(negative_approx_kl)
    ppo_kl = verl_masked_mean(-negative_approx_kl, response_mask)
    pg_losses1 = -advantages * ratio
    pg_losses2 = -advantages * torch.clamp(ratio, 1 - cliprange_low, 1 + cliprange_high)
    clip_pg_losses1 = torch.maximum(pg_losses1, pg_losses2)
    pg_clipfrac = verl_masked_mean(torch.gt(pg_losses2, pg_losses1).float(), response_mask)
    pg_losses3 = -advantages * clip_ratio_c
    clip_pg_losses2 = torch.min(pg_losses3, clip_pg_losses1)
    pg_clipfrac_lower = verl_masked_mean(
        torch.gt(clip_pg_losses1, pg_losses3) * (advantages < 0).float(), response_mask
    )
    pg_losses = torch.where(advantages < 0, clip_pg_losses2, clip_pg_losses1)
    if rollout_is_weights is not None:
        pg_losses = pg_losses * rollout_is_weights
    metrics = {"pg_clipfrac": pg_clipfrac, "ppo_kl": ppo_kl, "pg_clipfrac_lower": pg_clipfrac_lower}
    return pg_losses, metrics


# verl 0.9.1, verl/trainer/ppo/core_algos.py, compute_policy_loss_gspo (per-token part and metrics, as above)
def verl_policy_loss_gspo_per_token(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    clip_ratio_low: float,
    clip_ratio_high: float,
    rollout_is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    response_mask = response_mask.to(log_prob.dtype)
    negative_approx_kl = log_prob - old_log_prob
    seq_lengths = torch.sum(response_mask, dim=-1).clamp(min=1)
    negative_approx_kl_seq = torch.sum(negative_approx_kl * response_mask, dim=-1) / seq_lengths
    log_seq_importance_ratio = log_prob - log_prob.detach() + negative_approx_kl_seq.detach().unsqueeze(-1)
    log_seq_importance_ratio = torch.clamp(log_seq_importance_ratio, max=10.0)
    seq_importance_ratio = torch.exp(log_seq_importance_ratio)
    pg_losses1 = -advantages * seq_importance_ratio
    pg_losses2 = -advantages * torch.clamp(seq_importance_ratio, 1 - clip_ratio_low, 1 + clip_ratio_high)
    pg_losses = torch.maximum(pg_losses1, pg_losses2)
    if rollout_is_weights is not None:
        pg_losses = pg_losses * rollout_is_weights
    pg_clipfrac = verl_masked_mean(torch.gt(pg_losses2, pg_losses1).float(), response_mask)
    ppo_kl = verl_masked_mean(-negative_approx_kl, response_mask)
    return pg_losses, {"pg_clipfrac": pg_clipfrac, "ppo_kl": ppo_kl}


# verl 0.9.1, verl/trainer/ppo/core_algos.py, compute_value_loss (test-only: its agg_loss call is `reference_agg`,
# so that token-sum-norm is verl 0.7.0's)
def verl_compute_value_loss(
    vpreds: torch.Tensor,
    returns: torch.Tensor,
    values: torch.Tensor,
    response_mask: torch.Tensor,
    cliprange_value: float,
    loss_agg_mode: str = "token-mean",
    **global_info: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    vpredclipped = verl_clip_by_value(vpreds, values - cliprange_value, values + cliprange_value)
    vf_losses1 = (vpreds - returns) ** 2
    vf_losses2 = (vpredclipped - returns) ** 2
    clipped_vf_losses = torch.max(vf_losses1, vf_losses2)
    vf_loss = 0.5 * reference_agg(clipped_vf_losses, response_mask, loss_agg_mode, **global_info)
    vf_clipfrac = verl_masked_mean(torch.gt(vf_losses2, vf_losses1).float(), response_mask)
    return vf_loss, vf_clipfrac


# verl 0.9.1, verl/trainer/ppo/core_algos.py, kl_penalty_forward
def verl_kl_penalty_forward(logprob: torch.Tensor, ref_logprob: torch.Tensor, kl_penalty: str) -> torch.Tensor:
    if kl_penalty in ("kl", "k1"):
        return logprob - ref_logprob
    if kl_penalty == "abs":
        return (logprob - ref_logprob).abs()
    if kl_penalty in ("mse", "k2"):
        return 0.5 * (logprob - ref_logprob).square()
    if kl_penalty in ("low_var_kl", "k3"):
        kl = ref_logprob - logprob
        kl = torch.clamp(kl, min=-20, max=20)
        ratio = torch.exp(kl)
        kld = (ratio - kl - 1).contiguous()
        return torch.clamp(kld, min=-10, max=10)
    raise NotImplementedError


# verl 0.9.1, verl/trainer/ppo/core_algos.py, kl_penalty
def verl_kl_penalty(logprob: torch.Tensor, ref_logprob: torch.Tensor, kl_penalty: str) -> torch.Tensor:
    base_kl_penalty = kl_penalty[:-1] if kl_penalty.endswith("+") else kl_penalty
    forward_score = verl_kl_penalty_forward(logprob, ref_logprob, base_kl_penalty)
    if not kl_penalty.endswith("+") or kl_penalty in ("mse", "k2"):
        return forward_score
    backward_score = 0.5 * (logprob - ref_logprob).square()
    return backward_score - backward_score.detach() + forward_score.detach()


# verl 0.9.1, verl/trainer/ppo/core_algos.py, compute_grpo_outcome_advantage
def verl_grpo_outcome_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: list[int],
    epsilon: float = 1e-6,
    norm_adv_by_std_in_grpo: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    scores = token_level_rewards.sum(dim=-1)
    id2score: dict[int, list[torch.Tensor]] = defaultdict(list)
    id2mean, id2std = {}, {}
    with torch.no_grad():
        bsz = scores.shape[0]
        for i in range(bsz):
            id2score[index[i]].append(scores[i])
        for idx in id2score:
            if len(id2score[idx]) == 1:
                id2mean[idx] = torch.tensor(0.0)
                id2std[idx] = torch.tensor(1.0)
            else:
                scores_tensor = torch.stack(id2score[idx])
                id2mean[idx] = torch.mean(scores_tensor)
                id2std[idx] = torch.std(scores_tensor)
        for i in range(bsz):
            if norm_adv_by_std_in_grpo:
                scores[i] = (scores[i] - id2mean[index[i]]) / (id2std[index[i]] + epsilon)
            else:
                scores[i] = scores[i] - id2mean[index[i]]
        scores = scores.unsqueeze(-1) * response_mask
    return scores, scores


# verl 0.9.1, verl/trainer/ppo/core_algos.py, compute_rloo_outcome_advantage
def verl_rloo_outcome_advantage(
    token_level_rewards: torch.Tensor, response_mask: torch.Tensor, index: list[int]
) -> tuple[torch.Tensor, torch.Tensor]:
    scores = token_level_rewards.sum(dim=-1)
    id2score: dict[int, list[torch.Tensor]] = defaultdict(list)
    id2mean = {}
    with torch.no_grad():
        bsz = scores.shape[0]
        for i in range(bsz):
            id2score[index[i]].append(scores[i])
        for idx in id2score:
            if len(id2score[idx]) == 1:
                id2mean[idx] = torch.tensor(0.0)
            else:
                id2mean[idx] = torch.mean(torch.stack(id2score[idx]))
        for i in range(bsz):
            response_num = len(id2score[index[i]])
            if response_num > 1:
                scores[i] = scores[i] * response_num / (response_num - 1) - id2mean[index[i]] * response_num / (
                    response_num - 1
                )
        scores = scores.unsqueeze(-1) * response_mask
    return scores, scores


# verl 0.9.1, verl/trainer/ppo/core_algos.py, compute_reinforce_plus_plus_baseline_outcome_advantage
def verl_rpp_baseline_outcome_advantage(
    token_level_rewards: torch.Tensor, response_mask: torch.Tensor, index: list[int]
) -> tuple[torch.Tensor, torch.Tensor]:
    response_length = token_level_rewards.shape[-1]
    scores = token_level_rewards.sum(dim=-1)
    id2score: dict[int, list[torch.Tensor]] = defaultdict(list)
    id2mean = {}
    with torch.no_grad():
        bsz = scores.shape[0]
        for i in range(bsz):
            id2score[index[i]].append(scores[i])
        for idx in id2score:
            if len(id2score[idx]) == 1:
                id2mean[idx] = torch.tensor(0.0)
            else:
                id2mean[idx] = torch.mean(torch.stack(id2score[idx]))
        for i in range(bsz):
            scores[i] = scores[i] - id2mean[index[i]]
        scores = scores.unsqueeze(-1).tile([1, response_length]) * response_mask
        scores = verl_masked_whiten(scores, response_mask) * response_mask
    return scores, scores


# verl 0.9.1, verl/trainer/ppo/core_algos.py, compute_reinforce_plus_plus_outcome_advantage (test-only: gamma is an
# argument instead of config.gamma)
def verl_rpp_outcome_advantage(
    token_level_rewards: torch.Tensor, response_mask: torch.Tensor, gamma: float
) -> tuple[torch.Tensor, torch.Tensor]:
    with torch.no_grad():
        returns = torch.zeros_like(token_level_rewards)
        running_return: Any = 0
        for t in reversed(range(token_level_rewards.shape[1])):
            new_running_return = token_level_rewards[:, t] + gamma * running_return
            returns[:, t] = new_running_return * response_mask[:, t]
            running_return = new_running_return * response_mask[:, t] + running_return * (1 - response_mask[:, t])
        advantages = verl_masked_whiten(returns, response_mask)
        advantages = advantages * response_mask
    return advantages, returns


# verl 0.7.0, verl/trainer/ppo/core_algos.py, compute_reinforce_plus_plus_outcome_advantage (resets at masked tokens)
def verl070_rpp_outcome_advantage(
    token_level_rewards: torch.Tensor, response_mask: torch.Tensor, gamma: float
) -> tuple[torch.Tensor, torch.Tensor]:
    with torch.no_grad():
        returns = torch.zeros_like(token_level_rewards)
        running_return: Any = 0
        for t in reversed(range(token_level_rewards.shape[1])):
            running_return = token_level_rewards[:, t] + gamma * running_return
            returns[:, t] = running_return
            running_return = running_return * response_mask[:, t]  # Reset after EOS
        advantages = verl_masked_whiten(returns, response_mask)
        advantages = advantages * response_mask
    return advantages, returns


# verl 0.9.1, verl/trainer/ppo/core_algos.py, compute_gae_advantage_return (test-only: `whiten=False` skips the final
# masked_whiten, to compare Miles' whiten=False)
def verl_gae_advantage_return(
    token_level_rewards: torch.Tensor,
    values: torch.Tensor,
    response_mask: torch.Tensor,
    gamma: float,
    lam: float,
    whiten: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    with torch.no_grad():
        nextvalues: Any = 0
        lastgaelam: Any = 0
        advantages_reversed = []
        gen_len = token_level_rewards.shape[-1]
        for t in reversed(range(gen_len)):
            delta = token_level_rewards[:, t] + gamma * nextvalues - values[:, t]
            lastgaelam_ = delta + gamma * lam * lastgaelam
            nextvalues = values[:, t] * response_mask[:, t] + (1 - response_mask[:, t]) * nextvalues
            lastgaelam = lastgaelam_ * response_mask[:, t] + (1 - response_mask[:, t]) * lastgaelam
            advantages_reversed.append(lastgaelam)
        advantages = torch.stack(advantages_reversed[::-1], dim=1)
        returns = advantages + values
        if whiten:
            advantages = verl_masked_whiten(advantages, response_mask)
    return advantages, returns


# verl 0.9.1, verl/trainer/ppo/rollout_corr_helper.py, _parse_rollout_is_threshold (validation dropped)
def verl_parse_rollout_is_threshold(threshold_spec: str | float) -> tuple[float, float | None]:
    if isinstance(threshold_spec, int | float):
        return float(threshold_spec), None
    if "_" in threshold_spec:
        lower_str, upper_str = threshold_spec.split("_", 1)
        return float(upper_str), float(lower_str)
    return float(threshold_spec), None


VERL_SAFETY_BOUND = 20.0  # verl 0.9.1, verl/trainer/ppo/rollout_corr_helper.py, SAFETY_BOUND


# verl 0.9.1, verl/trainer/ppo/rollout_corr_helper.py, compute_rollout_correction_weights (the weights, batch
# normalization and, from compute_is_metrics, the token-level mean / fraction_high / fraction_low; no
# torch.distributed)
def verl_compute_rollout_correction_weights(
    log_ratio: torch.Tensor,
    response_mask: torch.Tensor,
    rollout_is: str = "token",
    rollout_is_threshold: str | float = 2.0,
    rollout_is_batch_normalize: bool = False,
) -> tuple[torch.Tensor, dict[str, float]]:
    upper, lower = verl_parse_rollout_is_threshold(rollout_is_threshold)
    use_icepop = lower is not None
    if rollout_is == "token":
        raw = torch.exp(torch.clamp(log_ratio, min=-VERL_SAFETY_BOUND, max=VERL_SAFETY_BOUND))
    else:
        log_ratio_sum = verl_masked_sum(log_ratio, response_mask, axis=-1).unsqueeze(-1)
        raw = torch.exp(torch.clamp(log_ratio_sum, min=-VERL_SAFETY_BOUND, max=VERL_SAFETY_BOUND)).expand_as(log_ratio)
    raw = raw * response_mask
    if not use_icepop:
        weights = raw.clamp(max=upper)
    else:
        assert lower is not None
        token_kept_mask = (raw >= lower) & (raw <= upper)
        weights = torch.where(token_kept_mask, raw, torch.zeros_like(raw))
    # compute_is_metrics (token-level branch; the mean is the same at sequence level)
    metric_lower = 1.0 / upper if lower is None else lower
    metrics = {"rollout_is_mean": verl_masked_mean(weights, response_mask).item()}
    if rollout_is == "token":
        metrics["rollout_is_ratio_fraction_high"] = verl_masked_mean((raw > upper).float(), response_mask).item()
        metrics["rollout_is_ratio_fraction_low"] = verl_masked_mean((raw < metric_lower).float(), response_mask).item()
    weights = weights.detach()
    if rollout_is_batch_normalize:
        if rollout_is == "token":
            weights_mean = verl_masked_mean(weights, response_mask)
        else:
            seq_weights = verl_masked_mean(weights, response_mask, axis=-1)
            seq_mask = (response_mask.sum(dim=-1) > 0).to(dtype=weights.dtype)
            weights_mean = (seq_weights * seq_mask).sum() / seq_mask.sum().clamp_min(1e-8)
        if weights_mean > 1e-8:
            weights = weights / weights_mean
    return weights, metrics


# verl 0.6.0, verl/trainer/ppo/mismatch_helper.py, compute_rollout_importance_weights (the weights only; the
# "geometric" level and the veto are left out: Miles has neither, i.e. rollout_is_veto_threshold=None)
def verl060_compute_rollout_importance_weights(
    old_log_prob: torch.Tensor,
    rollout_log_prob: torch.Tensor,
    response_mask: torch.Tensor,
    rollout_is_level: str = "token",
    rollout_is_mode: str = "truncate",
    rollout_is_threshold: float = 2.0,
    rollout_is_threshold_lower: float | None = None,
) -> torch.Tensor:
    upper_threshold = rollout_is_threshold
    lower_threshold = rollout_is_threshold_lower if rollout_is_threshold_lower is not None else 1.0 / upper_threshold
    log_ratio = old_log_prob - rollout_log_prob
    safety_bound = 20.0
    if rollout_is_level == "token":
        rollout_is_weights = torch.exp(torch.clamp(log_ratio, min=-safety_bound, max=safety_bound))
    else:
        log_ratio_sum = verl_masked_sum(log_ratio, response_mask, axis=-1).unsqueeze(-1)
        log_ratio_sum_safe = torch.clamp(log_ratio_sum, min=-safety_bound, max=safety_bound)
        rollout_is_weights = torch.exp(log_ratio_sum_safe).expand_as(old_log_prob)
    if rollout_is_mode == "truncate":
        rollout_is_weights = rollout_is_weights.clamp(max=upper_threshold)
    else:
        mask = (rollout_is_weights >= lower_threshold) & (rollout_is_weights <= upper_threshold)
        rollout_is_weights = rollout_is_weights * mask.float()
    return rollout_is_weights * response_mask


# verl 0.9.1, verl/trainer/ppo/metric_utils.py, compute_data_metrics (critic/vf_explained_var)
def verl_vf_explained_var(values: torch.Tensor, returns: torch.Tensor, response_mask: torch.Tensor) -> float:
    valid_returns = torch.masked_select(returns, response_mask)
    valid_values = torch.masked_select(values, response_mask)
    return_diff_var = torch.var(valid_returns - valid_values)
    return_var = torch.var(valid_returns)
    return (1.0 - return_diff_var / (return_var + 1e-5)).item()


# ======================================================================================== transcriptions: TRL


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


# ======================================================================================== aggregation


def _loss_matrix(seed: int) -> torch.Tensor:
    loss = torch.randn(N, T, generator=_gen(seed), dtype=F64) * 3.0
    loss[0, 0] = 1e6
    return loss


@pytest.mark.parametrize("mode", AGGREGATION_MODES)
def test_aggregate_loss_matches_verl_agg_loss(mode: str) -> None:
    """Local counts: verl 0.9.1 agg_loss (token-sum-norm: verl 0.7.0's seq-mean-token-sum-norm), values and grads."""
    loss = _loss_matrix(1)
    mask = MASK.to(F64)
    value, grad = _grad(lambda x: aggregate_loss(x, MASK, mode), loss)
    ref_value, ref_grad = _grad(lambda x: reference_agg(x, mask, mode), loss)
    assert_close(value, ref_value)
    assert_close(grad, ref_grad)


@pytest.mark.parametrize("mode", AGGREGATION_MODES)
def test_aggregate_loss_global_counts_match_verl_agg_loss(mode: str) -> None:
    """Global counts (verl's batch_num_tokens / global_batch_size / loss_scale_factor): each micro-batch matches
    verl, the micro-batches sum to the full batch, and verl's dp_size scaling is a plain factor."""
    loss = _loss_matrix(2)
    mask = MASK.to(F64)
    max_len = 13
    num_tokens, num_seqs = int(MASK.sum()), int(MASK.any(-1).sum())
    miles_kw = {"global_num_tokens": num_tokens, "global_num_seqs": num_seqs, "max_response_len": max_len}
    verl_kw = {"batch_num_tokens": num_tokens, "global_batch_size": num_seqs, "loss_scale_factor": max_len}
    total = torch.zeros((), dtype=F64)
    for rows in (slice(0, 2), slice(2, 6)):
        micro = aggregate_loss(loss[rows], MASK[rows], mode, **miles_kw)
        assert_close(micro, reference_agg(loss[rows], mask[rows], mode, **verl_kw))
        total = total + micro
    assert_close(total, aggregate_loss(loss, MASK, mode, **miles_kw))
    if mode != "token-sum-norm":  # verl 0.7.0's seq-mean-token-sum-norm has no dp_size
        assert_close(verl_agg_loss(loss, mask, mode, dp_size=4, **verl_kw), 4 * total)


TRL_COUNTS = {"max_completion_length": T + 5, "num_items_in_batch": int(MASK.sum()) + 17}
# TRL's loss_type -> (Miles aggregation mode, the global counts that reproduce TRL's normalizer)
TRL_LOSS_TYPES = {
    "grpo": ("seq-mean-token-mean", {"global_num_seqs": N}),
    "bnpo": ("token-mean", {}),
    "dr_grpo": ("seq-mean-token-sum-norm", {"global_num_seqs": N, "max_response_len": T + 5}),
    "dapo": ("token-mean", {"global_num_tokens": int(MASK.sum()) + 17}),  # num_items_in_batch: the generation batch
}


@pytest.mark.parametrize("loss_type", ["grpo", "bnpo", "dr_grpo", "dapo"])
def test_aggregate_loss_matches_trl_loss_types(loss_type: str) -> None:
    """TRL's loss_type aggregations are Miles modes with global counts: grpo = seq-mean-token-mean over every row
    (N_seq = B), bnpo = token-mean, dr_grpo = seq-mean-token-sum-norm with N_seq = B and L = max_completion_length,
    dapo = token-mean over num_items_in_batch tokens. Values and gradients, the all-masked row included."""
    mode, counts = TRL_LOSS_TYPES[loss_type]
    value, grad = _grad(lambda x: aggregate_loss(x, MASK, mode, **counts), _loss_matrix(3))
    ref_value, ref_grad = _grad(lambda x: trl_aggregate_loss(x, MASK, loss_type, **TRL_COUNTS), _loss_matrix(3))
    assert_close(value, ref_value)
    assert_close(grad, ref_grad)


@pytest.mark.parametrize("loss_type", ["grpo", "dr_grpo"])
def test_trl_counts_the_all_masked_row_where_miles_local_counts_do_not(loss_type: str) -> None:
    """Documented in aggregate_loss: TRL's "grpo" / "dr_grpo" average over every row, the all-masked one included;
    Miles' local count (as verl 0.9.1) is the rows with a valid token. global_num_seqs=B gives TRL's."""
    loss = _loss_matrix(4)
    mode, _ = TRL_LOSS_TYPES[loss_type]
    trl = trl_aggregate_loss(loss, MASK, loss_type, max_completion_length=T)
    assert_close(aggregate_loss(loss, MASK, mode, global_num_seqs=N, max_response_len=T), trl)
    assert_close(aggregate_loss(loss, MASK, mode), trl * N / (N - 1))  # 5 rows with a valid token, not 6
    assert_close(aggregate_loss(loss, MASK, mode), verl_agg_loss(loss, MASK, mode))


def test_dr_grpo_normalizers_of_verl_070_and_091_differ_by_num_seqs() -> None:
    """verl <= 0.7 divides Dr.GRPO's token sum by L alone (Miles' token-sum-norm), verl 0.9.1 by N_seq * L."""
    loss, mask = _loss_matrix(4), MASK.to(F64)
    old = verl070_agg_loss_seq_mean_token_sum_norm(loss, mask)
    new = verl_agg_loss(loss, mask, "seq-mean-token-sum-norm")
    assert_close(aggregate_loss(loss, MASK, "token-sum-norm"), old)
    assert_close(aggregate_loss(loss, MASK, "seq-mean-token-sum-norm"), new)
    assert_close(old, new * int(MASK.any(-1).sum()))


def test_aggregate_loss_ignores_nonfinite_padding_where_verl_sum_modes_do_not() -> None:
    """Miles zeroes padding with `where` (aggregate_loss: "padding may hold inf / nan"); verl's seq-mean modes
    multiply loss_mat by the mask, so an inf there gives nan. With finite padding the two agree (tested above)."""
    loss = _loss_matrix(5).masked_fill(~MASK, math.inf)
    clean = loss.masked_fill(~MASK, 0.0)
    for mode in ("seq-mean-token-sum", "seq-mean-token-mean"):
        assert torch.isnan(verl_agg_loss(loss, MASK.to(F64), mode))
        assert_close(aggregate_loss(loss, MASK, mode), verl_agg_loss(clean, MASK.to(F64), mode))


# ======================================================================================== PPO policy loss vs verl

CLIPS = {
    "ppo": (0.2, 0.2, None),
    "clip-higher": (0.2, 0.28, None),
    "dual-clip": (0.2, 0.2, 3.0),
    "clip-higher+dual-clip": (0.1, 0.3, 10.0),
}
NO_DUAL_CLIP = 1e12  # verl always applies dual-clip (clip_ratio_c, default 3); a huge c switches it off


def _is_weights(seed: int) -> torch.Tensor:
    w = torch.rand(N, T, generator=_gen(seed), dtype=F64) * 2.5
    w[0, 5] = 0.0  # an MIS-rejected token
    return w * MASK


@pytest.mark.parametrize("with_is", [False, True], ids=["no-is", "is-weights"])
@pytest.mark.parametrize("clip", list(CLIPS), ids=list(CLIPS))
@pytest.mark.parametrize("mode", AGGREGATION_MODES)
def test_policy_loss_matches_verl_vanilla(mode: str, clip: str, with_is: bool) -> None:
    clip_low, clip_high, dual = CLIPS[clip]
    logp, old = logprob_pair(10)
    adv = token_advantages(11)
    weights = _is_weights(12) if with_is else None
    mask = MASK.to(F64)
    metrics: dict[str, torch.Tensor] = {}

    def miles(x: torch.Tensor) -> torch.Tensor:
        loss, m = policy_loss(
            x,
            old,
            adv,
            MASK,
            clip_low=clip_low,
            clip_high=clip_high,
            dual_clip=dual,
            agg_mode=mode,
            is_weights_BT=weights,
        )
        metrics.update(m)
        return loss

    ref_metrics: dict[str, torch.Tensor] = {}

    def verl(x: torch.Tensor) -> torch.Tensor:
        pg_losses, m = verl_policy_loss_vanilla_per_token(
            old, x, adv, mask, clip_low, clip_high, dual or NO_DUAL_CLIP, weights
        )
        ref_metrics.update(m)
        return reference_agg(pg_losses, mask, mode)

    value, grad = _grad(miles, logp)
    ref_value, ref_grad = _grad(verl, logp)
    assert_close(value, ref_value)
    assert_close(grad, ref_grad)
    assert_close(metrics["clip_fraction"], ref_metrics["pg_clipfrac"], rtol=1e-6)
    assert_close(metrics["dual_clip_fraction"], ref_metrics["pg_clipfrac_lower"], rtol=1e-6)


def test_policy_loss_ppo_kl_metric_matches_verl_within_the_clamp() -> None:
    """verl's ppo_kl is the mean of the clamped (±20) log-ratio; Miles' is the mean of the raw log-ratio. They agree
    when no valid log-ratio reaches ±20 and differ (by the clamped excess) when one does."""
    mask = MASK.to(F64)
    adv = token_advantages(13)
    for extreme in (False, True):
        logp, old = logprob_pair(14, extreme=extreme)
        _, metrics = policy_loss(logp, old, adv, MASK)
        _, ref = verl_policy_loss_vanilla_per_token(old, logp, adv, mask, 0.2, 0.2, 3.0)
        raw = verl_masked_mean(old - logp, mask)
        assert_close(metrics["ppo_kl"], raw, rtol=1e-5, atol=1e-6)  # a float32 metric
        if extreme:
            assert not torch.isclose(raw, ref["ppo_kl"])
        else:
            assert_close(metrics["ppo_kl"], ref["ppo_kl"], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("with_is", [False, True], ids=["no-is", "is-weights"])
@pytest.mark.parametrize("clip", ["ppo", "clip-higher"])
@pytest.mark.parametrize("mode", AGGREGATION_MODES)
def test_gspo_policy_loss_matches_verl_gspo(mode: str, clip: str, with_is: bool) -> None:
    clip_low, clip_high, _ = CLIPS[clip]
    logp, old = logprob_pair(20)
    # sequence advantages broadcast to tokens, as GSPO uses them
    adv = seq_advantages(21).unsqueeze(-1).expand(N, T).clone()
    weights = _is_weights(22) if with_is else None
    mask = MASK.to(F64)
    metrics: dict[str, torch.Tensor] = {}

    def miles(x: torch.Tensor) -> torch.Tensor:
        loss, m = policy_loss(
            x,
            old,
            adv,
            MASK,
            clip_low=clip_low,
            clip_high=clip_high,
            ratio_type="sequence",
            agg_mode=mode,
            is_weights_BT=weights,
        )
        metrics.update(m)
        return loss

    ref_metrics: dict[str, torch.Tensor] = {}

    def verl(x: torch.Tensor) -> torch.Tensor:
        pg_losses, m = verl_policy_loss_gspo_per_token(old, x, adv, mask, clip_low, clip_high, weights)
        ref_metrics.update(m)
        return reference_agg(pg_losses, mask, mode)

    value, grad = _grad(miles, logp)
    ref_value, ref_grad = _grad(verl, logp)
    assert_close(value, ref_value)
    assert_close(grad, ref_grad)
    assert_close(metrics["clip_fraction"], ref_metrics["pg_clipfrac"], rtol=1e-6)
    assert_close(metrics["ppo_kl"], ref_metrics["ppo_kl"], rtol=1e-5, atol=1e-6)  # a float32 metric


# ======================================================================================== GRPO losses vs TRL


def _trl_inputs(seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(logp, old, sampling, ref, advantages): log-ratios within ±20 (TRL does not clamp them), k3 below verl's cap
    of 10 (x = logp - ref >= -2), probabilities from tiny to near one, padding with finite nonsense."""
    g = _gen(seed)
    old = _quantize(-6.0 * torch.rand(N, T, generator=g, dtype=F64))
    logp = old + _quantize(0.4 * torch.randn(N, T, generator=g, dtype=F64))
    logp[0, 1], old[0, 1] = -0.015625, -6.0  # ratio e^5.98, both signs of advantage below
    logp[1, 2], old[1, 2] = -8.0, -0.015625
    sampling = old + _quantize(0.3 * torch.randn(N, T, generator=g, dtype=F64))
    sampling[0, 4] = old[0, 4] - 4.0  # token IS ratio e^4: truncated / rejected
    sampling[3, 5] = old[3, 5] + 3.0  # e^-3: below clip_min
    ref = logp + _quantize(0.5 * torch.rand(N, T, generator=g, dtype=F64)) - 0.25
    ref[2, 0] = logp[2, 0] - 9.0  # x = 9: k3 = e^-9 + 8, below the cap
    for t in (logp, old, sampling, ref):
        t.masked_fill_(~MASK, -3.5)
    logp.masked_fill_(~MASK, 1.25)
    adv = seq_advantages(seed + 1)
    return logp, old, sampling, ref, adv


TRL_IS_MODES = ["token_truncate", "token_mask", "sequence_truncate", "sequence_mask"]


def _miles_is_from_trl_mode(trl_mode: str) -> tuple[str, str]:
    level, mode = trl_mode.split("_")
    return level, mode


@pytest.mark.parametrize("beta", [0.0, 0.04], ids=["beta0", "beta0.04"])
@pytest.mark.parametrize("vllm_is", [None, *TRL_IS_MODES], ids=["no-vllm-is", *TRL_IS_MODES])
@pytest.mark.parametrize("loss_type", list(TRL_LOSS_TYPES))
def test_policy_loss_matches_trl_grpo_loss_types(loss_type: str, vllm_is: str | None, beta: float) -> None:
    """TRL's per-token clipped loss x vLLM IS ratio + beta * k3, aggregated per loss_type, against Miles'
    policy_loss(is_weights_BT=importance_weights(...)) + beta * aggregate_loss(kl_estimate(k3)): value and grad."""
    logp, old, sampling, ref, adv = _trl_inputs(30)
    mode, counts = TRL_LOSS_TYPES[loss_type]
    clip_max = 3.0
    trl_ratio = miles_w = None
    if vllm_is is not None:
        trl_ratio = trl_vllm_importance_sampling_ratio(old, sampling, MASK.to(F64), vllm_is, None, clip_max)
        level, is_mode = _miles_is_from_trl_mode(vllm_is)
        # TRL's MIS has no lower bound by default; Miles' default is verl's 1 / C, so pass 0
        miles_w, _ = importance_weights(
            old,
            sampling,
            MASK,
            level=level,
            mode=is_mode,
            threshold=clip_max,
            threshold_low=0.0 if is_mode == "mask" else None,
        )

    def miles(x: torch.Tensor) -> torch.Tensor:
        loss, _ = policy_loss(
            x,
            old,
            adv.unsqueeze(-1).expand(N, T),
            MASK,
            clip_low=0.2,
            clip_high=0.28,
            agg_mode=mode,
            is_weights_BT=miles_w,
            **counts,
        )
        if beta:
            loss = loss + beta * aggregate_loss(kl_estimate(x, ref, "k3"), MASK, mode, **counts)
        return loss

    def trl(x: torch.Tensor) -> torch.Tensor:
        return trl_grpo_compute_loss(
            x,
            old,
            adv,
            MASK,
            loss_type=loss_type,
            epsilon_low=0.2,
            epsilon_high=0.28,
            importance_sampling_ratio=trl_ratio,
            beta=beta,
            ref_per_token_logps=ref,
            **TRL_COUNTS,
        )

    value, grad = _grad(miles, logp)
    ref_value, ref_grad = _grad(trl, logp)
    assert_close(value, ref_value, rtol=1e-6)
    assert_close(grad, ref_grad, rtol=1e-6)


@pytest.mark.parametrize(
    "vllm_is", [None, "sequence_truncate", "token_truncate"], ids=["no-vllm-is", "sequence_truncate", "token_truncate"]
)
def test_gspo_matches_trl_sequence_importance_sampling_level(vllm_is: str | None) -> None:
    """TRL's importance_sampling_level="sequence" with loss_type="grpo" is Miles' ratio_type="sequence" with
    seq-mean-token-mean over every row: same value and gradient (TRL differentiates the sequence ratio itself, Miles
    and verl use the straight-through token form), also with sequence-level vLLM IS weights. With token-level IS
    weights the values still agree but the gradients do not: TRL's per-sequence loss times the row's mean weight
    spreads that mean over every token's gradient, Miles (as verl's compute_policy_loss_gspo with
    rollout_is_weights) weights each token's gradient by its own weight."""
    logp, old, sampling, _, adv = _trl_inputs(31)
    trl_ratio = miles_w = None
    if vllm_is is not None:
        trl_ratio = trl_vllm_importance_sampling_ratio(old, sampling, MASK.to(F64), vllm_is, None, 3.0)
        level, _ = _miles_is_from_trl_mode(vllm_is)
        miles_w, _ = importance_weights(old, sampling, MASK, level=level, threshold=3.0)

    def miles(x: torch.Tensor) -> torch.Tensor:
        loss, _ = policy_loss(
            x,
            old,
            adv.unsqueeze(-1).expand(N, T),
            MASK,
            ratio_type="sequence",
            agg_mode="seq-mean-token-mean",
            global_num_seqs=N,
            is_weights_BT=miles_w,
        )
        return loss

    def trl(x: torch.Tensor) -> torch.Tensor:
        return trl_grpo_compute_loss(
            x,
            old,
            adv,
            MASK,
            loss_type="grpo",
            epsilon_low=0.2,
            epsilon_high=0.2,
            importance_sampling_level="sequence",
            importance_sampling_ratio=trl_ratio,
        )

    value, grad = _grad(miles, logp)
    ref_value, ref_grad = _grad(trl, logp)
    assert_close(value, ref_value, rtol=1e-6)
    if vllm_is != "token_truncate":
        assert_close(grad, ref_grad, rtol=1e-6)
        return
    assert miles_w is not None
    # per row, Miles' gradient is TRL's with the row-mean weight replaced by each token's own weight
    row_mean_w = (miles_w.double() * MASK).sum(-1, keepdim=True) / MASK.sum(-1, keepdim=True).clamp(min=1)
    safe_mean = torch.where(row_mean_w > 0, row_mean_w, torch.ones_like(row_mean_w))
    assert_close(grad, ref_grad / safe_mean * miles_w.double(), rtol=1e-6)
    assert not torch.allclose(grad, ref_grad)


def test_policy_loss_log_ratio_clamp_differs_from_trl() -> None:
    """Miles (as verl) clamps the PPO log-ratio to ±20 (documented in policy_loss); TRL does not. With A < 0 and a
    log-ratio of 30 the unclipped branch is taken: Miles' loss is |A| e^20, TRL's |A| e^30."""
    logp = torch.tensor([[0.0]], dtype=F64)
    old = torch.tensor([[-30.0]], dtype=F64)
    adv = torch.tensor([-1.0], dtype=F64)
    mask = torch.ones(1, 1, dtype=torch.bool)
    miles, _ = policy_loss(logp, old, adv.unsqueeze(-1), mask)
    trl = trl_grpo_compute_loss(logp, old, adv, mask, loss_type="bnpo", epsilon_low=0.2, epsilon_high=0.2)
    assert_close(miles, math.exp(20.0))
    assert_close(trl, math.exp(30.0))
    # below the clamp they agree
    old = torch.tensor([[-19.0]], dtype=F64)
    miles, _ = policy_loss(logp, old, adv.unsqueeze(-1), mask)
    trl = trl_grpo_compute_loss(logp, old, adv, mask, loss_type="bnpo", epsilon_low=0.2, epsilon_high=0.2)
    assert_close(miles, trl)


def test_trl_default_bias_corrected_kl_is_k3_times_ratio() -> None:
    """TRL 1.16 defaults to use_bias_correction_kl=True (k3 times the differentiable ratio pi / pi_old); Miles'
    kl_estimate("k3") is TRL's per_token_kl with the flag off. Multiplying by the ratio reproduces TRL's default."""
    logp, old, _, ref, _ = _trl_inputs(32)
    zeros = torch.zeros(N, dtype=F64)

    def miles(x: torch.Tensor) -> torch.Tensor:
        return aggregate_loss(kl_estimate(x, ref, "k3") * torch.exp(x - old), MASK, "token-mean")

    def trl(x: torch.Tensor, bias_correction: bool = True) -> torch.Tensor:
        return trl_grpo_compute_loss(
            x,
            old,
            zeros,
            MASK,
            loss_type="bnpo",
            epsilon_low=0.2,
            epsilon_high=0.2,
            beta=1.0,
            ref_per_token_logps=ref,
            use_bias_correction_kl=bias_correction,
        )

    value, grad = _grad(miles, logp)
    ref_value, ref_grad = _grad(trl, logp)
    assert_close(value, ref_value)
    assert_close(grad, ref_grad)
    plain = aggregate_loss(kl_estimate(logp, ref, "k3"), MASK, "token-mean")
    assert_close(plain, trl(logp, bias_correction=False))
    assert not torch.isclose(plain, ref_value)


# ======================================================================================== KL estimators


def _kl_inputs() -> tuple[torch.Tensor, torch.Tensor]:
    """x = logp - ref over -30..30, including the clamp edges of k3 (ref - logp = ±20, k3 = 10)."""
    g = _gen(40)
    x = torch.cat(
        [
            torch.tensor(
                [-30.0, -21.0, -20.0, -19.0, -5.0, -2.6, -2.5, -1e-6, 0.0, 1e-6, 2.0, 11.5, 19.0, 21.0, 30.0],
                dtype=F64,
            ),
            torch.randn(17, generator=g, dtype=F64) * 3.0,
        ]
    ).to(F64)
    ref = -torch.rand(x.shape, generator=g, dtype=F64) * 2.0 - 1e-9
    ref[0] = -1e-9  # pi_ref near one, pi tiny (e^-30)
    return (ref + x).reshape(4, 8), ref.reshape(4, 8)


@pytest.mark.parametrize("kind", KL_KINDS)
def test_kl_estimate_matches_verl_kl_penalty(kind: str) -> None:
    """Values and gradients (the '+' kinds are verl's straight-through: value of the estimator, gradient of k2)."""
    logp, ref = _kl_inputs()
    weights = torch.rand(logp.shape, generator=_gen(41), dtype=F64) + 0.5
    value, grad = _grad(lambda x: (kl_estimate(x, ref, kind) * weights).sum(), logp)
    ref_value, ref_grad = _grad(lambda x: (verl_kl_penalty(x, ref, kind) * weights).sum(), logp)
    assert_close(value, ref_value)
    assert_close(grad, ref_grad)
    assert_close(kl_estimate(logp, ref, kind), verl_kl_penalty(logp, ref, kind))


def test_kl_k3_matches_trl_per_token_kl_below_verl_clamps() -> None:
    """TRL's k3 has no clamp; Miles clamps as verl (documented in kl_estimate): they agree while k3 <= 10 and
    |ref - logp| <= 20, and differ beyond (k3 = 10 in Miles, e^5 - 6 in TRL at logp - ref = -5)."""
    logp, _, _, ref, _ = _trl_inputs(42)
    value, grad = _grad(lambda x: (kl_estimate(x, ref, "k3") * MASK).sum(), logp)
    ref_value, ref_grad = _grad(lambda x: (trl_per_token_kl(x, ref) * MASK).sum(), logp)
    assert_close(value, ref_value)
    assert_close(grad, ref_grad)
    far_logp, far_ref = torch.tensor([-5.0], dtype=F64), torch.tensor([0.0], dtype=F64)
    assert kl_estimate(far_logp, far_ref, "k3").item() == 10.0
    assert_close(trl_per_token_kl(far_logp, far_ref), math.exp(5.0) - 6.0)


# ======================================================================================== importance weights


def _is_inputs(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(old, rollout) quantized log-probs with token log-ratios up to ±50 and sequence sums beyond ±20."""
    g = _gen(seed)
    rollout = _quantize(-4.0 * torch.rand(N, T, generator=g, dtype=F64))
    old = rollout + _quantize(0.6 * torch.randn(N, T, generator=g, dtype=F64))
    old[0, 1], rollout[0, 1] = -0.015625, -50.0  # rollout tiny, trainer near one: +50
    old[0, 2], rollout[0, 2] = -30.0, -0.015625  # -30
    old[5, 0], rollout[5, 0] = -1.0, -1.75  # e^0.75 ~ 2.1: just above the threshold 2
    old[3, 4], rollout[3, 4] = -2.0, -1.25  # e^-0.75 ~ 0.47: just below 1 / 2
    old.masked_fill_(~MASK, 9.0)  # padding: garbage log-ratio 9 - (-9) = 18
    rollout.masked_fill_(~MASK, -9.0)
    return old, rollout


VERL091_IS = {"truncate": 2.0, "mask": "0.5_2.0"}  # TIS (upper only) and IcePop (lower_upper)


@pytest.mark.parametrize("mode", IS_MODES)
@pytest.mark.parametrize("level", IS_LEVELS)
def test_importance_weights_match_verl_091(level: str, mode: str) -> None:
    """verl 0.9.1 compute_rollout_correction_weights: TIS (a float threshold: clamp above) is mode="truncate";
    IcePop ("lower_upper": zero outside [lower, upper]) is mode="mask" with threshold_low=lower."""
    old, rollout = _is_inputs(50)
    mask = MASK.to(F64)
    weights, metrics = importance_weights(
        old, rollout, MASK, level=level, mode=mode, threshold=2.0, threshold_low=0.5 if mode == "mask" else None
    )
    ref, ref_metrics = verl_compute_rollout_correction_weights(old - rollout, mask, level, VERL091_IS[mode])
    assert_close(weights, ref, rtol=1e-6, atol=0.0)
    assert_close(metrics["mean"], ref_metrics["rollout_is_mean"], rtol=1e-6)
    if level == "token":
        assert_close(metrics["fraction_high"], ref_metrics["rollout_is_ratio_fraction_high"], rtol=1e-6)
        assert_close(metrics["fraction_low"], ref_metrics["rollout_is_ratio_fraction_low"], rtol=1e-6)
    assert (weights[~MASK] == 0).all()


@pytest.mark.parametrize("threshold_low", [None, 0.25], ids=["low-default", "low-0.25"])
@pytest.mark.parametrize("mode", IS_MODES)
@pytest.mark.parametrize("level", IS_LEVELS)
def test_importance_weights_match_verl_060_mismatch_helper(level: str, mode: str, threshold_low: float | None) -> None:
    """verl 0.6.0 compute_rollout_importance_weights (no veto): MIS's lower bound defaults to 1 / upper, as
    Miles'; TIS clamps above only (verl 0.6 ignores the lower bound in truncate mode, Miles raises weights to it,
    as TRL's clip_min: compared with threshold_low=None there)."""
    old, rollout = _is_inputs(51)
    low = threshold_low if mode == "mask" else None
    weights, _ = importance_weights(old, rollout, MASK, level=level, mode=mode, threshold=2.0, threshold_low=low)
    ref = verl060_compute_rollout_importance_weights(old, rollout, MASK.to(F64), level, mode, 2.0, threshold_low)
    assert_close(weights, ref, rtol=1e-6, atol=0.0)


@pytest.mark.parametrize("clip_min", [None, 0.5], ids=["clip_min-none", "clip_min-0.5"])
@pytest.mark.parametrize("trl_mode", TRL_IS_MODES)
def test_importance_weights_match_trl_vllm_importance_sampling(trl_mode: str, clip_min: float | None) -> None:
    """TRL's vllm_importance_sampling_mode on valid tokens (TRL leaves ratio 1 at padding, Miles 0; both are masked
    out of the loss). Inputs keep |log-ratio| and its row sums within 20, where Miles' clamp does not act."""
    _, old, sampling, _, _ = _trl_inputs(52)
    level, mode = _miles_is_from_trl_mode(trl_mode)
    low = clip_min if clip_min is not None or mode == "truncate" else 0.0  # TRL's MIS: no lower bound by default
    weights, _ = importance_weights(old, sampling, MASK, level=level, mode=mode, threshold=3.0, threshold_low=low)
    ref = trl_vllm_importance_sampling_ratio(old, sampling, MASK.to(F64), trl_mode, clip_min, 3.0).expand(N, T)
    assert_close(weights[MASK], ref[MASK], rtol=1e-6, atol=0.0)
    assert (weights[~MASK] == 0).all()


def test_mis_default_lower_bound_is_verl_not_trl() -> None:
    """Documented in importance_weights: MIS's default lower bound is verl 0.6's 1 / C, TRL's mask modes have none.
    A token weight of e^-1 (< 1 / 2) is rejected by Miles' default and by verl 0.6, kept by TRL."""
    old = torch.tensor([[-2.0, -1.0]], dtype=F64)
    rollout = torch.tensor([[-1.0, -1.0]], dtype=F64)
    mask = torch.ones(1, 2, dtype=torch.bool)
    miles, _ = importance_weights(old, rollout, mask, mode="mask", threshold=2.0)
    verl060 = verl060_compute_rollout_importance_weights(old, rollout, mask.to(F64), "token", "mask", 2.0)
    trl = trl_vllm_importance_sampling_ratio(old, rollout, mask.to(F64), "token_mask", None, 2.0)
    assert_close(miles, [[0.0, 1.0]])
    assert_close(verl060, [[0.0, 1.0]])
    assert_close(trl, [[math.exp(-1.0), 1.0]])
    kept, _ = importance_weights(old, rollout, mask, mode="mask", threshold=2.0, threshold_low=0.0)
    assert_close(kept, trl, rtol=1e-6)


@pytest.mark.parametrize("level", IS_LEVELS)
def test_importance_weights_log_ratio_clamp_differs_from_trl(level: str) -> None:
    """Documented: Miles clamps the log-ratio (token, or the row sum) to ±20 before exp, as verl; TRL does not.
    At -30 a TIS weight is e^-20 in Miles and verl, e^-30 in TRL."""
    old = torch.tensor([[-30.0]], dtype=F64)
    rollout = torch.tensor([[0.0]], dtype=F64)
    mask = torch.ones(1, 1, dtype=torch.bool)
    miles, _ = importance_weights(old, rollout, mask, level=level, threshold=3.0)
    verl, _ = verl_compute_rollout_correction_weights(old - rollout, mask.to(F64), level, 3.0)
    trl = trl_vllm_importance_sampling_ratio(old, rollout, mask.to(F64), f"{level}_truncate", None, 3.0)
    assert_close(miles, math.exp(-20.0), rtol=1e-6, atol=0.0)
    assert_close(verl, math.exp(-20.0), atol=0.0)
    assert_close(trl, math.exp(-30.0), atol=0.0)


@pytest.mark.parametrize("mode", IS_MODES)
@pytest.mark.parametrize("level", IS_LEVELS)
def test_batch_normalized_weights_match_verl_rollout_is_batch_normalize(level: str, mode: str) -> None:
    """importance_weight_sums + normalize_importance_weights == verl 0.9.1's rollout_is_batch_normalize, per token
    or per sequence; the sums of two micro-batches give the same normalization as the whole batch."""
    old, rollout = _is_inputs(53)
    low = 0.5 if mode == "mask" else None
    weights, _ = importance_weights(old, rollout, MASK, level=level, mode=mode, threshold=2.0, threshold_low=low)
    total, count = importance_weight_sums(weights, MASK, level)
    normalized = normalize_importance_weights(weights, total / count)
    ref, _ = verl_compute_rollout_correction_weights(old - rollout, MASK.to(F64), level, VERL091_IS[mode], True)
    assert_close(normalized, ref, rtol=1e-6, atol=0.0)
    split = [importance_weight_sums(weights[rows], MASK[rows], level) for rows in (slice(0, 3), slice(3, 6))]
    assert_close(sum(s for s, _ in split), total, rtol=1e-12)
    assert_close(sum(c for _, c in split), count, rtol=0.0, atol=0.0)


# ======================================================================================== advantages

# Interleaved groups of 2..4 samples (no group of one), rewards with ±1e6, a constant-reward group.
GROUPS = [3, 1, 0, 3, 2, 1, 0, 2, 3, 0, 1, 3, 2, 2]
REWARDS = torch.tensor([1e6, 0.5, -1.0, -1e6, 1.0, 0.5, 2.0, 1.0, 0.25, 0.5, 0.5, 3.0, 1.0, 1.0], dtype=F64)
# Group 1 = (0.5, 0.5, 0.5) and group 2 = (1, 1, 1, 1) are constant: zero std, advantage 0.
NA = len(GROUPS)
ADV_MASK = torch.cat([MASK, MASK, MASK[:2]])  # ragged rows, a hole, an all-masked row
SINGLETON_GROUPS = [*GROUPS[:-1], 9]  # the last sample alone in group 9


def _token_rewards(rewards: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """verl's token_level_rewards: the outcome reward on each row's last valid token (column 0 for an empty row,
    where verl never reads it)."""
    out = torch.zeros(mask.shape, dtype=F64)
    positions = torch.arange(mask.shape[1]).expand(mask.shape)
    last = torch.where(mask, positions, 0).amax(dim=1)
    out[torch.arange(mask.shape[0]), last] = rewards
    return out


@pytest.mark.parametrize("scale", ["group", "none"])
def test_grpo_and_dr_grpo_match_verl(scale: str) -> None:
    """verl's norm_adv_by_std_in_grpo True / False (GRPO / Dr.GRPO); unequal interleaved groups, constant groups."""
    mask = ADV_MASK.to(F64)
    ref, _ = verl_grpo_outcome_advantage(
        _token_rewards(REWARDS, ADV_MASK), mask, GROUPS, epsilon=1e-6, norm_adv_by_std_in_grpo=scale == "group"
    )
    adv = grpo_advantages(REWARDS, torch.tensor(GROUPS), scale_rewards=scale)
    assert_close(adv.unsqueeze(-1) * mask, ref)
    if scale == "none":
        assert_close(dr_grpo_advantages(REWARDS, torch.tensor(GROUPS)).unsqueeze(-1) * mask, ref)


@pytest.mark.parametrize("estimator", ["grpo", "dr_grpo", "rloo", "reinforce_plus_plus_baseline"])
def test_singleton_group_gets_zero_advantage_where_verl_keeps_the_reward(estimator: str) -> None:
    """Documented departure: a group of one sample gets advantage 0 in Miles; verl keeps its reward (GRPO:
    r / (1 + eps), Dr.GRPO, RLOO and REINFORCE++-baseline: r). Every other sample agrees (REINFORCE++-baseline:
    the batch whitening then moves them all), and Miles equals verl run with the lone sample's reward set to 0."""
    groups, mask = torch.tensor(SINGLETON_GROUPS), ADV_MASK.to(F64)
    lone = NA - 1
    zeroed = REWARDS.clone()
    zeroed[lone] = 0.0
    refs: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
        "grpo": lambda r: verl_grpo_outcome_advantage(_token_rewards(r, ADV_MASK), mask, SINGLETON_GROUPS)[0],
        "dr_grpo": lambda r: verl_grpo_outcome_advantage(
            _token_rewards(r, ADV_MASK), mask, SINGLETON_GROUPS, norm_adv_by_std_in_grpo=False
        )[0],
        "rloo": lambda r: verl_rloo_outcome_advantage(_token_rewards(r, ADV_MASK), mask, SINGLETON_GROUPS)[0],
        "reinforce_plus_plus_baseline": lambda r: verl_rpp_baseline_outcome_advantage(
            _token_rewards(r, ADV_MASK), mask, SINGLETON_GROUPS
        )[0],
    }
    adv = compute_advantages(estimator, REWARDS, groups, ADV_MASK)
    ref, ref_zeroed = refs[estimator](REWARDS.clone()), refs[estimator](zeroed)
    if estimator != "reinforce_plus_plus_baseline":  # there the lone sample's 0 is then whitened with the batch
        assert (adv[lone] == 0).all()
    lone_reward = REWARDS[lone] / (1 + 1e-6) if estimator == "grpo" else REWARDS[lone]
    if estimator != "reinforce_plus_plus_baseline":  # (whitened there: only the sign is simple)
        assert_close(ref[lone], lone_reward * mask[lone])
        assert_close(adv[:lone], ref[:lone])
    assert not torch.allclose(adv, ref)
    assert_close(adv, ref_zeroed)


@pytest.mark.parametrize("num_generations", [1, 2, 7])
@pytest.mark.parametrize("scale", ["group", "batch", "none"])
def test_grpo_matches_trl_scale_rewards(scale: str, num_generations: int) -> None:
    """TRL's contiguous groups of num_generations, nanstd (unbiased), epsilon 1e-4; num_generations=1 gives 0 in
    both (TRL's std is 0, Miles' groups of one)."""
    rewards = REWARDS.clone()
    groups = torch.arange(NA) // num_generations
    ref = trl_grpo_advantages(rewards, num_generations, scale)
    adv = grpo_advantages(rewards, groups, epsilon=1e-4, scale_rewards=scale)
    assert_close(adv, ref)
    kwargs = estimator_kwargs("grpo", AdvantageConfig(std_epsilon=1e-4, scale_rewards=scale))
    assert_close(compute_advantages("grpo", rewards, groups, ADV_MASK, **kwargs), ref.unsqueeze(-1) * ADV_MASK)


def test_rloo_matches_verl() -> None:
    mask = ADV_MASK.to(F64)
    ref, _ = verl_rloo_outcome_advantage(_token_rewards(REWARDS, ADV_MASK), mask, GROUPS)
    assert_close(rloo_advantages(REWARDS, torch.tensor(GROUPS)).unsqueeze(-1) * mask, ref)


@pytest.mark.parametrize("num_generations", [1, 2, 7])
def test_rloo_matches_trl(num_generations: int) -> None:
    """TRL's RLOO gives 0 for num_generations=1, as Miles' groups of one."""
    groups = torch.arange(NA) // num_generations
    assert_close(rloo_advantages(REWARDS, groups), trl_rloo_advantages(REWARDS.clone(), num_generations))


def test_reinforce_plus_plus_baseline_matches_verl() -> None:
    mask = ADV_MASK.to(F64)
    ref, _ = verl_rpp_baseline_outcome_advantage(_token_rewards(REWARDS, ADV_MASK), mask, GROUPS)
    assert_close(reinforce_plus_plus_baseline_advantages(REWARDS, torch.tensor(GROUPS), ADV_MASK), ref)


@pytest.mark.parametrize("whiten", [True, False], ids=["whiten", "no-whiten"])
@pytest.mark.parametrize("gamma", [1.0, 0.9, 0.0])
def test_reinforce_plus_plus_matches_verl_091(gamma: float, whiten: bool) -> None:
    """verl 0.9.1 carries the return through mask holes unchanged, as Miles (holes and an all-masked row included);
    whiten=False is verl's `returns` output (its advantages are always whitened)."""
    mask = ADV_MASK.to(F64)
    ref_adv, ref_returns = verl_rpp_outcome_advantage(_token_rewards(REWARDS, ADV_MASK), mask, gamma)
    adv = reinforce_plus_plus_advantages(REWARDS, ADV_MASK, gamma=gamma, whiten=whiten)
    assert_close(adv, ref_adv if whiten else ref_returns)


@pytest.mark.parametrize("gamma", [1.0, 0.9])
def test_reinforce_plus_plus_hole_differs_from_verl_070_reset(gamma: float) -> None:
    """Documented departure: Miles skips mask holes; verl <= 0.7 reset the return at every masked token. They agree
    on right-padded rows and differ before a hole: there verl 0.7's return is 0 (whitened: -mean / std)."""
    rewards = REWARDS[:N]
    padded_ref, _ = verl070_rpp_outcome_advantage(_token_rewards(rewards, RIGHT_PADDED), RIGHT_PADDED.to(F64), gamma)
    assert_close(reinforce_plus_plus_advantages(rewards, RIGHT_PADDED, gamma=gamma), padded_ref)
    _, returns070 = verl070_rpp_outcome_advantage(_token_rewards(rewards, MASK), MASK.to(F64), gamma)
    returns = reinforce_plus_plus_advantages(rewards, MASK, gamma=gamma, whiten=False)
    before_hole = [0, 1]  # row 3 = 1 1 0 0 1 1 1 0
    assert (returns070[HOLE_ROW, before_hole] == 0).all()
    assert_close(returns[HOLE_ROW, before_hole], rewards[HOLE_ROW] * gamma ** torch.tensor([4.0, 3.0], dtype=F64))
    after_hole = MASK[HOLE_ROW].clone()
    after_hole[before_hole] = False
    assert_close(returns[HOLE_ROW][after_hole], returns070[HOLE_ROW][after_hole])


GAE_SETTINGS = {"gamma1-lam1": (1.0, 1.0), "gamma0.99-lam0.95": (0.99, 0.95), "gamma0.9-lam0": (0.9, 0.0)}


@pytest.mark.parametrize("whiten", [True, False], ids=["whiten", "no-whiten"])
@pytest.mark.parametrize("setting", list(GAE_SETTINGS))
def test_gae_matches_verl(setting: str, whiten: bool) -> None:
    """verl's compute_gae_advantage_return on valid tokens (holes skipped by both, an all-masked row); verl leaves
    values at masked positions, Miles zeroes them."""
    gamma, lam = GAE_SETTINGS[setting]
    g = _gen(60)
    token_rewards = torch.randn(NA, T, generator=g, dtype=F64) * 0.1 + _token_rewards(REWARDS / 1e5, ADV_MASK)
    values = torch.randn(NA, T, generator=g, dtype=F64) * 2.0
    token_rewards = token_rewards * ADV_MASK + (~ADV_MASK) * 5.0  # masked rewards are never read
    mask = ADV_MASK.to(F64)
    ref_adv, ref_returns = verl_gae_advantage_return(token_rewards, values, mask, gamma, lam, whiten=whiten)
    adv, returns = gae_advantages(token_rewards, values, ADV_MASK, gamma=gamma, lam=lam, whiten=whiten)
    assert_close(adv[ADV_MASK], ref_adv[ADV_MASK])
    assert_close(returns[ADV_MASK], ref_returns[ADV_MASK])
    assert (adv[~ADV_MASK] == 0).all() and (returns[~ADV_MASK] == 0).all()


@pytest.mark.parametrize("name", ADVANTAGE_ESTIMATOR_NAMES)
def test_compute_advantages_dispatch_matches_verl(name: str) -> None:
    """Every outcome estimator through compute_advantages + estimator_kwargs(AdvantageConfig) against verl."""
    mask = ADV_MASK.to(F64)
    token_rewards = _token_rewards(REWARDS, ADV_MASK)
    config = AdvantageConfig(gamma=0.95)
    refs: dict[str, Callable[[], torch.Tensor]] = {
        "grpo": lambda: verl_grpo_outcome_advantage(token_rewards.clone(), mask, GROUPS)[0],
        "dr_grpo": lambda: verl_grpo_outcome_advantage(
            token_rewards.clone(), mask, GROUPS, norm_adv_by_std_in_grpo=False
        )[0],
        "rloo": lambda: verl_rloo_outcome_advantage(token_rewards.clone(), mask, GROUPS)[0],
        "reinforce_plus_plus": lambda: verl_rpp_outcome_advantage(token_rewards, mask, 0.95)[0],
        "reinforce_plus_plus_baseline": lambda: verl_rpp_baseline_outcome_advantage(
            token_rewards.clone(), mask, GROUPS
        )[0],
    }
    adv = compute_advantages(name, REWARDS, torch.tensor(GROUPS), ADV_MASK, **estimator_kwargs(name, config))
    assert_close(adv, refs[name]())


# ======================================================================================== critic, entropy


@pytest.mark.parametrize("clip", [0.2, 0.5, None], ids=["clip0.2", "clip0.5", "no-clip"])
@pytest.mark.parametrize("mode", AGGREGATION_MODES)
def test_value_loss_matches_verl(mode: str, clip: float | None) -> None:
    g = _gen(70)
    old_values = torch.randn(N, T, generator=g, dtype=F64) * 3.0
    vpreds = old_values + torch.randn(N, T, generator=g, dtype=F64)
    returns = torch.randn(N, T, generator=g, dtype=F64) * 5.0
    returns[0, 0] = 1e4
    mask = MASK.to(F64)
    metrics: dict[str, torch.Tensor] = {}

    def miles(x: torch.Tensor) -> torch.Tensor:
        loss, m = value_loss(x, old_values, returns, MASK, clip=clip, agg_mode=mode)
        metrics.update(m)
        return loss

    value, grad = _grad(miles, vpreds)
    # clip=None is verl with an infinite clip range
    ref_value, ref_grad = _grad(
        lambda x: verl_compute_value_loss(x, returns, old_values, mask, math.inf if clip is None else clip, mode)[0],
        vpreds,
    )
    _, clipfrac = verl_compute_value_loss(vpreds, returns, old_values, mask, math.inf if clip is None else clip, mode)
    assert_close(value, ref_value)
    assert_close(grad, ref_grad)
    assert_close(metrics["vf_clip_fraction"], clipfrac, rtol=1e-6)
    # global counts: verl's batch_num_tokens / global_batch_size / loss_scale_factor
    kw = {"global_num_tokens": 40, "global_num_seqs": 9, "max_response_len": 16}
    loss, _ = value_loss(vpreds, old_values, returns, MASK, clip=clip, agg_mode=mode, **kw)
    ref, _ = verl_compute_value_loss(
        vpreds,
        returns,
        old_values,
        mask,
        math.inf if clip is None else clip,
        mode,
        batch_num_tokens=40,
        global_batch_size=9,
        loss_scale_factor=16,
    )
    assert_close(loss, ref)


def test_explained_variance_matches_verl() -> None:
    g = _gen(71)
    returns = torch.randn(N, T, generator=g, dtype=F64) * 4.0
    for values in (returns + 0.3 * torch.randn(N, T, generator=g, dtype=F64), torch.zeros(N, T, dtype=F64), returns):
        expected = verl_vf_explained_var(values, returns, MASK)
        assert explained_variance(values[MASK], returns[MASK]) == pytest.approx(expected, rel=1e-12, abs=1e-12)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch.var of one value warns about its degrees of freedom
        one = torch.zeros(1, 1, dtype=torch.bool)
        one[0, 0] = True
        assert math.isnan(verl_vf_explained_var(returns[:1, :1], returns[:1, :1] + 1, one))
    assert math.isnan(explained_variance(returns[0, :1], returns[0, :1] + 1))


def test_entropy_from_logits_matches_verl() -> None:
    """Values and gradients (Miles computes in float32: compared with verl's formula in float64), logits from
    near-uniform to a near-one-hot distribution (logits ±50)."""
    g = _gen(72)
    logits = _quantize(torch.randn(3, 4, 16, generator=g, dtype=F64) * 3.0)
    logits[0, 0] = 0.0  # uniform
    logits[0, 1, 3] = 50.0  # p ~ 1 on one token, ~e^-50 elsewhere
    logits[1, 2] = _quantize(torch.linspace(-50, 50, 16, dtype=F64))
    weights = torch.rand(3, 4, generator=g, dtype=F64)
    value, grad = _grad(lambda x: (entropy_from_logits(x).double() * weights).sum(), logits.float())
    ref_value, ref_grad = _grad(lambda x: (verl_entropy_from_logits(x) * weights).sum(), logits)
    assert_close(entropy_from_logits(logits.float()), verl_entropy_from_logits(logits), rtol=1e-5, atol=1e-5)
    assert_close(value, ref_value, rtol=1e-5)
    assert_close(grad, ref_grad, rtol=1e-5, atol=1e-6)


def test_entropy_of_a_banned_token_is_finite_where_verl_gives_nan() -> None:
    """Documented in entropy_from_logits: a -inf logit adds 0 (verl's p * logits is 0 * -inf = nan); the result is
    verl's entropy of the remaining tokens."""
    logits = torch.tensor([[2.0, -1.0, float("-inf"), 0.5]])
    assert torch.isnan(verl_entropy_from_logits(logits.double())).all()
    assert_close(entropy_from_logits(logits), verl_entropy_from_logits(logits[:, [0, 1, 3]].double()), rtol=1e-6)
