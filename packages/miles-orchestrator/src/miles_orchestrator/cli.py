"""`miles-orchestrator` command line.

    miles-orchestrator run                              # the built-in example: bootstrap + GRPO on a CPU
    miles-orchestrator run --config job.yaml trainer.lr=1e-6 rollout.n_samples_per_prompt=16
    miles-orchestrator run --resume runs/miles           # continue a stopped run at its last checkpoint
    miles-orchestrator config show [--config job.yaml] [overrides...]

A bad config value fails at start-up with the dotted field and what to change (exit status 2).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from miles_orchestrator.config import RunConfig, config_help, dump_config, load_config

CONFIG_FILE = "config.yaml"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="miles-orchestrator", description="Miles orchestrator: run true on-policy RL."
    )
    subcommands = parser.add_subparsers(dest="command", metavar="COMMAND")
    run = subcommands.add_parser(
        "run", help="Run RL post-training (no arguments: the built-in CPU example)",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Run RL post-training. Settings come from the defaults, then --config, then dotted overrides "
        "(section.field=value).", epilog="config fields (default: description):\n" + config_help(RunConfig),
    )  # fmt: skip
    run.add_argument("--config", help="YAML run config")
    run.add_argument("--resume", metavar="RUN_DIR", help="continue the run in RUN_DIR from its latest checkpoint")
    run.add_argument("--quiet", action="store_true", help="no console output (metrics still go to the run dir)")
    run.add_argument("overrides", nargs="*", metavar="section.field=value", help="config overrides")
    config = subcommands.add_parser("config", help="Show the resolved run config")
    config.add_argument("action", choices=["show"], help="show: print the resolved config as YAML")
    config.add_argument("--config", help="YAML run config")
    config.add_argument("overrides", nargs="*", metavar="section.field=value", help="config overrides")
    return parser


def resolve(args: argparse.Namespace) -> RunConfig:
    """Defaults ← --config (or the resumed run's config.yaml) ← overrides."""
    overrides = list(args.overrides)
    path = args.config
    if getattr(args, "resume", None):
        run_dir = Path(args.resume)
        if not (run_dir / CONFIG_FILE).is_file():
            raise ValueError(f"--resume {run_dir}: no {CONFIG_FILE} there; give the run_dir of a run that started")
        if path is not None:
            raise ValueError("--resume uses the run's own config.yaml; drop --config (overrides are allowed)")
        path = str(run_dir / CONFIG_FILE)
        overrides.append(f"run.run_dir={run_dir}")
    return load_config(path, overrides)


def _run(args: argparse.Namespace) -> int:
    cfg = resolve(args)
    from miles_orchestrator.bootstrap import bootstrap_policy
    from miles_orchestrator.loop import check_plugins, run_sync
    from miles_orchestrator.report import report
    from miles_orchestrator.run_dir import RunDir

    log = cfg.run.log
    if cfg.model.path is not None and not (Path(cfg.model.path) / "config.json").is_file():
        raise ValueError(f"model.path={cfg.model.path}: no config.json there; give a Hugging Face model directory")
    run = RunDir(cfg.run.run_dir, tensorboard=log.tensorboard, wandb_project=log.wandb_project if log.wandb else None,
                 quiet=args.quiet)  # fmt: skip
    if not args.resume and run.latest_checkpoint() is not None:
        raise ValueError(f"{run.path} already holds a run; resume it with --resume {run.path}, or set run.run_dir")
    (run.path / CONFIG_FILE).write_text(dump_config(cfg))
    check_plugins(cfg)  # a wrong plug-in path fails now, before any bootstrap or Ray start
    model_dir = cfg.model.path or bootstrap_policy(cfg, log=run.log)
    history = run_sync(cfg, model_dir, run)
    report(history, run.path, run.console)
    run.log(f"done: {run.path} (final policy in {run.path / 'final'})")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    # Overrides may come before or after options (`run --resume DIR trainer.lr=1e-6`): argparse stops filling a
    # positional list at the first option, so the rest arrive as unknown arguments.
    args, extra = parser.parse_known_args(argv)
    unknown = [e for e in extra if e.startswith("-") or "=" not in e]
    if unknown:
        parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    if args.command is not None:
        args.overrides = [*args.overrides, *(e for e in extra if e not in unknown)]
    if args.command is None:
        parser.print_help()
        return 2
    try:
        if args.command == "config":
            print(dump_config(resolve(args)), end="")
            return 0
        return _run(args)
    except ValueError as error:
        print(f"miles-orchestrator {args.command}: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
