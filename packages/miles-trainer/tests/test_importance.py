"""Pure logic / CPU numerics: the TIS / MIS importance weights (token and sequence level, truncated or masked) against
hand-computed values, exactly 1 under true on-policy, and their argument errors. Against verl's and TRL's formulas:
test_reference_importance_sampling.py."""

import pytest
import torch

from miles_trainer.importance import importance_weights


def _crafted_weights() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    # token weights exp(old - rollout): (3, 0.25, 1, 1.5 | 0.6, 1.2, pad)
    ratios = torch.tensor([[3.0, 0.25, 1.0, 1.5], [0.6, 1.2, 1.0, 1.0]])
    rollout = torch.full((2, 4), -1.5)
    old = rollout + ratios.log()
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0]])
    return old, rollout, mask


def test_tis_token_truncates() -> None:
    old, rollout, mask = _crafted_weights()
    weights, metrics = importance_weights(old, rollout, mask)
    expected = torch.tensor([[2.0, 0.25, 1.0, 1.5], [0.6, 1.2, 0.0, 0.0]])
    torch.testing.assert_close(weights, expected)
    assert metrics["fraction_high"].item() == pytest.approx(1 / 6)
    assert metrics["fraction_low"].item() == pytest.approx(1 / 6)  # 0.25 < 1 / 2
    assert metrics["fraction_modified"].item() == pytest.approx(1 / 6)
    assert metrics["raw_max"].item() == pytest.approx(3.0)
    assert metrics["raw_min"].item() == pytest.approx(0.25)
    assert metrics["mean"].item() == pytest.approx((2 + 0.25 + 1 + 1.5 + 0.6 + 1.2) / 6)


def test_mis_token_masks_outside_the_band() -> None:
    old, rollout, mask = _crafted_weights()
    weights, metrics = importance_weights(old, rollout, mask, mode="mask")  # band [1/2, 2]
    torch.testing.assert_close(weights, torch.tensor([[0.0, 0.0, 1.0, 1.5], [0.6, 1.2, 0.0, 0.0]]))
    assert metrics["fraction_modified"].item() == pytest.approx(2 / 6)
    weights, _ = importance_weights(old, rollout, mask, mode="mask", threshold=1.3, threshold_low=0.7)
    torch.testing.assert_close(weights, torch.tensor([[0.0, 0.0, 1.0, 0.0], [0.0, 1.2, 0.0, 0.0]]))


def test_sequence_level_weights() -> None:
    old, rollout, mask = _crafted_weights()
    # row 0: 3 * 0.25 * 1 * 1.5 = 1.125; row 1: 0.6 * 1.2 = 0.72
    weights, _ = importance_weights(old, rollout, mask, level="sequence")
    torch.testing.assert_close(weights, torch.tensor([[1.125] * 4, [0.72, 0.72, 0.0, 0.0]]))
    weights, _ = importance_weights(old, rollout, mask, level="sequence", mode="mask", threshold=1.1)
    torch.testing.assert_close(weights, torch.tensor([[0.0] * 4, [0.0, 0.0, 0.0, 0.0]]))  # 0.72 < 1 / 1.1
    weights, _ = importance_weights(old, rollout, mask, level="sequence", mode="mask", threshold=1.2)
    torch.testing.assert_close(weights, torch.tensor([[1.125] * 4, [0.0, 0.0, 0.0, 0.0]]))


def test_true_on_policy_weights_are_exactly_one_and_detached() -> None:
    old = torch.randn(3, 5, requires_grad=True)
    mask = torch.ones(3, 5)
    for level in ("token", "sequence"):
        for mode in ("truncate", "mask"):
            weights, metrics = importance_weights(old, old.detach().clone(), mask, level=level, mode=mode)
            assert not weights.requires_grad
            assert torch.equal(weights, torch.ones(3, 5))
            assert metrics["fraction_modified"].item() == 0.0


def test_importance_weights_bad_arguments() -> None:
    old, rollout, mask = _crafted_weights()
    with pytest.raises(ValueError, match="'truncate', 'mask'"):
        importance_weights(old, rollout, mask, mode="clip")
    with pytest.raises(ValueError, match="'token', 'sequence'"):
        importance_weights(old, rollout, mask, level="geometric")
    with pytest.raises(ValueError, match="threshold_low <= threshold"):
        importance_weights(old, rollout, mask, threshold=2.0, threshold_low=3.0)
    with pytest.raises(ValueError, match="threshold"):
        importance_weights(old, rollout, mask, threshold=0.0)
