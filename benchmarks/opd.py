"""On-policy distillation, measured: examples/opd.yaml (a 4-layer built-in student distilled from an 8-layer built-in
teacher, pure distillation: the advantage is the sampled-token reverse KL alone) beside the obvious alternative, GRPO
on the task reward (the default config: same student, steps, evaluations), and the two together (the KL added to
GRPO's advantage: `opd.task_reward=true`), per seed, as JSON.

Each run is `miles-orchestrator run` in a subprocess on the local cluster (`run.seed=s`: other samples and prompt
order; the bootstrapped student and teacher are the same across seeds and cached in `--cache`). Per run: held-out
greedy pass@1 at every evaluation (step 0 is the student before any step), the teacher's own held-out pass@1 (logged
at step 0), the train/rollout log-prob mismatch (mean over steps and largest token), the mean reverse KL of the first
and last 10 steps, the median step time and the wall time. Per seed: the share of the student-to-teacher gap the
student closed, (last - first) / (teacher - first), for each.

    uv run python benchmarks/opd.py --out benchmarks/results/opd.json          # 3 seeds x 3 runs, ~20 min
    uv run python benchmarks/opd.py --seeds 0 --num-steps 10 --out /tmp/opd.json   # a quick check
    uv run python benchmarks/opd.py --variants opd opd_topk --out benchmarks/results/opd_topk.json  # the top-k loss

`opd_topk` is examples/opd.yaml with `opd.top_k=8`: the teacher's top-8 forward KL as a loss term instead of the
sampled token's reverse KL in the advantage (its first / last 10 steps' mean `opd_topk_kl` recorded too).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from host import host_info, write_results
from low_precision import run_config


def summarize(run: dict[str, Any], run_dir: Path) -> dict[str, Any]:
    """`run_config`'s summary plus the distillation metrics of the run's metric lines."""
    from default_run import metric_lines

    lines = metric_lines(run_dir)
    steps = [line for line in lines if line["step"] > 0]
    kls = [line["opd_reverse_kl"] for line in steps if "opd_reverse_kl" in line]
    teacher = next((line["teacher_eval_pass@1"] for line in lines if "teacher_eval_pass@1" in line), None)
    out = {key: run[key] for key in ("command", "wall_time_s", "median_step_time_s", "eval_pass_at_1",
                                     "eval_pass_at_1_first", "eval_pass_at_1_last", "mismatch")}  # fmt: skip
    out["load_average_1min"] = run["load_average_1min"]
    out["teacher_eval_pass_at_1"] = teacher
    if kls:
        out["opd_reverse_kl_first_10_steps"] = round(statistics.mean(kls[:10]), 4)
        out["opd_reverse_kl_last_10_steps"] = round(statistics.mean(kls[-10:]), 4)
    topk = [line["opd_topk_kl"] for line in steps if "opd_topk_kl" in line]
    if topk:
        out["opd_topk_kl_first_10_steps"] = round(statistics.mean(topk[:10]), 4)
        out["opd_topk_kl_last_10_steps"] = round(statistics.mean(topk[-10:]), 4)
    return out


def gap_closed(run: dict[str, Any], teacher: float | None) -> float | None:
    first, last = run["eval_pass_at_1_first"], run["eval_pass_at_1_last"]
    if teacher is None or first is None or teacher <= first:
        return None
    return round((last - first) / (teacher - first), 4)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="benchmarks/results/opd.json")
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    parser.add_argument("--num-steps", type=int, default=None, help="override the example's run.num_steps")
    parser.add_argument("--variants", nargs="+", default=["opd", "opd_plus_task", "grpo"],
                        choices=["opd", "opd_plus_task", "grpo", "opd_topk"])  # fmt: skip
    parser.add_argument("--cache", default=None, help="MILES_CACHE_DIR for the bootstraps (default: the user's)")
    args = parser.parse_args()
    if args.cache:
        os.environ["MILES_CACHE_DIR"] = args.cache
    began = time.perf_counter()
    steps = [f"run.num_steps={args.num_steps}"] if args.num_steps else []
    # GRPO with the example's evaluation cadence and steps, on the task reward (the default config otherwise)
    configs = {
        "opd": ["--config", "examples/opd.yaml"],
        # the teacher's KL added to GRPO's advantage on the task reward (dynamic sampling back on, as in GRPO)
        "opd_plus_task": ["--config", "examples/opd.yaml", "opd.task_reward=true", "filter.dynamic_sampling=true"],
        "grpo": ["run.num_steps=60", "run.eval_every=20"],
        # the teacher's top-8 forward KL as a loss term instead of the sampled token's reverse KL in the advantage
        "opd_topk": ["--config", "examples/opd.yaml", "opd.top_k=8"],
    }
    configs = {label: configs[label] for label in args.variants}
    runs: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory(prefix="miles-opd-") as tmp:
        for seed in args.seeds:
            for label, config in configs.items():
                name = f"{label}_seed{seed}"
                run_dir = Path(tmp) / name
                overrides = [*config, *steps, "run.cluster=local", f"run.seed={seed}"]
                runs[name] = summarize(run_config(name, overrides, run_dir), run_dir)
                row = runs[name]
                print(f"{name}: pass@1 {row['eval_pass_at_1']}, teacher {row['teacher_eval_pass_at_1']}, "
                      f"mismatch {row['mismatch']}", flush=True)  # fmt: skip
    teachers = [r["teacher_eval_pass_at_1"] for r in runs.values() if r["teacher_eval_pass_at_1"] is not None]
    teacher = teachers[0] if teachers else None
    per_seed = {
        seed: {label: gap_closed(runs[f"{label}_seed{seed}"], teacher) for label in configs} for seed in args.seeds
    }
    results = {
        "script_command": " ".join(["python", *sys.argv]),
        "host": host_info(),
        "teacher_eval_pass_at_1": teacher,
        "gap_closed_per_seed": per_seed,
        "runs": runs,
    }
    write_results(args.out, results, began)


if __name__ == "__main__":
    main()
