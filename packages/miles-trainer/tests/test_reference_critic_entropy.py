"""CPU numerics: miles_trainer's clipped value loss and explained variance (miles_trainer.critic) and
entropy_from_logits against verl's compute_value_loss, critic/vf_explained_var and entropy_from_logits.

The reference formulas are transcribed in reference_verl_losses.py (no verl import), the inputs are
reference_inputs.py's. Where Miles deliberately departs from a reference (its docstrings say so), the agreement is
tested where the two agree and the documented difference is asserted on an input where they differ.
"""

from __future__ import annotations

import math
import warnings

import pytest
import torch
from reference_inputs import F64, MASK, N, T, assert_close, gen, quantize, value_and_grad
from reference_verl_losses import verl_compute_value_loss, verl_entropy_from_logits, verl_vf_explained_var

from miles_trainer.config import AGGREGATION_MODES
from miles_trainer.critic import explained_variance, value_loss
from miles_trainer.losses import entropy_from_logits


@pytest.mark.parametrize("clip", [0.2, 0.5, None], ids=["clip0.2", "clip0.5", "no-clip"])
@pytest.mark.parametrize("mode", AGGREGATION_MODES)
def test_value_loss_matches_verl(mode: str, clip: float | None) -> None:
    g = gen(70)
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

    value, grad = value_and_grad(miles, vpreds)
    # clip=None is verl with an infinite clip range
    ref_value, ref_grad = value_and_grad(
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
    g = gen(71)
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
    g = gen(72)
    logits = quantize(torch.randn(3, 4, 16, generator=g, dtype=F64) * 3.0)
    logits[0, 0] = 0.0  # uniform
    logits[0, 1, 3] = 50.0  # p ~ 1 on one token, ~e^-50 elsewhere
    logits[1, 2] = quantize(torch.linspace(-50, 50, 16, dtype=F64))
    weights = torch.rand(3, 4, generator=g, dtype=F64)
    value, grad = value_and_grad(lambda x: (entropy_from_logits(x).double() * weights).sum(), logits.float())
    ref_value, ref_grad = value_and_grad(lambda x: (verl_entropy_from_logits(x) * weights).sum(), logits)
    assert_close(entropy_from_logits(logits.float()), verl_entropy_from_logits(logits), rtol=1e-5, atol=1e-5)
    assert_close(value, ref_value, rtol=1e-5)
    assert_close(grad, ref_grad, rtol=1e-5, atol=1e-6)


def test_entropy_of_a_banned_token_is_finite_where_verl_gives_nan() -> None:
    """Documented in entropy_from_logits: a -inf logit adds 0 (verl's p * logits is 0 * -inf = nan); the result is
    verl's entropy of the remaining tokens."""
    logits = torch.tensor([[2.0, -1.0, float("-inf"), 0.5]])
    assert torch.isnan(verl_entropy_from_logits(logits.double())).all()
    assert_close(entropy_from_logits(logits), verl_entropy_from_logits(logits[:, [0, 1, 3]].double()), rtol=1e-6)
