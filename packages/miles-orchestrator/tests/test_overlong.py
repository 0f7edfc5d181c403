"""CPU numerics (an in-process embedded engine): a step's rollout phase (`generate_batch`) with DAPO's tools. Dynamic
sampling drops groups whose rewards are all equal and an over-sampling round refills the batch, counted in the
metrics; the soft overlong punishment equals verl's DAPO reward manager (transcribed here) and leaves the task's pass
rate measured on the task's own reward; overlong filtering zeroes the loss mask of truncated responses only."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import pytest

from miles_contracts import Sample, SampleStatus
from miles_orchestrator.config import load_config
from miles_orchestrator.rollout.batch import PromptEncoder, generate_batch
from miles_orchestrator.rollout.filters import build_filters
from miles_orchestrator.rollout.overlong import overlong_penalty
from miles_orchestrator.rollout.single_turn import single_turn
from miles_orchestrator.run_dir import RunDir
from miles_rollout import InProcessClient


# verl (0.9.1), verl/workers/reward_manager/dapo.py, DAPORewardManager.__call__, the overlong_buffer branch
def verl_overlong_reward(valid_response_length: int, max_resp_len: int, overlong_buffer_len: int, factor: float):  # type: ignore[no-untyped-def]
    expected_len = max_resp_len - overlong_buffer_len
    exceed_len = valid_response_length - expected_len
    overlong_penalty_factor = factor
    overlong_reward = min(-exceed_len / overlong_buffer_len * overlong_penalty_factor, 0)
    return overlong_reward


def test_the_overlong_punishment_is_verls() -> None:
    for length in range(0, 21):
        assert overlong_penalty(length, 20, 8, 1.5) == verl_overlong_reward(length, 20, 8, 1.5)
    assert overlong_penalty(12, 20, 8, 1.0) == 0.0 and overlong_penalty(20, 20, 8, 1.0) == -1.0


class Prompts:
    def __init__(self) -> None:
        self.next = 0

    def get_samples(self, count: int) -> list[Sample]:
        out = [Sample(index=g, group_index=g, prompt=f"What is {g} + {g}?", label=str(2 * g))
               for g in range(self.next, self.next + count)]  # fmt: skip
        self.next += count
        return out


@dataclass
class Stats:
    num_failed: int = 0
    num_timeouts: int = 0


class Rewards:
    """Groups 0 and 1 score all 1.0 (dynamic sampling drops them); the others 1.0 and 0.0 alternately."""

    async def score(self, samples: list[Sample]) -> Stats:
        for sample in samples:
            sample.reward = 1.0 if sample.group_index < 2 or sample.index % 2 == 0 else 0.0
        return Stats()


@dataclass
class Parts:
    source: Prompts
    filters: list
    encode: PromptEncoder
    rewards: Rewards
    rollout_fn: object = single_turn
    teacher: object = None
    throughput: object = None


def test_dynamic_sampling_fires_an_over_sampling_round_and_dapos_overlong_tools_apply(tiny_engine, tmp_path) -> None:
    eng, encode = tiny_engine
    overrides = ["rollout.num_prompts_per_step=3", "rollout.n_samples_per_prompt=2", "rollout.max_new_tokens=6",
                 "rollout.temperature=1.0", "reward.overlong_buffer=3", "reward.overlong_penalty=0.5",
                 "filter.overlong=true", "trainer.global_batch_size=6"]  # fmt: skip
    cfg = load_config(None, overrides)
    parts = Parts(Prompts(), build_filters(cfg.filter), encode, Rewards())
    run = RunDir(tmp_path / "run", quiet=True)
    batch, metrics = asyncio.run(generate_batch(cfg, parts, InProcessClient(eng), run))  # type: ignore[arg-type]
    assert metrics["num_oversample_rounds"] == 1.0 and metrics["num_groups_filtered"] == 2.0
    assert sorted({s.group_index for s in batch}) == [2, 3, 4]  # groups 0 and 1 dropped, 3 and 4 refilled them
    truncated = [s for s in batch if s.status == SampleStatus.TRUNCATED]
    assert truncated and all(s.loss_mask == [0] * len(s.response_tokens) for s in truncated)
    assert all(s.loss_mask is None for s in batch if s.status != SampleStatus.TRUNCATED)
    assert metrics["num_overlong_filtered"] >= len(truncated)
    for sample in batch:
        expected = overlong_penalty(len(sample.response_tokens), 6, 3, 0.5)
        assert sample.metadata["overlong_penalty"] == expected
        assert sample.reward == (1.0 if sample.index % 2 == 0 else 0.0) + expected
    assert metrics["overlong_penalty_mean"] < 0
    assert metrics["pass_rate"] == 7 / 10  # on the task reward: groups 0 and 1 pass (4), the other three half (3)
    with pytest.raises(ValueError, match=r"reward\.overlong_buffer=6 must be below rollout\.max_new_tokens=6"):
        load_config(None, ["rollout.max_new_tokens=6", "reward.overlong_buffer=6"])
