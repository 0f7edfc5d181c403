"""Integration tier (a real local Ray cluster, real processes): runs that survive their engines, and runs whose
trainer rank fails stop cleanly and resume exactly (docs/fault-tolerance.md).

- Two engines behind sglang-router, weights posted as buckets (`run.sync_transport=http`): after step 1 one engine is
  SIGKILLed in the middle of step 2's rollout; once it is back, the other is SIGSTOPped (a hang), whenever that
  lands (a rollout, or a weight sync, which is then sent again). Each is detected, restarted on its bundle, loaded
  with a healthy engine's weights and re-added; the next sync reconnects trainer rank 0 to it. Every step equals,
  bit for bit, the uninterrupted run's (deterministic mode: the re-issued requests carry the same seeds), and the
  engines serving the later steps are new processes.
  After step 5 the trainer rank is SIGSTOPped: its missed heartbeat stops the run within seconds, naming it.
- One colocated engine, no router, weights through shared memory (the default run): the engine is SIGKILLed and
  comes back from the weight file; then the trainer rank is SIGKILLed after a checkpoint: the run stops at once
  naming it, and `--resume` ends with every step and the final weights of the uninterrupted run.
- An engine killed in each phase of a step (engine_faults.py: the kill lands inside the phase), two engines:
  colocated and synchronous with weights posted as buckets (rollout; reward; evaluation; training, the engines'
  memory released; weight sync, as the buckets go out), every step bit for bit the uninterrupted run's; and apart,
  overlapped (`run.mode=one_step_off`) with shared-memory weights (the same phases; the sync's kill between the
  trainer's write of the weight file and the engines' load), every step there once with its full batch.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch
from orchestrator_runs import DETERMINISTIC_KEYS, INTERRUPTED, history, policy_dir
from safetensors.torch import load_file

FAST_CHECKS = ["rollout.fault_tolerance.check_interval_s=1", "rollout.fault_tolerance.check_timeout_s=5"]
# The plug-ins that kill an engine in a chosen phase (engine_faults.py), held-out evaluation to kill one in, and room
# for a restart per phase.
FAULT_PLUGINS = [
    "rollout.rollout_fn=engine_faults:rollout", "reward.name=engine_faults:reward",
    "trainer.loss.loss_fn=engine_faults:loss", "run.eval_every=3", "data.num_eval_prompts=16",
    "rollout.fault_tolerance.max_restarts_per_hour=8",
]  # fmt: skip


class Run:
    """`miles-orchestrator run ARGS` in its own process group, its stderr in a file."""

    def __init__(self, args: list[str], cache: Path, stderr: Path, env_extra: dict[str, str] | None = None) -> None:
        env = {**os.environ, **(env_extra or {}), "MILES_CACHE_DIR": str(cache)}
        self.stderr_path = stderr
        with open(stderr, "w") as err:
            self.process = subprocess.Popen(["miles-orchestrator", "run", "--quiet", *args], env=env,
                                            stdout=subprocess.DEVNULL, stderr=err, start_new_session=True)  # fmt: skip

    @property
    def stderr(self) -> str:
        return self.stderr_path.read_text()

    def wait(self, timeout: float) -> int:
        try:
            return self.process.wait(timeout=timeout)
        finally:
            if self.process.poll() is None:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait()

    def wait_for_line(self, run_dir: Path, text: str, timeout: float = 600) -> None:
        deadline = time.monotonic() + timeout
        while True:
            log = run_dir / "run.log"
            if log.is_file() and text in log.read_text():
                return
            if self.process.poll() is not None or time.monotonic() > deadline:
                self.wait(0)
                raise AssertionError(f"{text!r} not logged (the run ended or took too long): {self.stderr[-3000:]}")
            time.sleep(0.1)


def actors(run_dir: Path) -> dict:
    return json.loads((run_dir / "actors.json").read_text())


def assert_same_steps(run_dir: Path, straight: Path) -> None:
    """The RL steps of `run_dir` are the uninterrupted run's (step 0, the evaluation before any step, aside)."""
    expected, got = ([r for r in history(path) if r["step"] > 0] for path in (straight, run_dir))
    assert [r["step"] for r in got] == [r["step"] for r in expected], "a step was lost or repeated"
    for want, have in zip(expected, got, strict=True):
        for key in DETERMINISTIC_KEYS:
            assert have.get(key) == want.get(key), (want["step"], key)


