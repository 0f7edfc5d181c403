"""`miles-spec` command line.

Miles spec: train the MTP draft head for speculative decoding.
Subcommands that a later issue implements say so and exit with status 2; none pretends to work.
"""

from __future__ import annotations

import argparse
import sys


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="miles-spec", description="Miles spec: train the MTP draft head for speculative decoding."
    )
    subcommands = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub = subcommands.add_parser("train", help="Train an MTP draft head on rollout data (not implemented yet)")
    sub.set_defaults(pending="the speculative-training issue")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    print(f"miles-spec {args.command}: not implemented yet; it lands with {args.pending}.", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
