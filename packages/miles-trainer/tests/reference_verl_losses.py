"""verl's loss-side formulas re-typed as small pure-torch functions: aggregation, the PPO / GSPO policy losses, the
clipped value loss, the KL penalties, the rollout-correction (importance-sampling) weights, explained variance,
entropy, and the masked statistics of verl/utils/torch_functional.py that reference_verl_advantages.py reuses.

No verl import at test time: each function cites the package, version, file and function it is transcribed from;
test-only changes to a transcription (a bound made a parameter, a config object replaced by arguments) are marked
"test-only". The test_reference_*.py files compare miles_trainer against them.

References:
- verl 0.9.1: verl/trainer/ppo/core_algos.py (agg_loss, compute_policy_loss_vanilla, compute_policy_loss_gspo,
  compute_value_loss, kl_penalty, kl_penalty_forward),
  verl/trainer/ppo/rollout_corr_helper.py (compute_rollout_correction_weights, _parse_rollout_is_threshold,
  compute_is_metrics), verl/trainer/ppo/metric_utils.py (compute_data_metrics: critic/vf_explained_var),
  verl/utils/torch_functional.py (masked_sum, masked_mean, masked_var, masked_whiten, clip_by_value,
  entropy_from_logits).
- verl 0.7.0: verl/trainer/ppo/core_algos.py (agg_loss "seq-mean-token-sum-norm" divided by L alone).
- verl 0.6.0: verl/trainer/ppo/mismatch_helper.py (compute_rollout_importance_weights: MIS lower bound 1 / upper).
"""

from __future__ import annotations

from typing import Any

import torch


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