@pytest.mark.timeout(900)
def test_engines_killed_and_hung_are_replaced_then_a_hung_trainer_rank_stops_the_run(
    cold_run, straight_run, tmp_path
) -> None:
    _, cache = cold_run
    run_dir = tmp_path / "engines"
    run = Run([f"model.path={policy_dir(cache)}", *INTERRUPTED, *FAST_CHECKS, "run.colocate=false",
               "rollout.num_engines=2", "run.sync_transport=http", "trainer.hang_timeout_s=4",
               f"run.run_dir={run_dir}"], cache, tmp_path / "stderr")  # fmt: skip
    run.wait_for_line(run_dir, " step 1:")
    before = actors(run_dir)["engines"]
    os.kill(before[1]["pid"], signal.SIGKILL)  # dead
    run.wait_for_line(run_dir, "rollout engine 1 is back after")
    os.kill(before[0]["pid"], signal.SIGSTOP)  # hung
    run.wait_for_line(run_dir, "rollout engine 0 is back after")
    run.wait_for_line(run_dir, " step 5:")
    os.kill(actors(run_dir)["trainer_ranks"][0]["pid"], signal.SIGSTOP)
    signalled = time.monotonic()
    assert run.wait(timeout=120) == 1, run.stderr[-3000:]
    assert time.monotonic() - signalled < 60  # the heartbeat, not a 30-minute collective timeout
    assert "trainer rank 0 is hung" in run.stderr and f"--resume {run_dir}" in run.stderr, run.stderr[-3000:]

    rows = history(run_dir)  # the steps before the trainer stopped: the uninterrupted run's, bit for bit
    assert [r["step"] for r in rows][:5] == [1, 2, 3, 4, 5]
    for want, have in zip(history(straight_run), rows, strict=False):
        for key in DETERMINISTIC_KEYS:
            assert have.get(key) == want.get(key), (want["step"], key)
    assert sum(r.get("engine_restarts", 0) for r in rows) == 2
    assert max(r.get("engine_recovery_s", 0) for r in rows) < 120
    after = actors(run_dir)["engines"]
    assert {e["pid"] for e in after}.isdisjoint({e["pid"] for e in before}), "both engines should be new processes"
    log = (run_dir / "run.log").read_text()
    assert "rollout engine 1 failed (" in log and "rollout engine 0 failed (" in log
    assert "timed out" in log or "no answer within" in log  # the hung one


@pytest.mark.timeout(900)
def test_a_lone_engine_comes_back_then_a_killed_trainer_rank_stops_the_run_and_resume_is_exact(
    cold_run, straight_run, tmp_path
) -> None:
    _, cache = cold_run
    run_dir = tmp_path / "ranks"
    run = Run([f"model.path={policy_dir(cache)}", *INTERRUPTED, *FAST_CHECKS, f"run.run_dir={run_dir}"], cache,
              tmp_path / "e1")  # fmt: skip
    run.wait_for_line(run_dir, " step 1:")
    os.kill(actors(run_dir)["engines"][0]["pid"], signal.SIGKILL)
    run.wait_for_line(run_dir, "rollout engine 0 is back after")
    run.wait_for_line(run_dir, " step 3:")  # the checkpoint of step 2 is committed
    os.kill(actors(run_dir)["trainer_ranks"][0]["pid"], signal.SIGKILL)
    signalled = time.monotonic()
    assert run.wait(timeout=120) == 1, run.stderr[-3000:]
    assert time.monotonic() - signalled < 60
    assert "trainer rank 0 died (its process" in run.stderr, run.stderr[-3000:]
    assert f"miles-orchestrator run --resume {run_dir}" in run.stderr and not (run_dir / "final").exists()
    run = Run(["--resume", str(run_dir)], cache, tmp_path / "e2")
    assert run.wait(timeout=600) == 0, run.stderr[-5000:]
    assert_same_steps(run_dir, straight_run)
    assert sum(r.get("engine_restarts", 0) for r in history(run_dir)) <= 1  # the resumed run replaced its steps
    for path in (straight_run / "final").glob("*.safetensors"):
        want, got = load_file(path), load_file(run_dir / "final" / path.name)
        for key, value in want.items():
            assert torch.equal(got[key], value), f"{path.name}: {key}"


