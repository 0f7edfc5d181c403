"""CPU numerics: every miles_trainer advantage estimator (GRPO, Dr.GRPO, RLOO, REINFORCE++ and its baseline form,
GAE) against verl's (0.9.1, and 0.7.0's REINFORCE++) and TRL's GRPO / RLOO advantages, on interleaved unequal
groups, constant-reward groups, rewards of ±1e6 and ragged masks.

The reference formulas are transcribed in reference_verl_advantages.py and reference_trl.py (no verl / TRL import),
the masks are reference_inputs.py's. Where Miles deliberately departs from a reference (its docstrings say so), the
agreement is tested where the two agree and the documented difference is asserted on an input where they differ.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from reference_inputs import F64, HOLE_ROW, MASK, RIGHT_PADDED, N, T, assert_close, gen
from reference_trl import trl_grpo_advantages, trl_rloo_advantages
from reference_verl_advantages import (
    verl070_rpp_outcome_advantage,
    verl_gae_advantage_return,
    verl_grpo_outcome_advantage,
    verl_rloo_outcome_advantage,
    verl_rpp_baseline_outcome_advantage,
    verl_rpp_outcome_advantage,
)

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
from miles_trainer.config import ADVANTAGE_ESTIMATOR_NAMES, AdvantageConfig

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
    g = gen(60)
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
