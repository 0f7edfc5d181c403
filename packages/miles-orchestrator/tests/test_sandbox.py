"""The sandbox of user code (rollout/sandbox.py, rollout/env_pool.py). Multi-process: real worker processes run the
tools of sandbox_plugins.ProbeEnv. A tool sees an allow-listed environment and runs under rlimits; what a tool
started dies with its worker on a timeout and when the pool closes; a memory hog or a CPU runaway fails a call, not
the pool."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
from pathlib import Path
from typing import Any

import pytest

from miles_contracts import AgentMessage, Sample, ToolCall
from miles_orchestrator.rollout.env_pool import EnvError, EnvPool, Episode
from miles_orchestrator.rollout.sandbox import ALLOWED_ENV, GiB, Limits, spawn_worker, stop_worker, wait_ready

PROBE = "sandbox_plugins:ProbeEnv"


def call(pool: EnvPool, tool: str, episode: Episode | None = None, **arguments: Any) -> tuple[str, int]:
    """Call one tool in a (new, unless given) episode: the tool's output and the step's number of tool errors."""

    async def run() -> tuple[str, int]:
        nonlocal episode
        if episode is None:
            episode = (await pool.open(Sample(index=0, group_index=0, prompt="probe", label=""))).episode
        message = AgentMessage(content="", tool_calls=[ToolCall(name=tool, arguments=arguments)], turn=0)
        result = await pool.step(episode, message)
        assert result.observation is not None
        return str(result.observation[0].content), result.num_tool_errors

    return asyncio.run(run())


def is_running(pid: int) -> bool:
    """Whether `pid` is a live process (a zombie, dead but not yet reaped by whoever adopted it, is not)."""
    try:
        os.kill(pid, 0)
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (ProcessLookupError, FileNotFoundError):
        return False


def wait_gone(pid: int, timeout_s: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while is_running(pid):
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)  # the test failed; leave no sleeper behind
            return False
        time.sleep(0.05)
    return True


def wait_for_pid(pid_file: Path, timeout_s: float = 30.0) -> int:
    deadline = time.monotonic() + timeout_s
    while not pid_file.exists() or not pid_file.read_text().strip():
        assert time.monotonic() < deadline, "the worker never started its sleeper"
        time.sleep(0.05)
    return int(pid_file.read_text())


def test_a_tool_sees_only_the_allowed_environment(plugins_on_path, monkeypatch) -> None:
    monkeypatch.setenv("OPENAI_API_KEY", "sk-not-for-tools")
    monkeypatch.setenv("MILES_ADMIN_KEY", "admin-not-for-tools")
    monkeypatch.setenv("HF_HOME", "/data/hf")
    monkeypatch.setenv("LC_ALL", "C.UTF-8")
    with EnvPool(PROBE, {}, timeout_s=30, num_workers=1, limits=Limits(env_passthrough=("HF_HOME",))) as pool:
        output, _ = call(pool, "environ")
    seen = json.loads(output)
    environ = seen["os_environ"]
    assert "OPENAI_API_KEY" not in environ and "MILES_ADMIN_KEY" not in environ
    assert "not-for-tools" not in seen["proc_environ"]  # set at exec: not even the kernel's copy has it
    assert environ["HF_HOME"] == "/data/hf"  # passed through by name
    assert environ["PATH"] == os.environ["PATH"] and environ["LC_ALL"] == "C.UTF-8"
    assert all(k in (*ALLOWED_ENV, "HF_HOME") or k.startswith("LC_") for k in environ), sorted(environ)


def test_a_tool_runs_under_the_rlimits(plugins_on_path) -> None:
    limits = Limits(cpu_s_per_call=50, address_space_bytes=3 * GiB, num_open_files=256)
    with EnvPool(PROBE, {}, timeout_s=30, num_workers=1, limits=limits) as pool:
        seen = json.loads(call(pool, "rlimits")[0])
    assert seen["as"] == [3 * GiB, 3 * GiB] and seen["nofile"] == [256, 256] and seen["core"] == [0, 0]
    cpu_soft, _ = seen["cpu"]
    assert 49 < cpu_soft - seen["cpu_used_s"] <= 51  # renewed as the call began: 50 s more than it had used then
    assert Limits().cpu_s(10) == 10 * (os.cpu_count() or 1)  # the default: no call reaches it before its timeout


def test_the_cpu_limit_is_per_call_and_stops_a_runaway(plugins_on_path) -> None:
    with EnvPool(PROBE, {}, timeout_s=20, num_workers=1, limits=Limits(cpu_s_per_call=1)) as pool:
        opened = asyncio.run(pool.open(Sample(index=0, group_index=0, prompt="probe", label="")))
        for _ in range(3):  # 1.8 s in all: the limit is renewed per call, not a lifetime total
            assert float(call(pool, "burn_cpu", opened.episode, seconds=0.6)[0]) >= 0.6
        started = time.monotonic()
        with pytest.raises(EnvError, match=r"worker died \(exit code -24; SIGXCPU: past its CPU limit of 1s\)"):
            call(pool, "burn_cpu", seconds=-1)
        assert time.monotonic() - started < 15  # the kernel, not the 20 s timeout
        assert pool.num_restarts == 1 and "cpu" in call(pool, "rlimits")[0]  # replaced; the pool goes on


@pytest.mark.parametrize("how", ["popen", "shell"])
def test_a_timeout_kills_what_the_tool_started(plugins_on_path, tmp_path, how) -> None:
    pid_file = tmp_path / "sleeper.pid"
    with EnvPool(PROBE, {}, timeout_s=2, num_workers=1) as pool:
        with pytest.raises(EnvError, match="timed out after 2s"):
            call(pool, "start_sleeper_and_hang", pid_file=str(pid_file), how=how)
        sleeper = wait_for_pid(pid_file)
        assert wait_gone(sleeper), f"the tool's sleeper ({how}) outlived its worker's timeout"
        assert pool.num_restarts == 1


def test_closing_the_pool_kills_what_a_tool_left_running(plugins_on_path, tmp_path) -> None:
    pid_file = tmp_path / "sleeper.pid"
    with EnvPool(PROBE, {}, timeout_s=30, num_workers=1) as pool:
        sleeper = int(call(pool, "start_sleeper", pid_file=str(pid_file), how="popen")[0])
        assert is_running(sleeper)
    assert wait_gone(sleeper), "the tool's sleeper outlived the pool"


def test_a_memory_hog_fails_its_tool_call_not_the_worker(plugins_on_path) -> None:
    with EnvPool(PROBE, {}, timeout_s=30, num_workers=1, limits=Limits(address_space_bytes=2 * GiB)) as pool:
        output, num_errors = call(pool, "allocate", gib=4)
        assert (output, num_errors) == ("error: MemoryError: ", 1)  # what the model reads; a counted tool error
        assert call(pool, "allocate", gib=1) == (str(1 << 30), 0) and pool.num_restarts == 0


def test_stopping_a_reward_worker_kills_what_it_started(plugins_on_path, tmp_path) -> None:
    """The reward pool's workers (spawn_worker: the driver's environment, no rlimits) lead their own group too."""
    from sandbox_plugins import reward_worker_that_starts_a_sleeper

    pid_file = tmp_path / "sleeper.pid"
    worker = wait_ready(spawn_worker(reward_worker_that_starts_a_sleeper, (str(pid_file),), "test"), "test worker")
    sleeper = wait_for_pid(pid_file)
    stop_worker(worker)
    assert wait_gone(sleeper), "the reward worker's sleeper outlived it"


def test_limits_refuse_what_no_worker_can_run_under() -> None:
    for bad, field in [({"cpu_s_per_call": 0}, "cpu_s_per_call=0"), ({"address_space_bytes": 1 << 20}, "1 GiB"),
                       ({"env_passthrough": ("A=B",)}, "not variable names")]:  # fmt: skip
        with pytest.raises(ValueError, match=field):
            Limits(**bad)


def test_the_run_config_sets_the_limits(monkeypatch) -> None:
    from miles_orchestrator.config.rollout import RolloutSection
    from miles_orchestrator.rollout import agentic

    seen: dict[str, Any] = {}

    class Recording:
        def __init__(self, *args: Any, limits: Limits, **kwargs: Any) -> None:
            seen["limits"] = limits

        def __enter__(self) -> Recording:
            return self

        def __exit__(self, *exc: object) -> None:
            pass

    monkeypatch.setattr(agentic, "EnvPool", Recording)
    monkeypatch.setattr(agentic, "ChatTemplate", lambda tokenizer: None)
    agent = {"env": "calculator", "env_passthrough": ["HF_HOME"], "cpu_s_per_call": 5, "address_space_gib": 4,
             "num_open_files": 256}  # fmt: skip
    cfg = RolloutSection.model_validate({"agent": agent})
    with agentic.agent_rollout(cfg, tokenizer=None):
        pass
    assert seen["limits"] == Limits(cpu_s_per_call=5, address_space_bytes=4 * GiB, num_open_files=256,
                                    env_passthrough=("HF_HOME",))  # fmt: skip
