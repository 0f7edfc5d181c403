"""`miles-memory` command line.

Miles memory: plan and inspect memory for colocated runs. `plan` answers, per GPU, whether a run config fits a
hardware profile (exit 0), does not (exit 1, with the lever), or is bad input (exit 2, one line saying what to fix).
"""

from __future__ import annotations

import argparse
import json
import sys

from miles_memory.hardware import HARDWARE


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="miles-memory", description="Miles memory: plan and inspect memory for colocated runs."
    )
    subcommands = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub = subcommands.add_parser(
        "plan",
        help="Will a run config fit a hardware profile? Bytes per GPU by tag and phase, the margin and the lever",
        description="Plan a run config's memory per GPU (docs/memory-planner.md). Exit 0: fits; 1: does not fit; "
        "2: bad input.",
    )
    sub.add_argument("--config", required=True, help="Run config YAML (the orchestrator's format, with memory.plan)")
    sub.add_argument(
        "--hardware", help=f"Hardware profile: {', '.join(HARDWARE)} (default: memory.plan.hardware, else cpu)"
    )
    sub.add_argument("--nodes", type=int, help="Nodes of the hardware (default: memory.plan.nodes)")
    sub.add_argument("--json", action="store_true", help="Print the plan as JSON")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    from miles_memory.planner import plan_memory

    if args.nodes is not None and args.nodes < 1:
        print("miles-memory plan: --nodes must be >= 1", file=sys.stderr)
        return 2
    try:
        plan = plan_memory(args.config, args.hardware, args.nodes)
    except ValueError as error:
        print(f"miles-memory plan: {error}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(plan.model_dump(mode="json"), indent=2))
    else:
        print(plan.render(), end="")
    return 0 if plan.fits else 1


if __name__ == "__main__":
    sys.exit(main())
