"""CLI tier (no torch numerics): the `miles-spec` console script is installed, documents itself, and a
subcommand that a later issue implements says so and fails instead of pretending to work."""

import shutil
import subprocess

import miles_spec
from miles_spec.cli import build_parser


def test_help_lists_subcommands() -> None:
    assert miles_spec.__doc__
    script = shutil.which("miles-spec")
    assert script, "console script miles-spec is not on PATH"
    result = subprocess.run([script, "--help"], capture_output=True, text=True, check=True)
    for name in build_parser()._subparsers._group_actions[0].choices:  # type: ignore[union-attr]
        assert name in result.stdout


def test_pending_subcommands_fail_plainly() -> None:
    for name in build_parser()._subparsers._group_actions[0].choices:  # type: ignore[union-attr]
        result = subprocess.run(["miles-spec", name], capture_output=True, text=True)
        assert result.returncode == 2
        assert "not implemented yet" in result.stderr
