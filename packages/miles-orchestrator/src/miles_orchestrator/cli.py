"""`miles-orchestrator` command line.

Miles orchestrator: run true on-policy RL.
Subcommands that a later issue implements say so and exit with status 2; none pretends to work.
"""

from __future__ import annotations

import argparse
import sys


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="miles-orchestrator", description="Miles orchestrator: run true on-policy RL."
    )
    subcommands = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub = subcommands.add_parser(
        "run", help="Run RL post-training (no arguments: the built-in CPU example) (not implemented yet)"
    )
    sub.set_defaults(pending="the orchestrator issue")
    sub = subcommands.add_parser("config", help="Show the resolved run config (not implemented yet)")
    sub.set_defaults(pending="the orchestrator issue")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    print(f"miles-orchestrator {args.command}: not implemented yet; it lands with {args.pending}.", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
