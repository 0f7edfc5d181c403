"""Multi-process tier (no torch): built-in rewards, plug-in resolution, and the `RewardPool`'s spawned workers.

`exact_match`, `task` and `env` are scored in the driver (no worker): with the same rewards, failures and messages
as the same function run in workers (through its `module:function` path), hostile responses included.

The pool tests load `orchestrator_plugins` (next to this file) by path in spawned workers, so they also check that
a user's reward module is importable across spawn. A reward that raises, returns garbage, kills its worker or
sleeps past the timeout must mark its sample failed, be counted, and leave the pool working for the next call.
"""

from __future__ import annotations

import multiprocessing
import subprocess
import sys
import time
from collections.abc import Iterator

import pytest
from pydantic import JsonValue

from miles_contracts import Sample, SampleStatus
from miles_orchestrator.reward.pool import (
    DRIVER_SCORED_REWARDS,
    RewardPool,
    exact_match,
    math_reward,
    resolve_reward,
    task_reward,
)


def make(response: str, label: JsonValue = None, *, index: int = 0, group: int = 0, mode: str = "ok") -> Sample:
    return Sample(index=index, group_index=group, prompt="q", label=label, response=response, metadata={"mode": mode})


@pytest.fixture(scope="module")
def behaves_pool(plugins_on_path: None) -> Iterator[RewardPool]:
    with RewardPool("orchestrator_plugins:behaves", timeout_s=2.0, num_workers=2) as pool:
        yield pool


def test_exact_match_normalizes() -> None:
    assert exact_match(make("  Paris. ", "paris")) == 1.0
    assert exact_match(make("New   York", "new york")) == 1.0
    assert exact_match(make("Lyon", ["Paris", "Lyon"])) == 1.0
    assert exact_match(make("Paris is nice", "Paris")) == 0.0
    with pytest.raises(ValueError, match="label"):
        exact_match(make("x"))


def test_math_reward_uses_math_verify() -> None:
    assert math_reward(make("The answer is $\\frac{1}{2}$", "0.5")) == 1.0
    assert math_reward(make("so the result is \\boxed{85}", "85")) == 1.0
    assert math_reward(make("so the result is \\boxed{84}", "85")) == 0.0
    with pytest.raises(ValueError, match="cannot parse the label"):
        math_reward(make("1", ""))


def test_task_reward_checks_last_integer() -> None:
    assert task_reward(make("37 + 48 = 85", "85")) == 1.0
    assert task_reward(make("86", "85")) == 0.0


def test_resolve_reward(plugins_on_path: None) -> None:
    assert resolve_reward("task") is task_reward
    with pytest.raises(ValueError, match="module:function"):
        resolve_reward("exactmatch")
    with pytest.raises(ValueError, match="is_group"):
        resolve_reward("math", is_group=True)
    with pytest.raises(TypeError, match="positional"):
        resolve_reward("orchestrator_plugins:two_arguments")
    with pytest.raises(ValueError, match="no attribute"):
        resolve_reward("orchestrator_plugins:missing")


def test_bad_plugin_fails_before_spawning_workers(plugins_on_path: None) -> None:
    with pytest.raises(ValueError, match="cannot import module"):
        RewardPool("no_such_module_xyz:reward", num_workers=1)


async def test_builtin_task_reward_in_pool() -> None:
    samples = [make(str(r), "85", index=i) for i, r in enumerate([85, 84, "it is 85", "", "-85"])]
    with RewardPool("task", timeout_s=10.0, num_workers=2) as pool:
        stats = await pool.score(samples)
    assert [s.reward for s in samples] == [1.0, 0.0, 1.0, 0.0, 0.0]
    assert stats.num_failed == 0 and stats.mean_reward == pytest.approx(0.4)