def run_with_faults(cache: Path, tmp_path: Path, plan: dict[str, list[int]], *args: str) -> tuple[Path, Path]:
    """`INTERRUPTED` with two engines and an engine killed per `plan` (engine_faults.py); its run and faults dirs."""
    run_dir, faults = tmp_path / "run", tmp_path / "faults"
    faults.mkdir()
    env = {"MILES_TEST_ENGINE_FAULTS": json.dumps(plan), "MILES_TEST_RUN_DIR": str(run_dir),
           "MILES_TEST_FAULTS_DIR": str(faults), "PYTHONPATH": str(Path(__file__).parent)}  # fmt: skip
    run = Run([f"model.path={policy_dir(cache)}", *INTERRUPTED, *FAST_CHECKS, *FAULT_PLUGINS, "rollout.num_engines=2",
               f"run.run_dir={run_dir}", *args], cache, tmp_path / "stderr", env)  # fmt: skip
    assert run.wait(timeout=800) == 0, run.stderr[-5000:]
    killed = {phase: json.loads((faults / phase).read_text()) for phase in plan if (faults / phase).is_file()}
    assert set(killed) == set(plan), f"phases that never fired: {set(plan) - set(killed)}"
    rows = history(run_dir)
    assert [r["step"] for r in rows if r["step"] > 0] == [1, 2, 3, 4, 5, 6], "a step was lost or repeated"
    assert sum(r.get("engine_restarts", 0) for r in rows) == len(plan)
    assert all(r.get("num_failed_groups", 0) == 0 and r.get("num_reward_failures", 0) == 0 for r in rows)
    assert [r["step"] for r in rows if "eval_pass@1" in r] == [0, 3, 6]
    return run_dir, faults


@pytest.mark.timeout(900)
def test_an_engine_killed_in_each_phase_of_a_colocated_step_comes_back_and_every_step_is_exact(
    cold_run, straight_run, tmp_path
) -> None:
    """Colocated (the engines release their memory for the trainer's turn), synchronous, weights posted as buckets:
    the restart of an engine killed in one phase runs on into the next ones (a rollout's into the release for
    training, while its peer, released, has no weights to copy or compare) and lands in the fleet's state; a sync
    whose bucket post found an engine dead is sent again."""
    _, cache = cold_run
    # calls: training groups 1-8 are step 1's; evaluation groups 17-32 the eval after step 3; one loss call a step;
    # the weights are posted once at the start (v0) and after each step (step 5's: the 6th)
    plan = {"rollout": [12, 1], "reward": [2, 0], "eval": [20, 1], "train": [4, 0], "sync": [6, 1]}
    run_dir, _ = run_with_faults(cache, tmp_path, plan, "run.sync_transport=http")
    assert_same_steps(run_dir, straight_run)
    for path in (straight_run / "final").glob("*.safetensors"):
        want, got = load_file(path), load_file(run_dir / "final" / path.name)
        assert all(torch.equal(got[key], value) for key, value in want.items()), path.name


@pytest.mark.timeout(900)
def test_an_engine_killed_in_each_phase_of_an_overlapped_run_apart_comes_back(cold_run, tmp_path) -> None:
    """Engines apart from the trainer, rollout overlapped with training (`one_step_off`), shared-memory weights:
    phases overlap (an evaluation's kill and a training's can leave no engine alive at once, which the weight file
    re-syncs), and an engine dies between the trainer's write of the weight file and its load. Overlapped steps are
    not the synchronous run's; each is there once, with its full batch."""
    _, cache = cold_run
    plan = {"rollout": [12, 1], "reward": [2, 0], "eval": [20, 0], "train": [4, 1], "sync": [6, 0]}
    run_dir, _ = run_with_faults(cache, tmp_path, plan, "run.colocate=false", "run.mode=one_step_off")
    assert (run_dir / "final").is_dir()
