"""The debugging commands of `miles-orchestrator` (docs/debugging.md), on a run directory and one of its steps:

    miles-orchestrator inspect RUN_DIR --step N [--sample K]     a saved step (run.save_rollouts), or one sample
    miles-orchestrator mismatch RUN_DIR --step N [--layers]      where trainer and rollout log-probs disagree
    miles-orchestrator replay RUN_DIR --step N                   train step N again: the same update, or what differs

Each reads the run's own config.yaml (dotted overrides after it, e.g. run.num_threads=1) and the model directory the
run started from (RUN_DIR/policy.json). A bad argument is a ValueError (exit status 2); replay exits with status 1
when the update differs.
"""

from __future__ import annotations

import argparse
import asyncio
import json
from pathlib import Path
from typing import Any

from miles_orchestrator.config import RunConfig, load_config

CONFIG_FILE = "config.yaml"


def add_commands(subcommands: Any) -> None:
    """The inspect, mismatch and replay sub-parsers."""
    inspect = subcommands.add_parser("inspect", help="Show a saved step's samples, or one sample token by token")
    mismatch = subcommands.add_parser(
        "mismatch", help="Where the trainer's log-probs and the rollout's disagree (JSON + PNG in RUN_DIR/mismatch)"
    )
    replay = subcommands.add_parser("replay", help="Train a saved step again and compare the update with the run's")
    for parser in (inspect, mismatch, replay):
        parser.add_argument("run_dir", metavar="RUN_DIR", help="the run's directory")
        parser.add_argument("--step", type=int, required=True, help="the RL step")
        parser.add_argument("overrides", nargs="*", metavar="section.field=value", help="config overrides")
    inspect.add_argument("--sample", type=int, help="one sample, by its # in the step's table")
    mismatch.add_argument("--worst", type=int, default=20, help="how many of the worst tokens to list")
    mismatch.add_argument("--layers", action="store_true",
                          help="also find the first layer where the embedded engine's hidden states and the "
                          "trainer's part (a local cluster, one batch)")  # fmt: skip
    mismatch.add_argument("--num-samples", type=int, default=4, help="--layers: how many of the step's samples")
    mismatch.add_argument("--tolerance", type=float, default=1e-3,
                          help="--layers: a layer diverges when max|Δ| / max|value| exceeds this")  # fmt: skip
    replay.add_argument("--quiet", action="store_true", help="no console log (it still goes to the replay's run.log)")


def run_command(args: argparse.Namespace) -> int:
    run_dir = Path(args.run_dir)
    if not (run_dir / CONFIG_FILE).is_file():
        raise ValueError(f"{run_dir}: no {CONFIG_FILE} there; give the run_dir of a run that started")
    if args.step < 1:
        raise ValueError(f"--step {args.step}: steps start at 1")
    return {"inspect": _inspect, "mismatch": _mismatch, "replay": _replay}[args.command](args, run_dir)


def _config(run_dir: Path, overrides: list[str]) -> RunConfig:
    return load_config(str(run_dir / CONFIG_FILE), [*overrides, f"run.run_dir={run_dir}"])


def _tokenizer(run_dir: Path, cfg: RunConfig) -> Any | None:
    """The run's tokenizer, where its model directory is still there (token texts are shown then)."""
    from miles_orchestrator.run_dir import RunDir

    model_dir = RunDir(run_dir, quiet=True).policy() or cfg.model.path
    if model_dir is None:
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


def _inspect(args: argparse.Namespace, run_dir: Path) -> int:
    from rich.console import Console

    from miles_orchestrator.inspection import sample_view, step_view
    from miles_orchestrator.rollout_dump import load_step

    saved = load_step(run_dir, args.step)
    console = Console()
    if not console.is_terminal:  # piped to a file or a pager: a width that keeps every column whole
        console = Console(width=160)
    if args.sample is None:
        console.print(step_view(saved))
    else:
        console.print(sample_view(saved, args.sample, _tokenizer(run_dir, _config(run_dir, args.overrides))))
    return 0


