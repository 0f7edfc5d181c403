"""Importance weights that correct a non-zero train/rollout mismatch (TIS / MIS, verl's and TRL's): per token or per
sequence, truncated or masked, fed to `losses.policy_loss` as `is_weights_BT`; and verl's batch normalization of
them (`importance_weight_sums` over micro-batches and ranks, then `normalize_importance_weights`). Under true
on-policy every weight is exactly 1. The train step computes them once per batch (step.py, `mismatch_weights`).
Shapes: B sequences, T response tokens (padded)."""

from __future__ import annotations

import torch

from miles_trainer.config import IS_LEVELS, IS_MODES
from miles_trainer.losses import MAX_LOG_RATIO, check_same_shape, masked_mean

__all__ = ["importance_weight_sums", "importance_weights", "normalize_importance_weights"]


def importance_weights(
    old_logprobs_BT: torch.Tensor,
    rollout_logprobs_BT: torch.Tensor,
    mask_BT: torch.Tensor,
    *,
    level: str = "token",
    mode: str = "truncate",
    threshold: float = 2.0,
    threshold_low: float | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Importance weights pi_train / pi_rollout that correct a non-zero train/rollout mismatch (detached).

    old_logprobs are the trainer's log-probs under the weights that generated the samples; rollout_logprobs are
    the engine's. Raw weights (log-ratios clamped to [-20, 20] before exp):

        level "token":    w_t = exp(old_t - rollout_t)
        level "sequence": w_t = exp(sum_{t valid} (old_t - rollout_t))     (the same value on every token)
        mode "truncate" (TIS):  w = clamp(w, low, C)             C = threshold, low = threshold_low (default: none)
        mode "mask" (MIS):      w = w if low <= w <= C else 0    low = threshold_low, default 1 / C

    Masked tokens get weight 0. Under true on-policy old == rollout and every weight is exactly 1. Pass the
    result as `policy_loss(..., is_weights_BT=w)`, which multiplies it into the per-token loss after clipping.
    An MIS-rejected token still counts in the aggregation denominator (TRL); to drop it from the counts as well
    (verl's rejection sampling), use `mask & (w > 0)` as the loss mask (and in the global counts).
    The lower bounds follow the references: TRL 1.16 clamps TIS weights to [clip_min, clip_max] and MIS keeps
    [clip_min, clip_max] (no lower bound by default); verl 0.6's MIS defaults its lower bound to 1 / C.

    Metrics (over valid tokens; a sequence weight counts once per token): mean (of the returned weights),
    raw_max, raw_min, fraction_high (raw w > C), fraction_low (raw w < low), fraction_modified (weights changed
    by truncation or masking).
    """
    check_same_shape(old_logprobs_BT=old_logprobs_BT, rollout_logprobs_BT=rollout_logprobs_BT, mask_BT=mask_BT)
    if level not in IS_LEVELS:
        raise ValueError(f"unknown importance-weight level {level!r}; choose one of {list(IS_LEVELS)}")
    if mode not in IS_MODES:
        raise ValueError(f"unknown importance-weight mode {mode!r}; choose one of {list(IS_MODES)}")
    if threshold <= 0:
        raise ValueError(f"threshold (the upper bound C on the weights) must be > 0, got {threshold}")
    if threshold_low is not None and not 0 <= threshold_low <= threshold:
        raise ValueError(f"need 0 <= threshold_low <= threshold, got {threshold_low} and {threshold}")
    low = 1.0 / threshold if threshold_low is None else threshold_low

    with torch.no_grad():
        is_valid = mask_BT.bool()
        diff_BT = (old_logprobs_BT.float() - rollout_logprobs_BT.float()).masked_fill(~is_valid, 0.0)
        log_w_BT = diff_BT if level == "token" else diff_BT.sum(dim=-1, keepdim=True).expand_as(diff_BT)
        raw_BT = torch.exp(log_w_BT.clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)).masked_fill(~is_valid, 0.0)
        if mode == "truncate":
            weights_BT = raw_BT.clamp(min=threshold_low, max=threshold)
        else:
            is_kept = (raw_BT >= low) & (raw_BT <= threshold)
            weights_BT = torch.where(is_kept, raw_BT, torch.zeros_like(raw_BT))
        weights_BT = weights_BT.masked_fill(~is_valid, 0.0)
        has_valid = bool(is_valid.any())
        metrics = {
            "mean": masked_mean(weights_BT, is_valid),
            "raw_max": raw_BT.masked_fill(~is_valid, float("-inf")).amax() if has_valid else raw_BT.new_ones(()),
            "raw_min": raw_BT.masked_fill(~is_valid, float("inf")).amin() if has_valid else raw_BT.new_ones(()),
            "fraction_high": masked_mean((raw_BT > threshold).float(), is_valid),
            "fraction_low": masked_mean((raw_BT < low).float(), is_valid),
            "fraction_modified": masked_mean((weights_BT != raw_BT).float(), is_valid),
        }
    return weights_BT, metrics


def importance_weight_sums(
    weights_BT: torch.Tensor, mask_BT: torch.Tensor, level: str = "token"
) -> tuple[torch.Tensor, torch.Tensor]:
    """(sum, count) of the weights whose ratio is their batch mean, for verl's batch normalization: over valid
    tokens (level "token"), or one weight per sequence with a valid token (level "sequence"). Sum these over
    micro-batches and ranks, then pass sum / count to `normalize_importance_weights`."""
    check_same_shape(weights_BT=weights_BT, mask_BT=mask_BT)
    is_valid = mask_BT.bool()
    weights = torch.where(is_valid, weights_BT.double(), torch.zeros_like(weights_BT, dtype=torch.float64))
    if level == "token":
        return weights.sum(), is_valid.sum().double()
    has_valid_B = is_valid.any(dim=-1)
    # a sequence weight is the same on every valid token: its mean over them
    per_seq_B = weights.sum(dim=-1) / is_valid.sum(dim=-1).clamp(min=1)
    return per_seq_B.sum(), has_valid_B.sum().double()


def normalize_importance_weights(weights_BT: torch.Tensor, batch_mean: float | torch.Tensor) -> torch.Tensor:
    """Weights divided by their batch mean so they average 1 (verl 0.9.1 `rollout_corr_helper.
    compute_rollout_correction_weights`, rollout_is_batch_normalize); a mean <= 1e-8 leaves them as they are."""
    mean = float(batch_mean)
    return weights_BT / mean if mean > 1e-8 else weights_BT