def hostile_samples(name: str) -> list[Sample]:
    """Samples the built-in `name` scores: right, wrong, and ones it must fail (a 5000-digit answer, which int()
    refuses; a label it cannot read; no label; no episode reward)."""
    if name == "task":
        cases = [("85", "85"), ("so 12 + 73 = 85.", 85), ("84", "85"), ("", "85"), ("9" * 5000, "85"),
                 ("85", "eighty-five"), ("85", True), ("1,234", "1234")]  # fmt: skip
    elif name == "exact_match":
        cases = [(" Paris. ", "paris"), ("Lyon", ["Paris", "Lyon"]), ("x" * 100_000, "x"), ("a", None)]
    else:
        cases = [("a", None), ("b", None)]
    samples = [make(response, label, index=i) for i, (response, label) in enumerate(cases)]
    if name == "env":
        samples[0].metadata["agent"] = {"reward": 0.5}
    return samples


@pytest.mark.parametrize("name", DRIVER_SCORED_REWARDS)
async def test_driver_scored_builtins_match_their_workers(name: str) -> None:
    """The driver scores `name` as a worker scores the same function (its `module:function` path), failures and
    their messages included, and starts no process."""
    before = len(multiprocessing.active_children())
    with RewardPool(name, num_workers=2) as pool:
        assert len(multiprocessing.active_children()) == before
        in_driver = hostile_samples(name)
        stats = await pool.score(in_driver)
    in_workers = hostile_samples(name)
    with RewardPool(f"miles_orchestrator.reward.pool:{resolve_reward(name).__name__}", num_workers=2) as pool:
        assert len(multiprocessing.active_children()) == before + 2
        await pool.score(in_workers)
    assert [s.reward for s in in_driver] == [s.reward for s in in_workers]
    assert [s.status for s in in_driver] == [s.status for s in in_workers]
    path = f"'miles_orchestrator.reward.pool:{resolve_reward(name).__name__}'"
    assert [s.error for s in in_driver] == [s.error and s.error.replace(path, repr(name)) for s in in_workers]
    assert stats.num_failed == sum(s.status is SampleStatus.FAILED for s in in_driver) >= 1
    assert stats.num_failed < len(in_driver)  # the failures fail alone


def test_driver_scores_only_plain_builtins() -> None:
    with pytest.raises(ValueError, match="scores one sample"):
        RewardPool("task", is_group=True)


async def test_plugin_scores_json_copy_of_sample(behaves_pool: RewardPool) -> None:
    samples = [make("a" * k, index=k) for k in range(6)]
    stats = await behaves_pool.score(samples)
    assert [s.reward for s in samples] == [float(k) for k in range(6)]  # the worker saw each response
    assert stats.num_failed == 0 and all(s.status is SampleStatus.PENDING for s in samples)


async def test_raising_reward_fails_only_its_sample(behaves_pool: RewardPool) -> None:
    samples = [make("abc", index=0), make("abc", index=1, mode="raise"), make("abcd", index=2)]
    stats = await behaves_pool.score(samples)
    assert [s.reward for s in samples] == [3.0, 0.0, 4.0]
    failed = samples[1]
    assert failed.status is SampleStatus.FAILED
    assert failed.error is not None and "ValueError: boom on sample 1" in failed.error
    assert stats.num_failed == 1 and stats.num_timeouts == 0 and stats.errors == [failed.error]


@pytest.mark.parametrize("mode", ["nan", "text"])
async def test_non_numeric_reward_is_a_failure(behaves_pool: RewardPool, mode: str) -> None:
    samples = [make("x", mode=mode)]
    stats = await behaves_pool.score(samples)
    assert stats.num_failed == 1 and samples[0].status is SampleStatus.FAILED
    assert samples[0].error is not None and "finite float" in samples[0].error


async def test_hung_reward_times_out_and_pool_recovers(behaves_pool: RewardPool) -> None:
    restarts = behaves_pool.num_restarts
    samples = [make("ab", index=0, mode="sleep"), make("abc", index=1), make("abcd", index=2)]
    start = time.monotonic()
    stats = await behaves_pool.score(samples)
    assert time.monotonic() - start < 30  # the 60 s sleep was cut at the 2 s timeout (plus a respawn)
    assert samples[0].status is SampleStatus.FAILED and samples[0].reward == 0.0
    assert samples[0].error is not None and "timed out after 2s" in samples[0].error
    assert [s.reward for s in samples[1:]] == [3.0, 4.0]
    assert stats.num_failed == 1 and stats.num_timeouts == 1
    assert behaves_pool.num_restarts == restarts + 1
    # Both workers (the replacement included) still answer.
    again = [make("x" * k, index=k) for k in range(4)]
    assert (await behaves_pool.score(again)).num_failed == 0
    assert [s.reward for s in again] == [0.0, 1.0, 2.0, 3.0]


