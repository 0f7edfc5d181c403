"""Pure logic / CPU numerics: loss aggregation, PPO / DAPO / dual-clip / GSPO policy loss (values and autograd
gradients at the clip boundaries), KL estimators, entropy, SFT loss and the train/rollout
mismatch metric, against hand-computed values and TRL's GRPOTrainer formulas written out inline."""

import math

import pytest
import torch

from miles_trainer.losses import (
    AGGREGATION_MODES,
    aggregate_loss,
    entropy_bonus_loss,
    entropy_from_logits,
    kl_estimate,
    policy_loss,
    sft_loss,
    train_rollout_logprob_abs_diff,
)

LOSS = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 0.0]])
MASK = torch.tensor([[1, 1, 1], [1, 1, 0]])


# ---------------------------------------------------------------- aggregation


@pytest.mark.parametrize(
    ("mode", "expected"),
    [
        ("token-mean", 15 / 5),
        ("seq-mean-token-mean", (6 / 3 + 9 / 2) / 2),
        ("seq-mean-token-sum", (6 + 9) / 2),
        ("seq-mean-token-sum-norm", (6 + 9) / (2 * 3)),
    ],
)
def test_aggregate_hand_values(mode: str, expected: float) -> None:
    assert aggregate_loss(LOSS, MASK, mode).item() == pytest.approx(expected)
    # a fully masked row is neither a token nor a sequence
    loss = torch.cat([LOSS, torch.tensor([[7.0, 7.0, 7.0]])])
    mask = torch.cat([MASK, torch.zeros(1, 3, dtype=MASK.dtype)])
    assert aggregate_loss(loss, mask, mode).item() == pytest.approx(expected)


def test_aggregate_explicit_normalizers() -> None:
    assert aggregate_loss(LOSS, MASK, "seq-mean-token-sum-norm", max_response_len=5).item() == pytest.approx(1.5)
    assert aggregate_loss(LOSS, MASK, "token-mean", global_num_tokens=10).item() == pytest.approx(1.5)
    assert aggregate_loss(LOSS, MASK, "seq-mean-token-sum", global_num_seqs=5).item() == pytest.approx(3.0)
    assert aggregate_loss(LOSS, MASK.bool(), "seq-mean-token-mean", global_num_seqs=torch.tensor(4.0)).item() == (
        pytest.approx(6.5 / 4)
    )
    empty = aggregate_loss(LOSS.clone().requires_grad_(), torch.zeros_like(MASK), "seq-mean-token-mean")
    assert empty.item() == 0.0
    # padding holding -log 0 = inf does not leak into the loss or its gradient
    padded = LOSS.clone()
    padded[1, 2] = float("inf")
    padded.requires_grad_()
    loss = aggregate_loss(padded, MASK, "token-mean")
    loss.backward()
    assert loss.item() == pytest.approx(3.0)
    assert padded.grad is not None and torch.equal(padded.grad, MASK / 5)


