"""Multi-process tier (a real Ray cluster on this machine): the debugging commands on the Ray run every resumed run is
compared with (`conftest.straight_run`: the bootstrapped policy, 6 steps, a checkpoint every 2, rollouts saved,
step 2 profiled). The local cluster's side, and the analyzer's layer comparison, are tested in
packages/miles-orchestrator/tests/test_debugging.py."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest


def command(*args: str, cache: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "MILES_CACHE_DIR": str(cache)}
    return subprocess.run(["miles-orchestrator", *args], capture_output=True, text=True, timeout=600, env=env)


@pytest.mark.timeout(900)
def test_a_ray_runs_step_replays_bitwise_and_its_profile_has_every_actors_trace(cold_run, straight_run) -> None:
    _, cache = cold_run
    result = command("replay", str(straight_run), "--step", "5", "--quiet", cache=cache)  # from the step-4 checkpoint
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    (step,) = json.loads((straight_run / "replay" / "step_000005" / "replay.json").read_text())["steps"]
    assert step["step"] == 5 and step["is_identical"]
    saved = json.loads((straight_run / "rollouts" / "step_000005.json").read_text())
    assert saved["metrics"]["grad_norm"] > 0, "a step that updates the weights"

    result = command("mismatch", str(straight_run), "--step", "5", cache=cache)
    assert result.returncode == 0, result.stderr[-3000:]
    tokens = json.loads((straight_run / "mismatch" / "step_000005.json").read_text())["tokens"]
    assert tokens["max"] == 0.0 and tokens["num_tokens"] > 0  # true on-policy
    assert "step 5:" in command("inspect", str(straight_run), "--step", "5", cache=cache).stdout

    traces = {p.name: p for p in (straight_run / "profiles" / "step_000002").iterdir()}
    assert set(traces) == {"driver.trace.json", "trainer_rank0.trace.json", "engine0-TP-0.trace.json"}
    for name, path in traces.items():
        events = json.loads(path.read_text())["traceEvents"]
        assert any(e.get("ph") == "X" and e.get("name", "").startswith("aten::") for e in events), name
    trainer = json.loads(traces["trainer_rank0.trace.json"].read_text())["traceEvents"]
    assert any("Backward" in e.get("name", "") for e in trainer)
