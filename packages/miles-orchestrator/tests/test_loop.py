"""Loop helpers that need no cluster."""

from __future__ import annotations

from miles_orchestrator.loop import batch_keys


def test_trainer_reward_stats_do_not_overwrite_the_rollouts() -> None:
    rollout = {"reward_mean": 0.25, "pass_rate": 0.25}
    trained = batch_keys({"reward_mean": 0.5, "reward_max": 1.0, "advantage_mean": 0.0, "loss": 0.1})
    assert rollout | trained == {
        "reward_mean": 0.25, "pass_rate": 0.25, "batch_reward_mean": 0.5, "batch_reward_max": 1.0,
        "advantage_mean": 0.0, "loss": 0.1,
    }  # fmt: skip