def _random_batch(dtype: torch.dtype, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    gen = torch.Generator().manual_seed(seed)
    lengths = [5, 1, 8, 3, 0, 8, 6]  # one empty row (e.g. a prompt-only sample)
    max_len = 8
    loss = torch.randn(len(lengths), max_len, generator=gen, dtype=dtype)
    mask = torch.arange(max_len).unsqueeze(0) < torch.tensor(lengths).unsqueeze(1)
    return loss, mask, lengths


@pytest.mark.parametrize("mode", AGGREGATION_MODES)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_micro_batches_with_global_counts_sum_to_full_batch(mode: str, dtype: torch.dtype) -> None:
    loss, mask, lengths = _random_batch(dtype)
    max_len = loss.shape[1]
    num_tokens = int(mask.sum())
    num_seqs = sum(1 for n in lengths if n > 0)

    full_leaf = loss.clone().requires_grad_()
    full = aggregate_loss(full_leaf, mask, mode, max_response_len=max_len)
    full.backward()

    split_leaf = loss.clone().requires_grad_()
    total: torch.Tensor = torch.zeros((), dtype=dtype)
    for start, stop in [(0, 2), (2, 5), (5, 6), (6, 7)]:  # uneven micro-batches, as a token-budget packer makes
        rows = slice(start, stop)
        width = max(1, max(lengths[rows]))  # each micro-batch trimmed to its own padded width
        part = aggregate_loss(
            split_leaf[rows, :width],
            mask[rows, :width],
            mode,
            global_num_tokens=num_tokens,
            global_num_seqs=num_seqs,
            max_response_len=max_len,
        )
        total = total + part
    total.backward()
    tol = 1e-12 if dtype == torch.float64 else 1e-6
    torch.testing.assert_close(total, full, rtol=0, atol=tol)
    assert split_leaf.grad is not None and full_leaf.grad is not None
    torch.testing.assert_close(split_leaf.grad, full_leaf.grad, rtol=0, atol=1e-7)


def test_aggregation_reproduces_trl_loss_types() -> None:
    """TRL GRPOTrainer's loss_type formulas (trl/trainer/grpo_trainer.py), written out, vs aggregate_loss."""
    loss, mask, _ = _random_batch(torch.float64, seed=3)
    batch_size = loss.shape[0]
    max_completion_length = 12
    m = mask.double()
    trl_grpo = ((loss * m).sum(-1) / m.sum(-1).clamp(min=1.0)).mean()
    trl_bnpo = (loss * m).sum() / m.sum().clamp(min=1.0)
    trl_dr_grpo = (loss * m).sum() / (batch_size * max_completion_length)
    # TRL "grpo" averages over every row, empty ones included: pass the row count as the sequence count.
    torch.testing.assert_close(aggregate_loss(loss, mask, "seq-mean-token-mean", global_num_seqs=batch_size), trl_grpo)
    torch.testing.assert_close(aggregate_loss(loss, mask, "token-mean"), trl_bnpo)
    dr = aggregate_loss(
        loss, mask, "seq-mean-token-sum-norm", global_num_seqs=batch_size, max_response_len=max_completion_length
    )
    torch.testing.assert_close(dr, trl_dr_grpo)


def test_aggregate_bad_arguments() -> None:
    with pytest.raises(ValueError, match="seq-mean-token-sum-norm"):
        aggregate_loss(LOSS, MASK, "sum")
    with pytest.raises(ValueError, match="max_response_len"):
        aggregate_loss(LOSS, MASK, "seq-mean-token-sum-norm", global_num_seqs=4)
    with pytest.raises(ValueError, match="global_num_tokens"):
        aggregate_loss(LOSS, MASK, "token-mean", global_num_tokens=0)
    with pytest.raises(ValueError, match=r"\(B, T\)"):
        aggregate_loss(LOSS, MASK[:, :2], "token-mean")


# ---------------------------------------------------------------- policy loss


def _one_token_loss(ratio: float, advantage: float, **kwargs: object) -> tuple[float, float, dict[str, torch.Tensor]]:
    """(loss, d loss / d logprob, metrics) for one valid token with old log-prob 0."""
    logprobs = torch.tensor([[math.log(ratio)]], dtype=torch.float64, requires_grad=True)
    loss, metrics = policy_loss(
        logprobs,
        torch.zeros(1, 1, dtype=torch.float64),
        torch.tensor([[advantage]], dtype=torch.float64),
        torch.ones(1, 1),
        **kwargs,  # type: ignore[arg-type]  # the keyword arguments of policy_loss, passed through
    )
    loss.backward()
    assert logprobs.grad is not None
    return loss.item(), logprobs.grad.item(), metrics


@pytest.mark.parametrize(
    ("ratio", "advantage", "loss", "grad", "clipped"),
    [
        (1.5, 1.0, -1.2, 0.0, True),  # A > 0, r > 1 + eps: clipped, no gradient
        (1.1, 1.0, -1.1, -1.1, False),  # inside the trust region: -A r, gradient -A r
        (0.5, 1.0, -0.5, -0.5, False),  # A > 0, r < 1 - eps: not clipped (PPO's min keeps pushing r up)
        (1.5, -1.0, 1.5, 1.5, False),  # A < 0, r > 1 + eps: not clipped (no dual clip)
        (0.5, -1.0, 0.8, 0.0, True),  # A < 0, r < 1 - eps: clipped, no gradient
    ],
)
def test_ppo_clip_hand_values_and_gradients(
    ratio: float, advantage: float, loss: float, grad: float, clipped: bool
) -> None:
    value, gradient, metrics = _one_token_loss(ratio, advantage)
    assert value == pytest.approx(loss)
    assert gradient == pytest.approx(grad)
    assert metrics["clip_fraction"].item() == float(clipped)
    assert metrics["clip_fraction_high"].item() == float(clipped and advantage > 0)
    assert metrics["clip_fraction_low"].item() == float(clipped and advantage < 0)
    assert metrics["ratio_mean"].item() == pytest.approx(ratio)
    assert metrics["ppo_kl"].item() == pytest.approx(-math.log(ratio))


def test_clip_boundaries_and_clip_higher() -> None:
    # just above / below 1 + clip_high with A > 0
    assert _one_token_loss(1.2 + 1e-6, 1.0)[1] == 0.0
    assert _one_token_loss(1.2 - 1e-6, 1.0)[1] == pytest.approx(-(1.2 - 1e-6))
    # just below / above 1 - clip_low with A < 0
    assert _one_token_loss(0.8 - 1e-6, -1.0)[1] == 0.0
    assert _one_token_loss(0.8 + 1e-6, -1.0)[1] == pytest.approx(0.8 + 1e-6)
    # DAPO clip-higher: r = 1.25 is clipped at 0.2 but not at clip_high = 0.28; the low side is unchanged
    assert _one_token_loss(1.25, 1.0)[1] == 0.0
    assert _one_token_loss(1.25, 1.0, clip_high=0.28)[1] == pytest.approx(-1.25)
    assert _one_token_loss(1.3, 1.0, clip_high=0.28)[:2] == pytest.approx((-1.28, 0.0))
    assert _one_token_loss(0.75, -1.0, clip_high=0.28)[:2] == pytest.approx((0.8, 0.0))


def test_dual_clip_caps_the_loss_of_negative_advantages() -> None:
    # A = -1, r = 5: PPO loss max(5, 1.2) = 5, dual-clip c = 3 caps it at 3, with no gradient
    loss, grad, metrics = _one_token_loss(5.0, -1.0, dual_clip=3.0)
    assert (loss, grad) == pytest.approx((3.0, 0.0))
    assert metrics["dual_clip_fraction"].item() == 1.0
    assert _one_token_loss(5.0, -1.0)[:2] == pytest.approx((5.0, 5.0))  # without dual clip
    # below the cap nothing changes
    loss, grad, metrics = _one_token_loss(2.0, -1.0, dual_clip=3.0)
    assert (loss, grad) == pytest.approx((2.0, 2.0))
    assert metrics["dual_clip_fraction"].item() == 0.0
    # positive advantages are never dual-clipped
    assert _one_token_loss(5.0, 1.0, dual_clip=3.0)[:2] == pytest.approx((-1.2, 0.0))
    with pytest.raises(ValueError, match="dual_clip must be > 1"):
        _one_token_loss(1.0, 1.0, dual_clip=1.0)


def test_policy_loss_batch_hand_values_and_metrics() -> None:
    ratios = torch.tensor([[1.5, 1.0, 0.5], [0.5, 2.0, 9.0]])
    advantages = torch.tensor([[1.0, 1.0, 1.0], [-1.0, -2.0, 100.0]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    old = torch.full((2, 3), -1.0)
    logprobs = old + ratios.log()
    logprobs[1, 2] = float("nan")  # padding may hold anything
    logprobs.requires_grad_()
    loss, metrics = policy_loss(logprobs, old, advantages, mask, dual_clip=3.0)
    loss.backward()
    assert logprobs.grad is not None and torch.isfinite(logprobs.grad).all()
    # token losses: -1.2 (clipped), -1, -0.5 | 0.8 (clipped), min(max(4, 2.4), 6) = 4
    assert loss.item() == pytest.approx((-1.2 - 1.0 - 0.5 + 0.8 + 4.0) / 5)
    assert metrics["clip_fraction"].item() == pytest.approx(2 / 5)
    assert metrics["clip_fraction_high"].item() == pytest.approx(1 / 5)
    assert metrics["clip_fraction_low"].item() == pytest.approx(1 / 5)
    assert metrics["dual_clip_fraction"].item() == 0.0
    assert metrics["ratio_max"].item() == pytest.approx(2.0)
    assert metrics["ratio_mean"].item() == pytest.approx((1.5 + 1.0 + 0.5 + 0.5 + 2.0) / 5)
    assert metrics["ppo_kl"].item() == pytest.approx(-float(ratios.log()[mask.bool()].mean()))


def test_policy_loss_matches_trl_per_token_loss() -> None:
    """TRL's GRPO per-token loss -min(r A, clip(r, 1 - eps_low, 1 + eps_high) A), with loss_type="bnpo"."""
    gen = torch.Generator().manual_seed(5)
    logprobs = -torch.rand(4, 6, generator=gen, dtype=torch.float64) * 3
    old = logprobs + 0.3 * torch.randn(4, 6, generator=gen, dtype=torch.float64)
    advantages = torch.randn(4, 1, generator=gen, dtype=torch.float64).expand(4, 6)
    mask = torch.rand(4, 6, generator=gen) > 0.3
    coef_1 = torch.exp(logprobs - old)
    coef_2 = torch.clamp(coef_1, 1 - 0.2, 1 + 0.28)
    per_token = -torch.min(coef_1 * advantages, coef_2 * advantages)
    trl_bnpo = (per_token * mask).sum() / mask.sum().clamp(min=1.0)
    ours, _ = policy_loss(logprobs, old, advantages, mask, clip_low=0.2, clip_high=0.28)
    torch.testing.assert_close(ours, trl_bnpo)


def test_importance_weights_multiply_the_token_loss() -> None:
    logprobs = torch.log(torch.tensor([[1.1, 1.0]], dtype=torch.float64)).requires_grad_()
    old = torch.zeros(1, 2, dtype=torch.float64)
    adv = torch.ones(1, 2, dtype=torch.float64)
    weights = torch.tensor([[0.5, 2.0]], dtype=torch.float64)
    loss, _ = policy_loss(logprobs, old, adv, torch.ones(1, 2), is_weights_BT=weights)
    assert loss.item() == pytest.approx((0.5 * -1.1 + 2.0 * -1.0) / 2)
    loss.backward()
    assert logprobs.grad is not None
    torch.testing.assert_close(logprobs.grad, torch.tensor([[-0.5 * 1.1 / 2, -2.0 / 2]], dtype=torch.float64))


# ---------------------------------------------------------------- GSPO


def test_gspo_sequence_ratio_is_shared_and_clipped_per_sequence() -> None:
    # row 0: per-token log-ratios (0, 2 log 1.5): sequence ratio exp(log 1.5) = 1.5 > 1.2 with A > 0 -> the whole
    # sequence is clipped, even its first token whose own ratio is 1. Row 1: log-ratios (0.1, -0.1, pad): s = 1.
    lr = torch.tensor([[0.0, 2 * math.log(1.5), 0.0], [0.1, -0.1, 5.0]], dtype=torch.float64)
    old = torch.full((2, 3), -2.0, dtype=torch.float64)
    mask = torch.tensor([[1, 1, 0], [1, 1, 0]])
    adv = torch.ones(2, 3, dtype=torch.float64)

    logprobs = (old + lr).requires_grad_()
    loss, metrics = policy_loss(logprobs, old, adv, mask, ratio_type="sequence", agg_mode="seq-mean-token-mean")
    loss.backward()
    assert logprobs.grad is not None
    # loss: row 0 clipped at -1.2 per token, row 1 at -1 per token; seq-mean-token-mean = (-1.2 - 1) / 2
    assert loss.item() == pytest.approx(-1.1)
    # gradient: 0 on row 0; -A * s / (n_i * num_seqs) = -1 / (2 * 2) on row 1's valid tokens
    expected_grad = torch.tensor([[0.0, 0.0, 0.0], [-0.25, -0.25, 0.0]], dtype=torch.float64)
    torch.testing.assert_close(logprobs.grad, expected_grad)
    assert metrics["ratio_max"].item() == pytest.approx(1.5)  # every token of row 0 carries 1.5
    assert metrics["ratio_mean"].item() == pytest.approx((1.5 + 1.5 + 1.0 + 1.0) / 4)
    assert metrics["clip_fraction"].item() == pytest.approx(0.5)

    # the token ratio would let row 0's first token (ratio 1) through
    token_lp = (old + lr).requires_grad_()
    policy_loss(token_lp, old, adv, mask, agg_mode="seq-mean-token-mean")[0].backward()
    assert token_lp.grad is not None and token_lp.grad[0, 0].item() != 0.0


def test_gspo_gradient_matches_trl_sequence_level() -> None:
    """TRL importance_sampling_level="sequence" (the sequence ratio broadcast over tokens, loss_type="grpo") and
    our straight-through token form give the same gradient for sequence-level advantages."""
    gen = torch.Generator().manual_seed(7)
    base = -torch.rand(3, 5, generator=gen, dtype=torch.float64)
    old = base + 0.05 * torch.randn(3, 5, generator=gen, dtype=torch.float64)
    adv = torch.tensor([[0.7], [-1.3], [0.4]], dtype=torch.float64).expand(3, 5)
    mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0], [1, 0, 0, 0, 0]]).bool()

    trl_lp = base.clone().requires_grad_()
    log_w = ((trl_lp - old) * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)
    coef_1 = torch.exp(log_w).unsqueeze(-1)
    coef_2 = torch.clamp(coef_1, 1 - 0.2, 1 + 0.2)
    per_token = -torch.min(coef_1 * adv, coef_2 * adv)
    trl_loss: torch.Tensor = ((per_token * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).mean()
    trl_loss.backward()

    our_lp = base.clone().requires_grad_()
    ours, _ = policy_loss(our_lp, old, adv, mask, ratio_type="sequence", agg_mode="seq-mean-token-mean")
    ours.backward()
    torch.testing.assert_close(ours, trl_loss)
    assert trl_lp.grad is not None and our_lp.grad is not None
    torch.testing.assert_close(our_lp.grad, trl_lp.grad)


def test_policy_loss_bad_arguments() -> None:
    x = torch.zeros(1, 2)
    with pytest.raises(ValueError, match="'token', 'sequence'"):
        policy_loss(x, x, x, x, ratio_type="seq")
    with pytest.raises(ValueError, match="clip_low"):
        policy_loss(x, x, x, x, clip_low=1.5)
    with pytest.raises(ValueError, match="token-mean"):
        policy_loss(x, x, x, x, agg_mode="mean")
    with pytest.raises(ValueError, match="is_weights_BT"):
        policy_loss(x, x, x, x, is_weights_BT=torch.ones(2, 2))


# ---------------------------------------------------------------- KL, entropy, SFT


def test_kl_estimators_hand_values() -> None:
    logp = torch.tensor([math.log(0.5)])
    ref = torch.tensor([math.log(0.25)])
    ln2 = math.log(2.0)
    assert kl_estimate(logp, ref, "k1").item() == pytest.approx(ln2)
    assert kl_estimate(logp, ref, "k2").item() == pytest.approx(0.5 * ln2**2)
    # k3 = exp(ref - logp) - (ref - logp) - 1 = 0.5 + ln 2 - 1
    assert kl_estimate(logp, ref, "k3").item() == pytest.approx(0.5 + ln2 - 1.0)
    # the other direction: logp < ref
    assert kl_estimate(ref, logp, "k3").item() == pytest.approx(2.0 - ln2 - 1.0)
    assert kl_estimate(ref, logp, "k1").item() == pytest.approx(-ln2)


def test_k3_is_non_negative_clamped_and_matches_trl() -> None:
    gen = torch.Generator().manual_seed(11)
    logp = torch.randn(1000, generator=gen) * 3
    ref = torch.randn(1000, generator=gen) * 3
    k3 = kl_estimate(logp, ref, "k3")
    assert torch.all(k3 >= 0)
    assert torch.all(kl_estimate(logp, ref, "k2") >= 0)
    trl = torch.exp(ref - logp) - (ref - logp) - 1  # TRL GRPOTrainer's per_token_kl
    in_range = trl <= 10
    torch.testing.assert_close(k3[in_range], trl[in_range])
    assert kl_estimate(torch.tensor([0.0]), torch.tensor([30.0]), "k3").item() == 10.0
    assert torch.equal(kl_estimate(logp, ref, "low_var_kl"), k3)  # verl's name
    with pytest.raises(ValueError, match="low_var_kl"):
        kl_estimate(logp, ref, "k4")


@pytest.mark.parametrize("kind", ["k1+", "k3+", "low_var_kl+", "abs+"])
def test_straight_through_kl_has_the_estimators_value_and_k2s_gradient(kind: str) -> None:
    gen = torch.Generator().manual_seed(12)
    ref = torch.randn(50, generator=gen)
    logp = torch.randn(50, generator=gen).requires_grad_(True)
    value = kl_estimate(logp, ref, kind)
    torch.testing.assert_close(value, kl_estimate(logp, ref, kind.removesuffix("+")), rtol=0, atol=1e-6)
    (grad,) = torch.autograd.grad(value.sum(), logp)
    torch.testing.assert_close(grad, (logp - ref).detach())  # d/dx x^2 / 2
    assert torch.equal(kl_estimate(logp, ref, "abs"), (logp - ref).abs())


def test_entropy_from_logits() -> None:
    logits = torch.tensor([[[0.0, 0.0, 0.0, 0.0], [0.0, math.log(3.0), -math.inf, -math.inf]]])
    logits = logits.requires_grad_()
    entropy = entropy_from_logits(logits)
    # uniform over 4: ln 4; p = (1/4, 3/4): -(1/4 ln 1/4 + 3/4 ln 3/4)
    expected = torch.tensor([[math.log(4.0), -(0.25 * math.log(0.25) + 0.75 * math.log(0.75))]])
    torch.testing.assert_close(entropy, expected)
    entropy.sum().backward()
    assert logits.grad is not None and torch.isfinite(logits.grad).all()
    # large logits stay finite; bf16 in, fp32 out
    big = torch.tensor([[1e4, 1e4 + math.log(3.0)]], dtype=torch.float32)
    torch.testing.assert_close(entropy_from_logits(big), expected[:, 1:].reshape(1))
    assert entropy_from_logits(torch.zeros(2, 3, 5, dtype=torch.bfloat16)).dtype == torch.float32
    torch.testing.assert_close(entropy_from_logits(torch.zeros(2, 3, 5)), torch.full((2, 3), math.log(5.0)))


def test_entropy_bonus_and_sft_loss() -> None:
    entropy = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
    assert entropy_bonus_loss(entropy, MASK, 0.01).item() == pytest.approx(-0.01 * 15 / 5)
    logprobs = torch.log(torch.tensor([[0.5, 0.25, 1.0], [0.125, 1.0, 0.3]]))
    # NLL: ln 2 + ln 4 + 0 + ln 8 + 0 = 6 ln 2 over 5 tokens
    assert sft_loss(logprobs, MASK).item() == pytest.approx(6 * math.log(2.0) / 5)
    assert sft_loss(logprobs, MASK, "seq-mean-token-sum").item() == pytest.approx(6 * math.log(2.0) / 2)


# ---------------------------------------------------------------- mismatch metric


def test_mismatch_is_exactly_zero_for_identical_logprobs() -> None:
    gen = torch.Generator().manual_seed(13)
    logprobs = -torch.rand(4, 16, generator=gen) * 20  # float32, as the engine sends them
    mask = torch.rand(4, 16, generator=gen) > 0.2
    out = train_rollout_logprob_abs_diff(logprobs, logprobs.clone(), mask)
    assert out["mean"].item() == 0.0
    assert out["max"].item() == 0.0
    assert out["mean"].dtype == torch.float64
    assert out["num_tokens"].item() == int(mask.sum())


def test_mismatch_hand_values_ignore_padding() -> None:
    train = torch.tensor([[-1.0, -2.0, -3.0], [-0.5, 0.0, 100.0]])
    rollout = torch.tensor([[-1.0, -2.5, -2.75], [-0.25, 0.0, float("nan")]])
    out = train_rollout_logprob_abs_diff(train, rollout, MASK)
    # |diff| on valid tokens: 0, 0.5, 0.25, 0.25, 0 (the last column of row 1 is padding)
    assert out["mean"].item() == pytest.approx(1.0 / 5)
    assert out["max"].item() == 0.5
    one_ulp = torch.tensor([[-1.0]]).nextafter(torch.tensor([[0.0]]))
    tiny = train_rollout_logprob_abs_diff(torch.tensor([[-1.0]]), one_ulp, torch.ones(1, 1))
    assert tiny["max"].item() == 2.0**-24  # one float32 ulp below 1 is seen, not rounded away
    empty = train_rollout_logprob_abs_diff(train, rollout, torch.zeros_like(MASK))
    assert (empty["mean"].item(), empty["max"].item()) == (0.0, 0.0)


def test_policy_loss_on_an_all_masked_micro_batch_is_zero() -> None:
    logprobs = torch.full((2, 3), -1.0, requires_grad=True)
    loss, metrics = policy_loss(logprobs, torch.zeros(2, 3), torch.ones(2, 3), torch.zeros(2, 3))
    loss.backward()
    assert loss.item() == 0.0
    assert logprobs.grad is not None and torch.equal(logprobs.grad, torch.zeros(2, 3))
    assert all(value.item() == 0.0 for value in metrics.values())


def test_the_cispo_surrogate_is_chosen_by_config_and_refuses_what_it_does_not_take() -> None:
    from miles_trainer.config import PolicyLossConfig
    from miles_trainer.losses import cispo_loss
    from miles_trainer.step import resolve_loss_fn

    assert resolve_loss_fn(None, "cispo") is cispo_loss and resolve_loss_fn(None) is policy_loss
    assert PolicyLossConfig(surrogate="cispo", clip_low=1.0).clip_low == 1.0
    for given in ({"dual_clip": 3.0}, {"ratio_type": "sequence"}):
        with pytest.raises(ValueError, match="surrogate=cispo is a token-level loss"):
            PolicyLossConfig(surrogate="cispo", **given)
