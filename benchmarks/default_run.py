"""The README's default run, measured: `miles-orchestrator run` with no arguments, timed end to end, as JSON.

Runs the built-in example exactly as a user does (`miles-orchestrator run`, plus `run.run_dir`), in a subprocess,
once per `--cluster` (the default config runs on `ray`; `local` is the same run in one process). The bootstrap
policy is cached in `MILES_CACHE_DIR`: `--cold` empties a fresh cache first, so the first run's wall time includes
the bootstrap SFT (the README's "fresh machine" number); later runs reuse it. For each run the JSON holds the wall
time, the bootstrap time (from run.log), the median step time, held-out greedy pass@1 at every evaluation, and the
largest train/rollout log-prob mismatch of any step. With two or more clusters it also says whether their metric
lines are equal on every key but the timings (the runs are bitwise reproducible, whichever cluster runs them).
`--baseline DIR` compares each run's metrics.jsonl with an earlier run's (a refactor must leave them identical;
`--ignore KEY ...` leaves out keys a change is meant to alter, and the JSON says which).
`--config FILE` runs an example config instead (`miles-orchestrator run --config FILE`); its JSON adds every step's
train / rollout log-prob mismatch (mean and largest token: exactly 0 on a true on-policy run), one that
trains the MTP draft online its loss, accuracy and accept length (means over the first and the last 10 steps); a PPO
run's JSON adds the critic's explained variance (mean over the first and the last 10 steps) and its value loss; an
MoE policy's adds the largest routing flip fraction of any step and the expert load imbalance and router entropy
(means over the first and the last 10 steps); an agentic run's (rollout.agent.env) adds its per-step reward,
tool-use share and turns, and their means over the first and the last 5 steps; a LoRA run's (trainer.lora) adds
the bytes each weight sync sent, the median sync time, the last checkpoint's bytes, and the exported adapter's and
merged model's bytes.

    uv run python benchmarks/default_run.py --cold --out benchmarks/results/default_run.json
    uv run python benchmarks/default_run.py --cluster local --baseline runs/before   # a refactor check
    uv run python benchmarks/default_run.py --cluster ray --config examples/ppo_gae.yaml \
        --out benchmarks/results/ppo_example.json
    uv run python benchmarks/default_run.py --cold --cluster ray --config examples/agentic_calculator.yaml \
        --out benchmarks/results/agentic_example.json
    uv run python benchmarks/default_run.py --cluster ray --config examples/lora.yaml \
        --out benchmarks/results/lora_example.json
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from host import host_info

TIMING_KEYS = re.compile(r"(_time_s|_wait_s|_per_s|^time)$")  # durations and rates (rollout_wait_s, sync_wait_s too)


def metric_lines(run_dir: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]


def without_timings(lines: list[dict[str, Any]], ignore: tuple[str, ...] = ()) -> list[dict[str, Any]]:
    return [{k: v for k, v in line.items() if not TIMING_KEYS.search(k) and k not in ignore} for line in lines]


def differences(a: list[dict[str, Any]], b: list[dict[str, Any]], ignore: tuple[str, ...] = ()) -> list[str]:
    """Where two runs' metric lines differ (timings and `ignore` keys left out); empty when every value is equal."""
    a, b = without_timings(a, ignore), without_timings(b, ignore)
    if len(a) != len(b):
        return [f"{len(a)} metric lines vs {len(b)}"]
    out = []
    for x, y in zip(a, b, strict=True):
        for key in sorted(set(x) | set(y)):
            if x.get(key) != y.get(key):
                out.append(f"step {x.get('step')} {key}: {x.get(key)!r} vs {y.get(key)!r}")
    return out


def bootstrap_seconds(log: list[str]) -> float | None:
    """From run.log's timestamps: the bootstrap SFT's first line to its last (None: the cache had the policy)."""
    stamps = [
        (time.mktime(time.strptime(line[:19], "%Y-%m-%d %H:%M:%S")), line[20:]) for line in log if line[:2] == "20"
    ]
    first = next((i for i, (_, text) in enumerate(stamps) if text.startswith("bootstrapping")), None)
    if first is None:
        return None
    last = first
    while last + 1 < len(stamps) and stamps[last + 1][1].startswith(("bootstrap", "epoch")):
        last += 1
    return stamps[last][0] - stamps[first][0]


