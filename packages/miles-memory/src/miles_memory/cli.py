"""`miles-memory` command line.

Miles memory: plan and inspect memory for colocated runs.
Subcommands that a later issue implements say so and exit with status 2; none pretends to work.
"""

from __future__ import annotations

import argparse
import sys


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="miles-memory", description="Miles memory: plan and inspect memory for colocated runs."
    )
    subcommands = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub = subcommands.add_parser(
        "plan", help="Print a memory plan for a model and hardware configuration (not implemented yet)"
    )
    sub.set_defaults(pending="the memory-management issue")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    print(f"miles-memory {args.command}: not implemented yet; it lands with {args.pending}.", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
