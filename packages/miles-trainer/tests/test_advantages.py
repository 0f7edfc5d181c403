"""Pure logic / CPU numerics: advantage estimators against hand-computed values and the published formulas
(GRPO, Dr.GRPO, RLOO, REINFORCE++, REINFORCE++-baseline, GAE), plus the dispatch table."""

import math

import pytest
import torch

from miles_trainer.advantages import (
    ADVANTAGE_ESTIMATORS,
    compute_advantages,
    dr_grpo_advantages,
    expand_to_tokens,
    gae_advantages,
    grpo_advantages,
    reinforce_plus_plus_advantages,
    reinforce_plus_plus_baseline_advantages,
    rloo_advantages,
)

# Three groups, interleaved: group 0 = rewards (1, 2, 3), group 1 = (1, 3), group 2 = (5,) alone.
REWARDS = torch.tensor([1.0, 1.0, 2.0, 5.0, 3.0, 3.0])
GROUPS = torch.tensor([0, 1, 0, 2, 1, 0])


def test_grpo_hand_values() -> None:
    # group 0: mean 2, unbiased std sqrt((1 + 0 + 1) / 2) = 1; group 1: mean 2, std sqrt((1 + 1) / 1) = sqrt(2)
    eps = 1e-6
    s2 = math.sqrt(2.0)
    expected = torch.tensor([-1 / (1 + eps), -1 / (s2 + eps), 0.0, 0.0, 1 / (s2 + eps), 1 / (1 + eps)])
    torch.testing.assert_close(grpo_advantages(REWARDS, GROUPS), expected)
    assert grpo_advantages(REWARDS, GROUPS).dtype == torch.float32


def test_grpo_singleton_and_constant_groups_get_zero() -> None:
    adv = grpo_advantages(torch.tensor([7.0, 1.0, 1.0, 1.0]), torch.tensor([3, 4, 4, 4]))
    assert torch.equal(adv, torch.zeros(4))


def test_dr_grpo_hand_values_and_equivalence_with_grpo() -> None:
    expected = torch.tensor([-1.0, -1.0, 0.0, 0.0, 1.0, 1.0])
    torch.testing.assert_close(dr_grpo_advantages(REWARDS, GROUPS), expected)
    torch.testing.assert_close(grpo_advantages(REWARDS, GROUPS, scale_rewards="none"), expected)
    # GRPO = Dr.GRPO / (std + eps), group by group
    std = torch.tensor([1.0, math.sqrt(2.0), 1.0, 1.0, math.sqrt(2.0), 1.0])
    torch.testing.assert_close(grpo_advantages(REWARDS, GROUPS, epsilon=0.0) * std, expected)


def test_rloo_hand_values() -> None:
    # group 0: 1 - (2+3)/2 = -1.5, 2 - (1+3)/2 = 0, 3 - (1+2)/2 = 1.5; group 1: 1 - 3 = -2, 3 - 1 = 2; singleton: 0
    expected = torch.tensor([-1.5, -2.0, 0.0, 0.0, 2.0, 1.5])
    torch.testing.assert_close(rloo_advantages(REWARDS, GROUPS), expected)


def test_rloo_is_n_over_n_minus_1_times_dr_grpo() -> None:
    gen = torch.Generator().manual_seed(0)
    groups = torch.repeat_interleave(torch.arange(5), torch.tensor([2, 3, 4, 8, 16]))
    groups = groups[torch.randperm(groups.numel(), generator=gen)]
    rewards = torch.randn(groups.numel(), generator=gen, dtype=torch.float64)
    n = torch.bincount(groups)[groups].double()
    torch.testing.assert_close(rloo_advantages(rewards, groups), n / (n - 1) * dr_grpo_advantages(rewards, groups))
    # and leave-one-out written out directly
    loo = torch.stack(
        [
            rewards[i] - rewards[(groups == groups[i]) & (torch.arange(len(groups)) != i)].mean()
            for i in range(len(groups))
        ]
    )
    torch.testing.assert_close(rloo_advantages(rewards, groups), loo)


def test_grpo_matches_trl_group_formula() -> None:
    # TRL GRPOTrainer (scale_rewards="group"): contiguous groups of G, unbiased std, epsilon 1e-4
    gen = torch.Generator().manual_seed(1)
    num_generations = 4
    rewards = torch.rand(12, generator=gen)
    grouped = rewards.view(-1, num_generations)
    mean = grouped.mean(dim=1).repeat_interleave(num_generations)
    std = grouped.std(dim=1).repeat_interleave(num_generations)
    trl = (rewards - mean) / (std + 1e-4)
    groups = torch.arange(3).repeat_interleave(num_generations)
    torch.testing.assert_close(grpo_advantages(rewards, groups, epsilon=1e-4), trl)


def test_expand_to_tokens() -> None:
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    out = expand_to_tokens(torch.tensor([2.0, -3.0]), mask)
    assert torch.equal(out, torch.tensor([[2.0, 2.0, 0.0], [-3.0, 0.0, 0.0]]))


