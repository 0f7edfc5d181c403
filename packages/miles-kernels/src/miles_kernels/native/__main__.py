"""`python -m miles_kernels.native [build|status]`: (re)build the native kernels next to the package, or say whether
they load here and which instruction-set build runs."""

from __future__ import annotations

import argparse
import sys

from miles_kernels.native import build as _build


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m miles_kernels.native", description=__doc__)
    parser.add_argument("command", choices=["build", "status"], nargs="?", default="status")
    args = parser.parse_args(argv)
    if args.command == "build":
        try:
            print(f"built {_build.build()}")
        except RuntimeError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 1
        return 0
    from miles_kernels import native

    state = native.status()
    if state is True:
        print(f"native kernels: {native.library_path()} ({native.isa()} build; sources {_build.source_hash()})")
        return 0
    print(f"native kernels unavailable: {state}", file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main())
