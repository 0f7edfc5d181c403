"""`miles-trainer` command line.

Miles trainer: SFT and checkpoint conversion.
Subcommands that a later issue implements say so and exit with status 2; none pretends to work.
"""

from __future__ import annotations

import argparse
import sys


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="miles-trainer", description="Miles trainer: SFT and checkpoint conversion.")
    subcommands = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub = subcommands.add_parser(
        "sft", help="Supervised fine-tuning of a Hugging Face model on a JSONL file (not implemented yet)"
    )
    sub.set_defaults(pending="the trainer issue")
    sub = subcommands.add_parser(
        "convert", help="Convert between a DCP checkpoint and a Hugging Face directory (not implemented yet)"
    )
    sub.set_defaults(pending="the trainer issue")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    print(f"miles-trainer {args.command}: not implemented yet; it lands with {args.pending}.", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