def test_reinforce_plus_plus_hand_values() -> None:
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    rewards = torch.tensor([1.0, -1.0])
    # gamma 0.5: row 0 returns (0.25, 0.5, 1), row 1 (-0.5, -1)
    returns = reinforce_plus_plus_advantages(rewards, mask, gamma=0.5, whiten=False)
    assert torch.equal(returns, torch.tensor([[0.25, 0.5, 1.0], [-0.5, -1.0, 0.0]]))
    # whitened: mean 0.25 / 5 = 0.05, squared deviations sum 2.55, unbiased var 2.55 / 4 = 0.6375
    scale = 1 / math.sqrt(0.6375 + 1e-8)
    expected = torch.tensor([[0.2, 0.45, 0.95], [-0.55, -1.05, 0.0]]) * scale
    torch.testing.assert_close(reinforce_plus_plus_advantages(rewards, mask, gamma=0.5), expected)


def test_reinforce_plus_plus_passes_through_mask_holes() -> None:
    # multi-turn: the masked tool output in the middle does not cut the credit of the first turn
    mask = torch.tensor([[1, 1, 0, 0, 1, 0]])
    returns = reinforce_plus_plus_advantages(torch.tensor([2.0]), mask, gamma=0.5, whiten=False)
    assert torch.equal(returns, torch.tensor([[0.5, 1.0, 0.0, 0.0, 2.0, 0.0]]))


def test_reinforce_plus_plus_baseline_hand_values() -> None:
    rewards = torch.tensor([2.0, 0.0, 5.0, 1.0])
    groups = torch.tensor([0, 0, 1, 1])
    mask = torch.ones(4, 2)
    # centered: 1, -1, 2, -2, two tokens each -> mean 0, sum of squares 20, unbiased var 20 / 7
    scale = 1 / math.sqrt(20 / 7 + 1e-8)
    expected = torch.tensor([[1.0, 1.0], [-1.0, -1.0], [2.0, 2.0], [-2.0, -2.0]]) * scale
    torch.testing.assert_close(reinforce_plus_plus_baseline_advantages(rewards, groups, mask), expected)


def test_reinforce_plus_plus_baseline_weighs_by_tokens_and_zeroes_singletons() -> None:
    rewards = torch.tensor([3.0, 1.0, 9.0])
    groups = torch.tensor([0, 0, 1])
    mask = torch.tensor([[1, 1, 1], [1, 0, 0], [1, 1, 0]])
    # centered: 1, -1, 0 (singleton) -> tokens 1, 1, 1, -1, 0, 0: mean 2/6, var = sum (x - 1/3)^2 / 5
    values = torch.tensor([1.0, 1.0, 1.0, -1.0, 0.0, 0.0])
    mean = 2 / 6
    var = float(((values - mean) ** 2).sum()) / 5
    s = 1 / math.sqrt(var + 1e-8)
    expected = torch.tensor([[(1 - mean) * s] * 3, [(-1 - mean) * s, 0.0, 0.0], [-mean * s, -mean * s, 0.0]])
    torch.testing.assert_close(reinforce_plus_plus_baseline_advantages(rewards, groups, mask), expected)


def test_gae_hand_values() -> None:
    # row 0: V = (1, 2, 3), reward 1 at the end, gamma 0.9, lam 0.8 (gamma * lam = 0.72)
    #   delta = (0 + 0.9*2 - 1, 0 + 0.9*3 - 2, 1 - 3) = (0.8, 0.7, -2)
    #   A2 = -2, A1 = 0.7 + 0.72 * -2 = -0.74, A0 = 0.8 + 0.72 * -0.74 = 0.2672; R = A + V
    # row 1: a masked token in the middle is skipped: V = (1, 99, 3), mask (1, 0, 1)
    #   A2 = -2, A0 = (0 + 0.9*3 - 1) + 0.72 * -2 = 0.26
    rewards = torch.tensor([[0.0, 0.0, 1.0], [0.0, 5.0, 1.0]])
    values = torch.tensor([[1.0, 2.0, 3.0], [1.0, 99.0, 3.0]])
    mask = torch.tensor([[1, 1, 1], [1, 0, 1]])
    adv, ret = gae_advantages(rewards, values, mask, gamma=0.9, lam=0.8, whiten=False)
    torch.testing.assert_close(adv, torch.tensor([[0.2672, -0.74, -2.0], [0.26, 0.0, -2.0]]))
    torch.testing.assert_close(ret, torch.tensor([[1.2672, 1.26, 1.0], [1.26, 0.0, 1.0]]))
    # whitened over the 5 valid tokens (returns unchanged)
    valid = torch.tensor([0.2672, -0.74, -2.0, 0.26, -2.0])
    mean = float(valid.sum()) / 5
    std = math.sqrt(float(((valid - mean) ** 2).sum()) / 4 + 1e-8)
    adv_w, ret_w = gae_advantages(rewards, values, mask, gamma=0.9, lam=0.8)
    expected = torch.tensor([[0.2672, -0.74, -2.0], [0.26, mean, -2.0]]) - mean
    torch.testing.assert_close(adv_w, expected / std * mask)
    torch.testing.assert_close(ret_w, ret)


