"""Async vs sync training on the same config, side by side in one run, as JSON.

Runs `miles-orchestrator run` once per `--modes` entry (default: sync, one_step_off, async) with everything else
equal: the built-in example, disaggregated (`run.colocate=false`), one engine and one trainer rank each pinned to
cores of its own (`run.pin_cpus=true`) with the same fixed thread count (`--threads`, default 1), no evaluation.
From each run's metrics.jsonl it takes the steady-state steps (the first `--warmup` steps and the last one, which
saves and exports, left out) and reports the medians of the step time (wall time between two finished steps), the
rollout time (the rollout phase: generation, rewards, filters), the train time, the weight-sync time, and:

- `bound_s` = max(rollout time, train + sync time): the step time perfect overlap would reach;
- `step_over_bound`: step time / bound_s (the target for async: at most 1.1);
- `overlap_fraction`: (rollout + train + sync - step) / min(rollout, train + sync), clipped to [0, 1]: the share of
  the shorter phase hidden behind the longer one (0 for sync by construction);
- `speedup_vs_sync`: the sync run's step time / this run's.

    uv run python benchmarks/async.py --out benchmarks/results/async.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from host import host_info

BASE = [
    "run.colocate=false", "run.pin_cpus=true", "run.eval_every=0", "data.num_eval_prompts=0",
    "rollout.num_prompts_per_step=16", "trainer.global_batch_size=128", "filter.dynamic_sampling=false",
]  # fmt: skip
MODES = {
    "sync": ["run.mode=sync"],
    "one_step_off": ["run.mode=one_step_off"],
    "async": ["run.mode=async", "run.max_staleness=1"],
    "async_staleness2": ["run.mode=async", "run.max_staleness=2"],
}


def run_mode(name: str, steps: int, threads: int, root: Path, extra: list[str]) -> list[dict[str, Any]]:
    run_dir = root / name
    command = ["miles-orchestrator", "run", "--quiet", f"run.run_dir={run_dir}", f"run.num_steps={steps}",
               f"run.num_threads={threads}", *BASE, *MODES[name], *extra]  # fmt: skip
    began = time.perf_counter()
    result = subprocess.run(command, capture_output=True, text=True, timeout=3600)
    if result.returncode != 0:
        sys.exit(f"{name} failed:\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}")
    print(f"{name}: {time.perf_counter() - began:.0f} s", file=sys.stderr)
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]


def summarize(lines: list[dict[str, Any]], warmup: int) -> dict[str, Any]:
    steady = [line for line in lines if line["step"] > warmup][:-1]  # the last step saves and exports

    def median(key: str) -> float:
        return statistics.median(float(line.get(key, 0.0)) for line in steady)

    step, rollout = median("step_time_s"), median("rollout_time_s")
    train, sync = median("train_time_s"), median("sync_time_s")
    bound = max(rollout, train + sync)
    shorter = min(rollout, train + sync)
    overlap = min(max((rollout + train + sync - step) / shorter, 0.0), 1.0) if shorter > 0 else 0.0
    return {
        "num_steady_steps": len(steady),
        "step_time_s": step, "rollout_time_s": rollout, "train_time_s": train, "sync_time_s": sync,
        "rollout_wait_s": median("rollout_wait_s"), "bound_s": bound, "step_over_bound": step / bound,
        "overlap_fraction": overlap,
        "staleness_mean": statistics.mean(float(line.get("staleness_mean", 0.0)) for line in steady),
        "staleness_max": max(float(line.get("staleness_max", 0.0)) for line in steady),
        "num_stale_groups_dropped": sum(float(line.get("num_stale_groups_dropped", 0.0)) for line in steady),
        "reward_mean_last": float(lines[-1]["reward_mean"]),
    }  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="benchmarks/results/async.json")
    parser.add_argument("--modes", nargs="+", default=["sync", "one_step_off", "async"], choices=list(MODES))
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1, help="torch threads of the engine and of the trainer")
    parser.add_argument("extra", nargs="*", help="more dotted overrides, the same for every mode")
    args = parser.parse_args()
    if "sync" not in args.modes:
        parser.error("--modes needs sync: every other mode is reported against it")
    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="miles-async-") as root:
        for name in args.modes:
            results[name] = summarize(run_mode(name, args.steps, args.threads, Path(root), args.extra), args.warmup)
    for summary in results.values():
        summary["speedup_vs_sync"] = results["sync"]["step_time_s"] / summary["step_time_s"]
    report = {
        "benchmark": "async.py",
        "command": " ".join(["python", "benchmarks/async.py", *sys.argv[1:]]),
        "host": host_info(),
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(),
                    "usable_cpus": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None},
        "config": {"overrides": BASE + args.extra, "steps": args.steps, "warmup": args.warmup,
                   "threads": args.threads, "modes": {m: MODES[m] for m in args.modes}},
        "goal": "async step_time_s <= 1.1 x bound_s (max of rollout and train + sync time)",
        "results": results,
    }  # fmt: skip
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    for name, r in results.items():
        print(f"{name:>16}: step {r['step_time_s']:.3f} s, rollout {r['rollout_time_s']:.3f}, train "
              f"{r['train_time_s']:.3f} + sync {r['sync_time_s']:.3f}, step/bound {r['step_over_bound']:.2f}, overlap "
              f"{r['overlap_fraction']:.2f}, {r['speedup_vs_sync']:.2f}x sync")  # fmt: skip


if __name__ == "__main__":
    main()