def _mismatch(args: argparse.Namespace, run_dir: Path) -> int:
    from miles_orchestrator.mismatch import plot_layers, plot_token_mismatch, token_mismatch
    from miles_orchestrator.rollout_dump import load_step

    saved = load_step(run_dir, args.step)
    cfg = _config(run_dir, args.overrides)
    out = run_dir / "mismatch"
    out.mkdir(exist_ok=True)
    report: dict[str, Any] = {"tokens": token_mismatch(saved, _tokenizer(run_dir, cfg), args.worst)}
    plot_token_mismatch(report["tokens"], out / f"step_{args.step:06d}.png")
    tokens = report["tokens"]
    print(
        f"step {args.step}: {tokens['num_tokens']} trained tokens, |Δlogp| mean {tokens['mean']:.3g}, "
        f"p99 {tokens['quantiles']['p99']:.3g}, max {tokens['max']:.3g}, {tokens['fraction_exact']:.1%} exactly 0"
    )
    for worst in tokens["worst_tokens"][:5] if tokens["max"] else []:
        print(f"  sample #{worst['sample']} position {worst['position']}: |Δ| {worst['abs_diff']:.3g} "
              f"(rollout {worst['rollout_logprob']:.4f}, trainer {worst['trainer_logprob']:.4f}) "
              f"{worst.get('context', '')!r} → {worst.get('text', worst['token'])!r}")  # fmt: skip
    if args.layers:
        report["layers"] = _layers(cfg, run_dir, saved, args)
        plot_layers(report["layers"], out / f"step_{args.step:06d}_layers.png")
        layers = report["layers"]
        print(f"layers: first inexact {layers['first_inexact_layer']}, first divergent (relative > "
              f"{args.tolerance:g}) {layers['first_divergent_layer']}")  # fmt: skip
    (out / f"step_{args.step:06d}.json").write_text(json.dumps(report, indent=1) + "\n")
    print(f"report: {out / f'step_{args.step:06d}.json'} (plots beside it)")
    return 0


def _layers(cfg: RunConfig, run_dir: Path, saved: Any, args: argparse.Namespace) -> dict[str, Any]:
    """The layer comparison on a local cluster brought to the weights before the step."""
    if cfg.rollout.backend == "sglang":
        raise ValueError("--layers compares the embedded engine's layers with the trainer's; this run used SGLang")
    cfg = load_config(str(run_dir / CONFIG_FILE), [*args.overrides, f"run.run_dir={run_dir}", "run.cluster=local",
                                                   "run.mode=sync"])  # fmt: skip
    from miles_orchestrator.cluster.local import LocalCluster
    from miles_orchestrator.mismatch import layer_divergence
    from miles_orchestrator.replay import train_to
    from miles_orchestrator.run_dir import RunDir

    run = RunDir(run_dir, quiet=True)
    scratch = RunDir(run_dir / "mismatch" / f"step_{args.step:06d}", quiet=True)

    async def compare() -> dict[str, Any]:
        cluster = await LocalCluster.start(cfg, _policy(cfg, run), scratch.path)
        try:
            await train_to(cfg, cluster, run, args.step - 1, scratch, checkpoint_before=args.step)
            await cluster.engine.resume_memory_occupation()
            await cluster.sync_weights(args.step - 1, cfg.run.sync_bucket_bytes)
            return await layer_divergence(cluster, saved.samples[: args.num_samples], args.tolerance)
        finally:
            await cluster.shutdown()

    return asyncio.run(compare())


def _replay(args: argparse.Namespace, run_dir: Path) -> int:
    from miles_orchestrator.replay import replay
    from miles_orchestrator.run_dir import RunDir

    cfg = _config(run_dir, args.overrides)
    run = RunDir(run_dir, quiet=True)
    scratch = RunDir(run_dir / "replay" / f"step_{args.step:06d}", quiet=args.quiet)
    verdicts = asyncio.run(replay(cfg, _policy(cfg, run), run, args.step, scratch))
    for verdict in verdicts:
        print(verdict.describe())
    print(f"report: {scratch.path / 'replay.json'}")
    return 0 if all(v.is_identical for v in verdicts) else 1


def _policy(cfg: RunConfig, run: Any) -> str:
    """The model directory the run started from (RUN_DIR/policy.json), else resolved again as a run does."""
    recorded = run.policy()
    if recorded is not None:
        return str(recorded)
    from miles_orchestrator.data.bootstrap import bootstrap_policy
    from miles_orchestrator.preflight import with_fresh_draft

    return with_fresh_draft(cfg, cfg.model.path or bootstrap_policy(cfg, log=run.log), run)