def test_gae_gamma_lam_one_returns_are_reward_to_go() -> None:
    rewards = torch.tensor([[0.0, 0.0, 1.0, 0.0]])
    values = torch.tensor([[0.3, -0.2, 0.7, 42.0]])
    mask = torch.tensor([[1, 1, 1, 0]])
    adv, ret = gae_advantages(rewards, values, mask, gamma=1.0, lam=1.0, whiten=False)
    torch.testing.assert_close(ret, torch.tensor([[1.0, 1.0, 1.0, 0.0]]))
    torch.testing.assert_close(adv, torch.tensor([[0.7, 1.2, 0.3, 0.0]]))


@pytest.mark.parametrize("name", sorted(ADVANTAGE_ESTIMATORS))
def test_compute_advantages_dispatch(name: str) -> None:
    mask = torch.tensor([[1, 1, 0], [1, 1, 1], [1, 0, 0], [1, 1, 1], [1, 1, 0], [1, 1, 1]])
    out = compute_advantages(name, REWARDS, GROUPS, mask)
    direct = {
        "grpo": lambda: expand_to_tokens(grpo_advantages(REWARDS, GROUPS), mask),
        "dr_grpo": lambda: expand_to_tokens(dr_grpo_advantages(REWARDS, GROUPS), mask),
        "rloo": lambda: expand_to_tokens(rloo_advantages(REWARDS, GROUPS), mask),
        "reinforce_plus_plus": lambda: reinforce_plus_plus_advantages(REWARDS, mask),
        "reinforce_plus_plus_baseline": lambda: reinforce_plus_plus_baseline_advantages(REWARDS, GROUPS, mask),
    }[name]()
    assert out.shape == mask.shape
    torch.testing.assert_close(out, direct)
    assert torch.all(out[mask == 0] == 0)


def test_compute_advantages_forwards_kwargs() -> None:
    mask = torch.ones(6, 2)
    out = compute_advantages("grpo", REWARDS, GROUPS, mask, epsilon=0.5)
    torch.testing.assert_close(out, expand_to_tokens(grpo_advantages(REWARDS, GROUPS, epsilon=0.5), mask))


def test_bad_arguments_raise_actionable_errors() -> None:
    mask = torch.ones(6, 2)
    with pytest.raises(ValueError, match="reinforce_plus_plus_baseline"):
        compute_advantages("ppo", REWARDS, GROUPS, mask)
    with pytest.raises(ValueError, match="integer group ids"):
        grpo_advantages(REWARDS, GROUPS.float())
    with pytest.raises(ValueError, match="one entry per reward"):
        rloo_advantages(REWARDS, GROUPS[:3])
    with pytest.raises(ValueError, match="1-D"):
        grpo_advantages(REWARDS.view(2, 3), GROUPS.view(2, 3))
    with pytest.raises(ValueError, match=r"\(N, T\)"):
        reinforce_plus_plus_advantages(REWARDS, torch.ones(5, 2))
    with pytest.raises(ValueError, match="gamma"):
        reinforce_plus_plus_advantages(REWARDS, mask, gamma=1.5)
    with pytest.raises(ValueError, match="at least 2 valid tokens"):
        reinforce_plus_plus_advantages(torch.tensor([1.0]), torch.tensor([[1, 0]]))
    with pytest.raises(ValueError, match="shape"):
        gae_advantages(torch.zeros(2, 3), torch.zeros(2, 4), torch.ones(2, 3), gamma=1.0, lam=1.0)


def test_advantage_plugin_by_path(tmp_path, monkeypatch) -> None:
    from miles_trainer import compute_advantages

    (tmp_path / "my_advantages.py").write_text(
        "def centered(rewards_N, group_index_N, mask_NT, **kw):\n"
        "    return (rewards_N - rewards_N.mean())[:, None] * mask_NT\n"
        "def wrong(rewards_N):\n"
        "    return rewards_N\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0])
    mask = torch.ones(4, 3)
    got = compute_advantages("my_advantages:centered", rewards, torch.tensor([0, 0, 1, 1]), mask)
    assert torch.equal(got, torch.tensor([[0.5] * 3, [-0.5] * 3, [-0.5] * 3, [0.5] * 3]))
    with pytest.raises(TypeError, match="must accept"):
        compute_advantages("my_advantages:wrong", rewards, torch.tensor([0, 0, 1, 1]), mask)


def test_the_estimator_table_is_keyed_by_the_configs_names() -> None:
    """The run config checks estimator names without torch (`ADVANTAGE_ESTIMATOR_NAMES`, its Literal); the table
    the trainer dispatches on must hold exactly those names, each mapped by name (not by position)."""
    from miles_trainer.config import ADVANTAGE_ESTIMATOR_NAMES

    assert sorted(ADVANTAGE_ESTIMATORS) == sorted(ADVANTAGE_ESTIMATOR_NAMES)
    rewards, groups = torch.tensor([1.0, 0.0, 0.0, 1.0]), torch.tensor([0, 0, 1, 1])
    mask = torch.ones(4, 2)
    expected = expand_to_tokens(rloo_advantages(rewards, groups), mask)
    assert torch.equal(ADVANTAGE_ESTIMATORS["rloo"](rewards, groups, mask), expected)
