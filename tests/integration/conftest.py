"""The integration tier's shared fixture: the shortened default example, run once per session on a cold cache, under
a non-native CPU dispatch (`orchestrator_runs.OTHER_CPU`)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))  # the tests import orchestrator_runs (pytest's importlib mode)

from orchestrator_runs import INTERRUPTED, OTHER_CPU, SHORT, cli, policy_dir


@pytest.fixture(scope="session")
def cold_run(tmp_path_factory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("cold")
    cache, run_dir = root / "cache", root / "run"
    result = cli(*SHORT, f"run.run_dir={run_dir}", cache=cache, env_extra=OTHER_CPU)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    return run_dir, cache


@pytest.fixture(scope="session")
def straight_run(cold_run) -> Path:
    """`INTERRUPTED` run without interruption (shared memory sync, one engine, colocated): what every killed, stopped
    or restarted run must reproduce bit for bit. It saves its rollouts and profiles step 2 (test_debugging.py), which
    changes none of its numbers."""
    _, cache = cold_run
    run_dir = cold_run[0].parent / "straight"
    result = cli(f"model.path={policy_dir(cache)}", *INTERRUPTED, f"run.run_dir={run_dir}", "run.save_rollouts=true",
                 "run.profile_steps=[2]", cache=cache)  # fmt: skip
    assert result.returncode == 0, result.stderr[-5000:]
    return run_dir
