"""How long a run takes to notice and recover from a failed engine, and to stop on a failed trainer rank, as JSON.

Each scenario runs `miles-orchestrator run` (Ray, the bootstrapped default policy, the small batch of the
integration tests, 6 steps, default `rollout.fault_tolerance` and `trainer.hang_timeout_s` unless the scenario says
otherwise), sends a signal to one of its processes (from RUN_DIR/actors.json) once step 1 is logged, and measures
with this script's clock:
- engine_sigkill / engine_sigstop (two engines behind sglang-router; engine_sigkill_distributed: weights broadcast
  over gloo, so the new engine copies a healthy one's and the next sync rebuilds the group): seconds from the signal
  to the run's "is back"
  log line (detection + restart), the restart alone (`engine_recovery_s`), the affected step's time against the
  median of the others, and whether every step equals the same run's without the fault (`--reference`, a run
  with no signal);
- trainer_sigkill / trainer_sigstop (one rank, colocated): seconds from the signal to the run's exit, its status
  and the error line naming the rank.

    uv run python benchmarks/fault_recovery.py --out benchmarks/results/fault_recovery.json
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

from host import host_info

from miles_orchestrator.config.rollout import FaultToleranceSection
from miles_orchestrator.config.sections import TrainerSection

BASE = ["rollout.num_prompts_per_step=8", "trainer.global_batch_size=64", "filter.dynamic_sampling=false",
        "run.num_steps=6", "run.eval_every=0"]  # fmt: skip
TWO_ENGINES = ["run.colocate=false", "rollout.num_engines=2"]
KEYS = ("reward_mean", "loss", "grad_norm", "num_tokens", "train_rollout_logprob_abs_diff")
SCENARIOS: dict[str, tuple[list[str], str, int]] = {  # overrides, actor kind, signal
    "engine_sigkill": (TWO_ENGINES, "engines", signal.SIGKILL),
    "engine_sigstop": (TWO_ENGINES, "engines", signal.SIGSTOP),
    "engine_sigkill_distributed": ([*TWO_ENGINES, "run.sync_transport=distributed"], "engines", signal.SIGKILL),
    "trainer_sigkill": ([], "trainer_ranks", signal.SIGKILL),
    "trainer_sigstop": ([], "trainer_ranks", signal.SIGSTOP),
}


def launch(args: list[str], run_dir: Path) -> subprocess.Popen[bytes]:
    with open(run_dir.parent / f"{run_dir.name}.stderr", "w") as err:
        return subprocess.Popen(["miles-orchestrator", "run", "--quiet", *args, f"run.run_dir={run_dir}"],
                                stdout=subprocess.DEVNULL, stderr=err, start_new_session=True)  # fmt: skip


def wait_for(run_dir: Path, pattern: str, process: subprocess.Popen[bytes], timeout: float = 900) -> float:
    """The time (this clock) at which `pattern` first shows in run.log."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        log = run_dir / "run.log"
        if log.is_file() and re.search(pattern, log.read_text()):
            return time.monotonic()
        if process.poll() is not None:
            raise RuntimeError(f"the run ended before logging {pattern!r}: see {run_dir}.stderr")
        time.sleep(0.05)
    raise RuntimeError(f"{pattern!r} not logged within {timeout:.0f} s")


def metrics(run_dir: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def run_scenario(name: str, work: Path, reference: list[dict[str, Any]]) -> dict[str, Any]:
    overrides, kind, sig = SCENARIOS[name]
    run_dir = work / name
    process = launch([*BASE, *overrides], run_dir)
    try:
        wait_for(run_dir, r" step 1:", process)
        target = json.loads((run_dir / "actors.json").read_text())[kind][-1]
        os.kill(target["pid"], sig)
        signalled = time.monotonic()
        if kind == "trainer_ranks":
            status = process.wait(timeout=600)
            stderr = (run_dir.parent / f"{name}.stderr").read_text()
            named = [line for line in stderr.splitlines() if "trainer rank" in line]
            return {"signal": sig.name, "seconds_to_stop": round(time.monotonic() - signalled, 2),
                    "exit_status": status, "error": named[-1] if named else stderr[-500:]}  # fmt: skip
        back = wait_for(run_dir, r"rollout engine \d+ is back after", process)
        status = process.wait(timeout=900)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
    rows = metrics(run_dir)
    hit = next(r for r in rows if r.get("engine_restarts"))
    others = [r["step_time_s"] for r in rows if r is not hit]
    same = len(rows) == len(reference) and all(
        a.get(k) == b.get(k) for a, b in zip(rows, reference, strict=True) for k in KEYS
    )
    log = (run_dir / "run.log").read_text()
    cause = re.search(r"rollout engine \d+ failed \((.*?)\); restarting it", log)
    return {
        "signal": sig.name, "exit_status": status,
        "seconds_signal_to_back": round(back - signalled, 2),
        "engine_recovery_s": round(hit["engine_recovery_s"], 2),
        "engine_calls_reissued": int(sum(r.get("engine_calls_reissued", 0) for r in rows)),
        "affected_step": hit["step"], "affected_step_time_s": round(hit["step_time_s"], 2),
        "median_other_step_time_s": round(statistics.median(others), 2),
        "steps_equal_to_undisturbed_run": same,
        "cause": cause.group(1) if cause else None,
    }  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="benchmarks/results/fault_recovery.json")
    parser.add_argument("--scenarios", nargs="*", default=list(SCENARIOS), choices=list(SCENARIOS))
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="miles-faults-"))
    try:
        reference_dir = work / "reference"
        process = launch([*BASE, *TWO_ENGINES], reference_dir)
        if process.wait(timeout=1800) != 0:
            raise RuntimeError(f"the reference run failed: see {reference_dir}.stderr")
        reference = metrics(reference_dir)
        results = {}
        for name in args.scenarios:
            results[name] = run_scenario(name, work, reference)
            print(name, json.dumps(results[name]), flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    faults = FaultToleranceSection()
    chosen = "" if args.scenarios == list(SCENARIOS) else " --scenarios " + " ".join(args.scenarios)
    report = {
        "script_command": f"python benchmarks/fault_recovery.py{chosen} --out {args.out}",
        "host": host_info(), "cpus": os.cpu_count(),
        "defaults": {
            "rollout.fault_tolerance": faults.model_dump(include={"check_interval_s", "check_timeout_s",
                                                                  "failure_threshold"}),
            "trainer.hang_timeout_s": TrainerSection.model_fields["hang_timeout_s"].default,
        },
        "results": results,
    }  # fmt: skip
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
