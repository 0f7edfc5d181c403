"""The debugging walk-through of docs/debugging.md, measured: a run with a bad step, then inspect, mismatch and replay.

The built-in example (Ray, the bootstrapped policy) for 6 steps with an FP8 engine and no QAT
(`rollout.engine.weight_dtype=fp8_block`), so the rollout's log-probs are not the trainer's: once with
`run.save_rollouts=true` and step 5 profiled, once without (the same steps bit for bit: the cost of saving is the
difference in the time of steps 2 and 4, which neither checkpoint nor profile); a checkpoint every 3 steps in both.
Then, on step 5: `miles-orchestrator inspect`, `mismatch --layers` and `replay` (from the step-3 checkpoint: steps
4 and 5). Records the token mismatch summary, the first divergent layer, the replay's verdicts, what saving costs
(bytes per step, `save_rollouts_s`, step times with and without), the profile's trace files, the commands' wall
times and the machine; copies the plots to docs/images/.

    uv run python benchmarks/debugging.py --out benchmarks/results/debugging.json
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

from host import host_info

ROOT = Path(__file__).resolve().parents[1]
RUN = ["run.num_steps=6", "run.eval_every=0", "run.checkpoint_every=3", "rollout.engine.weight_dtype=fp8_block"]
DEBUG = ["run.save_rollouts=true", "run.profile_steps=[5]"]
STEP = 5
PLAIN_STEPS = (2, 4)  # neither the first (warm-up), a checkpoint's (3, 6) nor the profiled one
SAME_KEYS = ("reward_mean", "loss", "grad_norm", "num_tokens", "train_rollout_logprob_abs_diff")


def command(*args: str) -> tuple[subprocess.CompletedProcess[str], float]:
    began = time.perf_counter()
    result = subprocess.run(["miles-orchestrator", *args], capture_output=True, text=True, timeout=1800)
    if result.returncode not in (0, 1):
        raise RuntimeError(f"miles-orchestrator {' '.join(args)} failed:\n{result.stderr[-3000:]}")
    return result, time.perf_counter() - began


def history(run_dir: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="benchmarks/results/debugging.json")
    parser.add_argument("--images", default=str(ROOT / "docs" / "images"))
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="miles-debugging-"))
    saved, plain = root / "saved", root / "plain"
    _, saved_s = command("run", "--quiet", *RUN, *DEBUG, f"run.run_dir={saved}")
    _, plain_s = command("run", "--quiet", *RUN, f"run.run_dir={plain}")
    with_saving, without = history(saved)[1:], history(plain)[1:]
    same = all(a.get(k) == b.get(k) for a, b in zip(with_saving, without, strict=True) for k in SAME_KEYS)

    inspected, inspect_s = command("inspect", str(saved), "--step", str(STEP))
    mismatched, mismatch_s = command("mismatch", str(saved), "--step", str(STEP), "--layers")
    replayed, replay_s = command("replay", str(saved), "--step", str(STEP), "--quiet")
    report = json.loads((saved / "mismatch" / f"step_{STEP:06d}.json").read_text())
    verdicts = json.loads((saved / "replay" / f"step_{STEP:06d}" / "replay.json").read_text())
    tokens, layers = report["tokens"], report["layers"]
    rollouts = sorted((saved / "rollouts").glob("step_*.parquet"))
    profile = saved / "profiles" / f"step_{STEP:06d}"
    results = {
        "what": "docs/debugging.md's walk-through: the built-in example, 6 steps, FP8 engine without QAT (Ray)",
        "command": "uv run python benchmarks/debugging.py",
        "host": host_info(),
        "steps_equal_with_and_without_saving": same,
        "saving": {
            "parquet_bytes_per_step": statistics.median(p.stat().st_size for p in rollouts),
            "outcome_bytes_per_step": statistics.median(p.with_suffix(".json").stat().st_size for p in rollouts),
            "save_rollouts_s_median": statistics.median(r["save_rollouts_s"] for r in with_saving),
            "step_time_s_saving": [r["step_time_s"] for r in with_saving if r["step"] in PLAIN_STEPS],
            "step_time_s_plain": [r["step_time_s"] for r in without if r["step"] in PLAIN_STEPS],
        },
        "profile": {
            "files": {p.name: p.stat().st_size for p in sorted(profile.iterdir())},
            "profiled_step_time_s": next(r["step_time_s"] for r in with_saving if r["step"] == STEP),
            "same_step_unprofiled_s": next(r["step_time_s"] for r in without if r["step"] == STEP),
        },
        "mismatch": {
            "num_tokens": tokens["num_tokens"],
            "mean": tokens["mean"],
            "max": tokens["max"],
            "fraction_exact": tokens["fraction_exact"],
            "quantiles": tokens["quantiles"],
            "step_metric_mean": next(r for r in with_saving if r["step"] == STEP)["train_rollout_logprob_abs_diff"],
            "worst_token": tokens["worst_tokens"][0],
            "first_inexact_layer": layers["first_inexact_layer"],
            "first_divergent_layer": layers["first_divergent_layer"],
            "layers": layers["layers"],
        },
        "replay": {
            "exit_status": replayed.returncode,
            "start_checkpoint": verdicts["start_checkpoint"],
            "steps": [{"step": s["step"], "is_identical": s["is_identical"]} for s in verdicts["steps"]],
        },
        "seconds": {
            "run_saving": saved_s,
            "run_plain": plain_s,
            "inspect": inspect_s,
            "mismatch_layers": mismatch_s,
            "replay": replay_s,
        },
        "console": {
            "inspect_head": inspected.stdout.splitlines()[:8],
            "mismatch": mismatched.stdout.splitlines(),
            "replay": replayed.stdout.splitlines(),
        },
    }
    images = Path(args.images)
    images.mkdir(parents=True, exist_ok=True)
    shutil.copy(saved / "mismatch" / f"step_{STEP:06d}.png", images / "debugging_mismatch.png")
    shutil.copy(saved / "mismatch" / f"step_{STEP:06d}_layers.png", images / "debugging_layers.png")
    shutil.copy(saved / "timeline.png", images / "debugging_timeline.png")
    Path(args.out).write_text(json.dumps(results, indent=1) + "\n")
    print(json.dumps({k: results[k] for k in ("steps_equal_with_and_without_saving", "saving", "replay")}, indent=1))
    shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
