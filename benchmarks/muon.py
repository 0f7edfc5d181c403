"""Muon beside AdamW, measured: the default example (the built-in task, GRPO, true on-policy) with
`trainer.optimizer.algorithm=muon` (Muon for the policy's trunk matrices, AdamW for the rest; the same learning rate
and weight decay, Moonlight's RMS-matched update) and with AdamW (the default), per seed, as JSON.

Each run is `miles-orchestrator run` in a subprocess on the local cluster (`run.seed=s`; the bootstrapped policy is
the same for every run, cached). Per run: held-out greedy pass@1 at every evaluation, the mismatch (0 under true
on-policy), the median step time and the median train time of a step (the optimizer's cost shows there: Muon's
Newton-Schulz iterations on every matrix), the wall time.

    uv run python benchmarks/muon.py --out benchmarks/results/muon.json            # 2 seeds x 2 runs, ~12 min
    uv run python benchmarks/muon.py --seeds 0 --num-steps 10 --out /tmp/muon.json  # a quick check
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from default_run import metric_lines
from host import host_info, write_results
from low_precision import run_config


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="benchmarks/results/muon.json")
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1])
    parser.add_argument("--num-steps", type=int, default=60)
    args = parser.parse_args()
    began = time.perf_counter()
    runs: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory(prefix="miles-muon-") as tmp:
        for seed in args.seeds:
            for name in ("adamw", "muon"):
                label, run_dir = f"{name}_seed{seed}", Path(tmp) / f"{name}_seed{seed}"
                overrides = [f"trainer.optimizer.algorithm={name}", f"run.num_steps={args.num_steps}",
                             "run.eval_every=20", "run.cluster=local", f"run.seed={seed}"]  # fmt: skip
                summary = run_config(label, overrides, run_dir)
                steps = [line for line in metric_lines(run_dir) if line["step"] > 0]
                summary["median_train_time_s"] = round(statistics.median(line["train_time_s"] for line in steps), 4)
                runs[label] = {key: summary[key] for key in (
                    "command", "wall_time_s", "load_average_1min", "median_step_time_s", "median_train_time_s",
                    "eval_pass_at_1", "eval_pass_at_1_first", "eval_pass_at_1_last", "mismatch")}  # fmt: skip
                print(f"{label}: pass@1 {summary['eval_pass_at_1']}, train {summary['median_train_time_s']} s",
                      flush=True)  # fmt: skip
    gains = {label: round(run["eval_pass_at_1_last"] - run["eval_pass_at_1_first"], 4) for label, run in runs.items()}
    train_time_ratio = {
        seed: round(runs[f"muon_seed{seed}"]["median_train_time_s"] / runs[f"adamw_seed{seed}"]["median_train_time_s"],
                    3)
        for seed in args.seeds
    }  # fmt: skip
    results = {
        "script_command": " ".join(["python", *sys.argv]),
        "host": host_info(),
        "num_steps": args.num_steps,
        "pass_at_1_gain": gains,
        "muon_over_adamw_train_time": train_time_ratio,
        "runs": runs,
    }
    write_results(args.out, results, began)


if __name__ == "__main__":
    main()
