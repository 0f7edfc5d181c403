"""`miles-rollout` command line.

Miles rollout engine: serve a policy over SGLang's HTTP API.
Subcommands that a later issue implements say so and exit with status 2; none pretends to work.
"""

from __future__ import annotations

import argparse
import sys


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="miles-rollout", description="Miles rollout engine: serve a policy over SGLang's HTTP API."
    )
    subcommands = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub = subcommands.add_parser(
        "serve", help="Serve a Hugging Face model directory over SGLang's /generate API (not implemented yet)"
    )
    sub.set_defaults(pending="the rollout engine issue")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    print(f"miles-rollout {args.command}: not implemented yet; it lands with {args.pending}.", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
