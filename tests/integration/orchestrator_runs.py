"""Helpers of the integration tier's `miles-orchestrator run` tests: the CLI in a subprocess, a run's metric lines,
the cached bootstrap policy. The cold run they share is `conftest.cold_run` (one bootstrap per session)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

# The default example, shortened for CI: fewer RL steps, a smaller held-out set. 30 steps, not 20: over the 9 cells of
# benchmarks/results/robustness.json the reward's rise from steps 1-5 to 16-20 was as low as 0.038, to 26-30 0.086.
SHORT = ["run.num_steps=30", "run.eval_every=30", "data.num_eval_prompts=100"]
# The CPU-dispatch setting the shared cold run trains under (benchmarks/robustness.py's `avx2`): ATen's AVX2 kernels
# round softmax and log-softmax differently from an AVX-512 machine's, so on this project's CI machine the bootstrap
# SFT and the RL steps follow another trajectory than the native one: the example must learn whichever CPU runs it.
# Tests that compare their steps with the cold run's run under it too.
OTHER_CPU = {"ATEN_CPU_CAPABILITY": "avx2"}
SMALL = ["rollout.num_prompts_per_step=8", "trainer.global_batch_size=64", "filter.dynamic_sampling=false"]
# The runs that are killed, stopped and resumed (test_orchestrator.py, test_fault_tolerance.py), and the uninterrupted
# run they are compared with (conftest.straight_run): 6 steps, a checkpoint every 2.
INTERRUPTED = [*SMALL, "run.num_steps=6", "run.checkpoint_every=2", "run.eval_every=0"]
DETERMINISTIC_KEYS = (
    "reward_mean", "pass_rate", "loss", "pg_loss", "grad_norm", "entropy", "clip_fraction", "num_tokens",
    "response_len_mean", "train_rollout_logprob_abs_diff", "weight_version",
)  # fmt: skip


def cli(
    *args: str, cache: Path, timeout: float = 900, env_extra: dict[str, str] | None = None, **popen: object
) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, **(env_extra or {}), "MILES_CACHE_DIR": str(cache), "PYTHONPATH": str(Path(__file__).parent)}
    return subprocess.run(["miles-orchestrator", "run", "--quiet", *args], capture_output=True, text=True,
                          timeout=timeout, env=env, **popen)  # type: ignore[call-overload]  # fmt: skip


def history(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def policy_dir(cache: Path) -> Path:
    (policy,) = cache.glob("bootstrap/*/policy")
    return policy


def kill_after_checkpoint(*args: str, run_dir: Path, cache: Path, step: int, timeout: float = 600) -> None:
    """Start `miles-orchestrator run ARGS run.run_dir=RUN_DIR` and SIGKILL it, with everything it started (Ray, the
    ranks, the engines), once the checkpoint of `step` is complete: a crash right after a checkpoint."""
    env = {**os.environ, "MILES_CACHE_DIR": str(cache), "PYTHONPATH": str(Path(__file__).parent)}
    command = ["miles-orchestrator", "run", "--quiet", *args, f"run.run_dir={run_dir}"]
    process = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                               start_new_session=True)  # fmt: skip
    deadline = time.monotonic() + timeout
    while not (run_dir / "checkpoints" / f"step_{step:06d}" / "trainer_state.json").is_file():
        assert process.poll() is None, "the run ended before its checkpoint"
        assert time.monotonic() < deadline, f"no checkpoint after {timeout:.0f} s"
        time.sleep(0.5)
    os.killpg(process.pid, signal.SIGKILL)
    process.wait()