def run_once(cluster: str, run_dir: Path, env: dict[str, str], config: str | None = None) -> dict[str, Any]:
    command = ["miles-orchestrator", "run", *(["--config", config] if config else []), f"run.run_dir={run_dir}",
               f"run.cluster={cluster}"]  # fmt: skip
    began = time.perf_counter()
    result = subprocess.run(command, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - began
    if result.returncode != 0:
        sys.exit(f"{' '.join(command)} failed ({result.returncode}):\n{result.stderr[-4000:]}")
    lines = metric_lines(run_dir)
    steps = [line for line in lines if line["step"] > 0]
    bootstrap = bootstrap_seconds((run_dir / "run.log").read_text().splitlines())
    critic = {}
    if any("critic_explained_variance" in line for line in steps):
        variance = [line["critic_explained_variance"] for line in steps]
        critic = {
            "critic_explained_variance_first_10_steps": round(statistics.mean(variance[:10]), 4),
            "critic_explained_variance_last_10_steps": round(statistics.mean(variance[-10:]), 4),
            "vf_loss_first_step": steps[0]["vf_loss"], "vf_loss_last_step": steps[-1]["vf_loss"],
            "reward_mean_last_10_steps": round(statistics.mean(line["reward_mean"] for line in steps[-10:]), 4),
        }  # fmt: skip
    moe = {}
    if any("moe_load_imbalance" in line for line in steps):  # an MoE policy: its routing over the run
        moe = {"max_moe_routing_flip_frac": max(line.get("moe_routing_flip_frac", 0.0) for line in steps)}
        for key in ("moe_load_imbalance", "moe_router_entropy"):
            moe[f"{key}_first_10_steps"] = round(statistics.mean(line[key] for line in steps[:10]), 3)
            moe[f"{key}_last_10_steps"] = round(statistics.mean(line[key] for line in steps[-10:]), 3)
    off_policy = {}
    if any("train_rollout_logprob_abs_diff" in line for line in steps):  # every step's mismatch (0: on-policy)
        for key in ("train_rollout_logprob_abs_diff", "train_rollout_logprob_abs_diff_max"):
            off_policy[f"{key}_per_step"] = [line.get(key) for line in steps]
    draft = {}
    if any("mtp_loss" in line for line in steps):  # the MTP draft trained online: its loss and acceptance
        for key in ("mtp_loss", "mtp_accuracy_0", "spec_accept_length"):
            draft[f"{key}_first_10_steps"] = round(statistics.mean(line[key] for line in steps[:10]), 4)
            draft[f"{key}_last_10_steps"] = round(statistics.mean(line[key] for line in steps[-10:]), 4)
    agent = {}
    if any("agent_tool_use_frac" in line for line in steps):  # an agentic run: its curve of tool use and reward
        agent = {
            "reward_mean_per_step": [round(line["reward_mean"], 4) for line in steps],
            "agent_tool_use_frac_per_step": [round(line["agent_tool_use_frac"], 4) for line in steps],
            "agent_turns_mean_per_step": [round(line["agent_turns_mean"], 3) for line in steps],
            "agent_tool_errors_total": sum(line["agent_tool_errors"] for line in steps),
        }
        for key in ("reward_mean", "agent_tool_use_frac", "agent_turns_mean", "agent_tokens_per_turn"):
            agent[f"{key}_first_5_steps"] = round(statistics.mean(line[key] for line in steps[:5]), 4)
            agent[f"{key}_last_5_steps"] = round(statistics.mean(line[key] for line in steps[-5:]), 4)
    lora = {}
    if (run_dir / "final" / "adapter_config.json").is_file():  # a LoRA run: what it syncs, checkpoints and exports
        checkpoints = sorted((run_dir / "checkpoints").glob("step_*"))
        lora = {
            "sync_bytes_per_step": max(line.get("sync_bytes", 0.0) for line in steps),
            "median_sync_time_s": round(statistics.median(line["sync_time_s"] for line in steps), 4),
            "checkpoint_bytes": sum(f.stat().st_size for f in checkpoints[-1].rglob("*") if f.is_file())
            if checkpoints
            else None,
            "adapter_bytes": (run_dir / "final" / "adapter_model.safetensors").stat().st_size,
            "policy_bytes": sum(f.stat().st_size for f in (run_dir / "final" / "merged").glob("*.safetensors")),
        }
    return (
        critic
        | moe
        | off_policy
        | draft
        | agent
        | lora
        | {
            "command": " ".join(command),
            "wall_time_s": round(wall, 1),
            "bootstrap_time_s": bootstrap,
            "num_steps": len(steps),
            "median_step_time_s": round(statistics.median(line["step_time_s"] for line in steps), 3),
            "eval_pass_at_1": {line["step"]: line["eval_pass@1"] for line in lines if "eval_pass@1" in line},
            "max_train_rollout_logprob_abs_diff": max(
                (line.get("train_rollout_logprob_abs_diff_max", 0.0) for line in steps), default=None
            ),
        }
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="benchmarks/results/default_run.json", help="JSON output path")
    parser.add_argument("--cluster", nargs="+", default=["ray", "local"], choices=["ray", "local"])
    parser.add_argument("--cold", action="store_true", help="start from an empty bootstrap cache")
    parser.add_argument("--keep", default=None, help="keep the run directories under this path")
    parser.add_argument("--baseline", default=None, help="a run directory whose metrics.jsonl each run must equal")
    parser.add_argument("--config", default=None, help="a run config to run instead of the defaults")
    parser.add_argument("--ignore", nargs="*", default=[], help="metric keys the baseline comparison leaves out, "
                        "where a change is meant to alter them (e.g. sync_bytes when the weights grow)")  # fmt: skip
    args = parser.parse_args()

    work = Path(args.keep or tempfile.mkdtemp(prefix="miles-default-run-"))
    work.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ)
    if args.cold:
        cache = work / "cache"
        shutil.rmtree(cache, ignore_errors=True)
        env["MILES_CACHE_DIR"] = str(cache)
    runs: dict[str, Any] = {}
    histories = {}
    for cluster in args.cluster:
        run_dir = work / cluster
        shutil.rmtree(run_dir, ignore_errors=True)
        runs[cluster] = run_once(cluster, run_dir, env, args.config)
        histories[cluster] = metric_lines(run_dir)
        if args.baseline:
            diff = differences(histories[cluster], metric_lines(Path(args.baseline)), tuple(args.ignore))
            runs[cluster]["equal_to_baseline"] = not diff
            runs[cluster]["baseline_keys_ignored"] = args.ignore
            runs[cluster]["baseline_differences"] = diff[:20]
        print(json.dumps({cluster: runs[cluster]}, indent=2))
    result: dict[str, Any] = {
        "script_command": " ".join(["python", *sys.argv]),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "host": host_info(),
        "cold_cache_first_run": args.cold,
        "runs": runs,
    }
    if len(histories) > 1:
        first, *others = histories
        result["clusters_equal_but_timings"] = all(
            not differences(histories[first], histories[other]) for other in others
        )
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out}")
    if not args.keep:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
