"""CPU numerics: miles_trainer's policy loss (PPO clip, clip-higher, dual-clip, GSPO, IS weights) against verl's
compute_policy_loss_vanilla / _gspo and TRL's GRPO loss types (with the vLLM IS ratio and the k3 KL term), and
kl_estimate against verl's kl_penalty and TRL's per_token_kl: values, gradients and metrics.

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
    TRL_COUNTS,
    TRL_IS_MODES,
    TRL_LOSS_TYPES,
    N,
    T,
    assert_close,
    gen,
    logprob_pair,
    miles_is_from_trl_mode,
    seq_advantages,
    token_advantages,
    trl_inputs,
    value_and_grad,
)
from reference_slime_losses import slime_compute_cispo_loss
from reference_trl import trl_grpo_compute_loss, trl_per_token_kl, trl_vllm_importance_sampling_ratio
from reference_verl_losses import (
    reference_agg,
    verl_kl_penalty,
    verl_masked_mean,
    verl_policy_loss_gspo_per_token,
    verl_policy_loss_vanilla_per_token,
)

from miles_trainer.config import AGGREGATION_MODES, KL_KINDS
from miles_trainer.importance import importance_weights
from miles_trainer.losses import aggregate_loss, cispo_loss, kl_estimate, policy_loss

# ======================================================================================== PPO policy loss vs verl

CLIPS = {
    "ppo": (0.2, 0.2, None),
    "clip-higher": (0.2, 0.28, None),
    "dual-clip": (0.2, 0.2, 3.0),
    "clip-higher+dual-clip": (0.1, 0.3, 10.0),
}
NO_DUAL_CLIP = 1e12  # verl always applies dual-clip (clip_ratio_c, default 3); a huge c switches it off


def _is_weights(seed: int) -> torch.Tensor:
    w = torch.rand(N, T, generator=gen(seed), dtype=F64) * 2.5
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

    value, grad = value_and_grad(miles, logp)
    ref_value, ref_grad = value_and_grad(verl, logp)
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

    value, grad = value_and_grad(miles, logp)
    ref_value, ref_grad = value_and_grad(verl, logp)
    assert_close(value, ref_value)
    assert_close(grad, ref_grad)
    assert_close(metrics["clip_fraction"], ref_metrics["pg_clipfrac"], rtol=1e-6)
    assert_close(metrics["ppo_kl"], ref_metrics["ppo_kl"], rtol=1e-5, atol=1e-6)  # a float32 metric


# ======================================================================================== GRPO losses vs TRL


@pytest.mark.parametrize("beta", [0.0, 0.04], ids=["beta0", "beta0.04"])
@pytest.mark.parametrize("vllm_is", [None, *TRL_IS_MODES], ids=["no-vllm-is", *TRL_IS_MODES])
@pytest.mark.parametrize("loss_type", list(TRL_LOSS_TYPES))
def test_policy_loss_matches_trl_grpo_loss_types(loss_type: str, vllm_is: str | None, beta: float) -> None:
    """TRL's per-token clipped loss x vLLM IS ratio + beta * k3, aggregated per loss_type, against Miles'
    policy_loss(is_weights_BT=importance_weights(...)) + beta * aggregate_loss(kl_estimate(k3)): value and grad."""
    logp, old, sampling, ref, adv = trl_inputs(30)
    mode, counts = TRL_LOSS_TYPES[loss_type]
    clip_max = 3.0
    trl_ratio = miles_w = None
    if vllm_is is not None:
        trl_ratio = trl_vllm_importance_sampling_ratio(old, sampling, MASK.to(F64), vllm_is, None, clip_max)
        level, is_mode = miles_is_from_trl_mode(vllm_is)
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

    value, grad = value_and_grad(miles, logp)
    ref_value, ref_grad = value_and_grad(trl, logp)
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
    logp, old, sampling, _, adv = trl_inputs(31)
    trl_ratio = miles_w = None
    if vllm_is is not None:
        trl_ratio = trl_vllm_importance_sampling_ratio(old, sampling, MASK.to(F64), vllm_is, None, 3.0)
        level, _ = miles_is_from_trl_mode(vllm_is)
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

    value, grad = value_and_grad(miles, logp)
    ref_value, ref_grad = value_and_grad(trl, logp)
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
    logp, old, _, ref, _ = trl_inputs(32)
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

    value, grad = value_and_grad(miles, logp)
    ref_value, ref_grad = value_and_grad(trl, logp)
    assert_close(value, ref_value)
    assert_close(grad, ref_grad)
    plain = aggregate_loss(kl_estimate(logp, ref, "k3"), MASK, "token-mean")
    assert_close(plain, trl(logp, bias_correction=False))
    assert not torch.isclose(plain, ref_value)


# ======================================================================================== KL estimators


def _kl_inputs() -> tuple[torch.Tensor, torch.Tensor]:
    """x = logp - ref over -30..30, including the clamp edges of k3 (ref - logp = ±20, k3 = 10)."""
    g = gen(40)
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
    weights = torch.rand(logp.shape, generator=gen(41), dtype=F64) + 0.5
    value, grad = value_and_grad(lambda x: (kl_estimate(x, ref, kind) * weights).sum(), logp)
    ref_value, ref_grad = value_and_grad(lambda x: (verl_kl_penalty(x, ref, kind) * weights).sum(), logp)
    assert_close(value, ref_value)
    assert_close(grad, ref_grad)
    assert_close(kl_estimate(logp, ref, kind), verl_kl_penalty(logp, ref, kind))


def test_kl_k3_matches_trl_per_token_kl_below_verl_clamps() -> None:
    """TRL's k3 has no clamp; Miles clamps as verl (documented in kl_estimate): they agree while k3 <= 10 and
    |ref - logp| <= 20, and differ beyond (k3 = 10 in Miles, e^5 - 6 in TRL at logp - ref = -5)."""
    logp, _, _, ref, _ = trl_inputs(42)
    value, grad = value_and_grad(lambda x: (kl_estimate(x, ref, "k3") * MASK).sum(), logp)
    ref_value, ref_grad = value_and_grad(lambda x: (trl_per_token_kl(x, ref) * MASK).sum(), logp)
    assert_close(value, ref_value)
    assert_close(grad, ref_grad)
    far_logp, far_ref = torch.tensor([-5.0], dtype=F64), torch.tensor([0.0], dtype=F64)
    assert kl_estimate(far_logp, far_ref, "k3").item() == 10.0
    assert_close(trl_per_token_kl(far_logp, far_ref), math.exp(5.0) - 6.0)


@pytest.mark.parametrize("with_is", [False, True], ids=["no-is", "is-weights"])
@pytest.mark.parametrize("clips", [(1.0, 0.2), (0.2, 0.28)], ids=["minimax-m1", "two-sided"])
@pytest.mark.parametrize("mode", AGGREGATION_MODES)
def test_cispo_loss_matches_slime(mode: str, clips: tuple[float, float], with_is: bool) -> None:
    """`cispo_loss` against slime's compute_cispo_loss (reference_slime_losses.py), aggregated as verl does: value,
    gradient (only through logp, weighted by the clipped ratio) and clip fraction. slime takes no log-ratio clamp:
    compared on log-ratios within ±20 (Miles clamps there, as its PPO loss does)."""
    clip_low, clip_high = clips
    logp, old = logprob_pair(30, extreme=False)
    adv = token_advantages(31)
    weights = _is_weights(32) if with_is else None
    mask = MASK.to(F64)
    metrics: dict[str, torch.Tensor] = {}

    def miles(x: torch.Tensor) -> torch.Tensor:
        loss, m = cispo_loss(x, old, adv, MASK, clip_low=clip_low, clip_high=clip_high, agg_mode=mode,
                             is_weights_BT=weights)  # fmt: skip
        metrics.update(m)
        return loss

    clipped: list[torch.Tensor] = []

    def slime(x: torch.Tensor) -> torch.Tensor:
        pg_losses, clipfrac = slime_compute_cispo_loss(old - x, x, adv, clip_low, clip_high)
        clipped.append(clipfrac)
        if weights is not None:  # slime's TIS multiplies the per-token loss by the weights
            pg_losses = pg_losses * weights
        return reference_agg(pg_losses, mask, mode)

    value, grad = value_and_grad(miles, logp)
    ref_value, ref_grad = value_and_grad(slime, logp)
    assert_close(value, ref_value)
    assert_close(grad, ref_grad)
    assert_close(metrics["clip_fraction"], verl_masked_mean(clipped[0], mask), rtol=1e-6)
    assert float(metrics["clip_fraction"]) > 0  # the clip is in play on these inputs


def test_cispo_keeps_the_gradient_of_clipped_tokens_where_ppo_drops_it() -> None:
    """A token far past the clip with A > 0: PPO-clip gives it no gradient, CISPO gives -A (1 + clip_high) per
    unit of logp (the clipped ratio as a constant weight)."""
    old = torch.tensor([[-3.0]], dtype=F64)
    adv = torch.tensor([[2.0]], dtype=F64)
    mask = torch.ones(1, 1, dtype=torch.bool)
    logp = torch.tensor([[-1.0]], dtype=F64)  # ratio e^2 > 1.2
    _, ppo_grad = value_and_grad(lambda x: policy_loss(x, old, adv, mask, agg_mode="token-sum")[0], logp)
    _, cispo_grad = value_and_grad(lambda x: cispo_loss(x, old, adv, mask, agg_mode="token-sum")[0], logp)
    assert float(ppo_grad) == 0.0
    assert_close(cispo_grad, torch.tensor([[-2.0 * 1.2]], dtype=F64))
    with pytest.raises(ValueError, match="token-level"):
        cispo_loss(logp, old, adv, mask, ratio_type="sequence")