async def test_crashed_worker_is_replaced(behaves_pool: RewardPool) -> None:
    samples = [make("ab", index=0, mode="exit"), make("abc", index=1)]
    stats = await behaves_pool.score(samples)
    assert samples[0].status is SampleStatus.FAILED
    assert samples[0].error is not None and "worker died (exit code 3)" in samples[0].error
    assert samples[1].reward == 3.0 and stats.num_failed == 1 and stats.num_timeouts == 0
    again = [make("abcde", index=0), make("a", index=1)]
    await behaves_pool.score(again)
    assert [s.reward for s in again] == [5.0, 1.0]


async def test_failures_inside_a_chunk_fail_only_their_own_calls(behaves_pool: RewardPool) -> None:
    # 2 workers: chunks [ok, sleep, ok] and [exit, ok, ok]; the calls after a hang or a crash go to a new worker.
    modes = ["ok", "sleep", "ok", "exit", "ok", "ok"]
    samples = [make("a" * (k + 1), index=k, mode=mode) for k, mode in enumerate(modes)]
    stats = await behaves_pool.score(samples)
    assert [s.status is SampleStatus.FAILED for s in samples] == [False, True, False, True, False, False]
    assert [s.reward for s in samples] == [1.0, 0.0, 3.0, 0.0, 5.0, 6.0]
    assert samples[1].error is not None and "timed out" in samples[1].error
    assert samples[3].error is not None and "worker died" in samples[3].error
    assert stats.num_failed == 2 and stats.num_timeouts == 1


async def test_async_reward(plugins_on_path: None) -> None:
    samples = [make("abc"), make("")]
    async with RewardPool("orchestrator_plugins:async_length", num_workers=1) as pool:
        await pool.score(samples)
    assert [s.reward for s in samples] == [3.0, 0.0]


async def test_group_reward_scores_each_group(plugins_on_path: None) -> None:
    samples = [make("a", index=0, group=0), make("aaa", index=1, group=0), make("aa", index=2, group=1)]
    samples.append(make("a", index=3, group=1))
    with RewardPool("orchestrator_plugins:rank_in_group", is_group=True, num_workers=2) as pool:
        stats = await pool.score(samples)
    assert [s.reward for s in samples] == [0.0, 1.0, 1.0, 0.0] and stats.num_failed == 0


async def test_group_reward_of_wrong_length_fails_the_group(plugins_on_path: None) -> None:
    samples = [make("a", index=0, group=0), make("aaa", index=1, group=0)]
    with RewardPool("orchestrator_plugins:wrong_length_group", is_group=True, num_workers=1) as pool:
        stats = await pool.score(samples)
    assert stats.num_failed == 2 and all(s.status is SampleStatus.FAILED for s in samples)
    assert samples[0].error is not None and "list of 2 floats" in samples[0].error


async def test_closed_pool_refuses_work() -> None:
    pool = RewardPool("exact_match", num_workers=1)
    pool.close()
    pool.close()  # idempotent
    with pytest.raises(RuntimeError, match="closed"):
        await pool.score([make("a", "a")])


def test_workers_do_not_import_torch(plugins_on_path: None) -> None:
    # Reward workers start in about a second only if the reward path stays torch-free.
    code = "import sys, miles_orchestrator.reward.pool; sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0


def test_the_builtin_reward_table_is_keyed_by_the_configs_names() -> None:
    """config/run.py checks `reward.name` without importing rewards (`BUILTIN_REWARD_NAMES`); the table the pool
    dispatches on must hold exactly those names, each mapped by name."""
    from miles_orchestrator.config import BUILTIN_REWARD_NAMES
    from miles_orchestrator.reward.pool import BUILTIN_REWARDS

    assert sorted(BUILTIN_REWARDS) == sorted(BUILTIN_REWARD_NAMES)
    assert BUILTIN_REWARDS["exact_match"] is exact_match and BUILTIN_REWARDS["task"] is task_reward
    assert BUILTIN_REWARDS["math"] is math_reward
