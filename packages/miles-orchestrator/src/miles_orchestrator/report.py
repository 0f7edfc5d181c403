"""The end of a run: a summary table on the console, `summary.png` (reward and evaluation curves) and `timeline.png`
(the phases of every step, timeline.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from miles_orchestrator.timeline import Timeline, plot_timeline


def summary_table(history: list[dict[str, Any]]) -> Table:
    """First vs last value of the metrics a user checks first, over the steps that logged them."""
    table = Table(title="miles run summary")
    for column in ("metric", "first", "last", "best"):
        table.add_column(column, justify="right" if column != "metric" else "left")
    keys = ["reward_mean", "pass_rate", "eval_pass@1", "train_rollout_logprob_abs_diff",
            "train_rollout_logprob_abs_diff_max", "kl", "entropy", "tokens_per_s", "rollout_tflops_per_s",
            "rollout_mfu", "train_tflops_per_s", "train_mfu", "step_time_s"]  # fmt: skip
    keys += sorted(k for row in history for k in row if k.startswith("eval_pass@") and k not in keys)
    for key in dict.fromkeys(keys):
        values = [row[key] for row in history if key in row]
        if not values:
            continue
        direction = metric_direction(key)
        best = "-" if direction is None else f"{(max if direction == 'higher' else min)(values):.4g}"
        table.add_row(key, f"{values[0]:.4g}", f"{values[-1]:.4g}", best)
    return table


LOWER_IS_BETTER = ("train_rollout_logprob_abs_diff", "kl", "step_time_s")
HIGHER_IS_BETTER = (
    "reward_mean",
    "pass_rate",
    "eval_pass@",
    "tokens_per_s",
    "rollout_tflops",
    "rollout_mfu",
    "train_tflops",
    "train_mfu",
)


def metric_direction(key: str) -> str | None:
    """'higher' or 'lower' (which way a metric improves), or None where neither is better (entropy)."""
    if key.startswith(LOWER_IS_BETTER):
        return "lower"
    if key.startswith(HIGHER_IS_BETTER):
        return "higher"
    return None


def plot_curves(history: list[dict[str, Any]], path: Path) -> Path:
    """Training reward (every rollout, and the batch kept by the filters) and held-out pass@k against the step."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axis = plt.subplots(figsize=(7, 4))
    curves = (("reward_mean", "-", "reward (all rollouts)"), ("batch_reward_mean", "--", "reward (trained batch)"))
    for key, style, label in curves:
        points = [(row["step"], row[key]) for row in history if key in row]
        if points:
            axis.plot(*zip(*points, strict=True), style, label=label)
    for key in sorted({k for row in history for k in row if k.startswith("eval_pass@")}):
        points = [(row["step"], row[key]) for row in history if key in row]
        axis.plot(*zip(*points, strict=True), "o-", label=f"held-out {key.removeprefix('eval_')}")
    axis.set_xlabel("RL step")
    axis.set_ylim(-0.02, 1.02)
    axis.grid(alpha=0.3)
    axis.legend(loc="lower right")
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
    return path


def report(history: list[dict[str, Any]], run_dir: Path, console: Console) -> None:
    console.print(summary_table(history))
    console.print(f"curves: {plot_curves(history, run_dir / 'summary.png')}")
    timeline = plot_timeline(Timeline(run_dir / "timeline.jsonl").spans(), run_dir / "timeline.png")
    if timeline is not None:
        console.print(f"phases: {timeline}")
