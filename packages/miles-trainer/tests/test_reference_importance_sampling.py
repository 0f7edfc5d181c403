"""CPU numerics: miles_trainer's importance weights (TIS / MIS / IcePop, token and sequence level, batch
normalization) against verl 0.9.1's compute_rollout_correction_weights, verl 0.6.0's
compute_rollout_importance_weights and TRL's vLLM importance-sampling ratio.

The reference formulas are transcribed in reference_verl_losses.py and reference_trl.py (no verl / TRL import), the
inputs are reference_inputs.py's. Where Miles deliberately departs from a reference (its docstrings say so), the
agreement is tested where the two agree and the documented difference is asserted on an input where they differ.
"""

from __future__ import annotations

import math

import pytest
import torch
from reference_inputs import (
    F64,
    MASK,
    TRL_IS_MODES,
    N,
    T,
    assert_close,
    gen,
    miles_is_from_trl_mode,
    quantize,
    trl_inputs,
)
from reference_trl import trl_vllm_importance_sampling_ratio
from reference_verl_losses import verl060_compute_rollout_importance_weights, verl_compute_rollout_correction_weights

from miles_trainer.config import IS_LEVELS, IS_MODES
from miles_trainer.importance import importance_weight_sums, importance_weights, normalize_importance_weights


def _is_inputs(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(old, rollout) quantized log-probs with token log-ratios up to ±50 and sequence sums beyond ±20."""
    g = gen(seed)
    rollout = quantize(-4.0 * torch.rand(N, T, generator=g, dtype=F64))
    old = rollout + quantize(0.6 * torch.randn(N, T, generator=g, dtype=F64))
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
    _, old, sampling, _, _ = trl_inputs(52)
    level, mode = miles_is_from_trl_mode(trl_mode)
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
