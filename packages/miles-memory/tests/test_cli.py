"""CLI tier (pure logic, no torch): the `miles-memory` console script is installed and documents itself; `plan`
exits 0 when a config fits, 1 when it does not (naming the lever), 2 for bad input with a one-line message."""

import json
import shutil
import subprocess
from pathlib import Path

import yaml

import miles_memory
from miles_memory.cli import build_parser, main

ROOT = Path(__file__).resolve().parents[3]
EXAMPLE = ROOT / "examples" / "qwen3_30b_a3b_8xh100.yaml"


def test_help_lists_subcommands() -> None:
    assert miles_memory.__doc__
    script = shutil.which("miles-memory")
    assert script, "console script miles-memory is not on PATH"
    result = subprocess.run([script, "--help"], capture_output=True, text=True, check=True)
    for name in build_parser()._subparsers._group_actions[0].choices:  # type: ignore[union-attr]
        assert name in result.stdout


def test_plan_fits_exit_0_and_json(capsys) -> None:  # type: ignore[no-untyped-def]
    assert main(["plan", "--config", str(EXAMPLE)]) == 0
    assert "fits" in capsys.readouterr().out
    assert main(["plan", "--config", str(EXAMPLE), "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["fits"] and plan["hardware"] == "h100" and plan["peak_bytes"] <= plan["capacity_bytes"]


def test_plan_does_not_fit_exit_1_with_lever(tmp_path: Path, capsys) -> None:  # type: ignore[no-untyped-def]
    config = yaml.safe_load(EXAMPLE.read_text())
    config["memory"]["plan"]["cpu_adam"] = False
    config["trainer"]["backend"]["activation_checkpointing"] = False
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(config))
    assert main(["plan", "--config", str(path)]) == 1
    out = capsys.readouterr().out
    assert "does NOT fit" in out and "lever:" in out


def test_plan_bad_input_exit_2_one_line(tmp_path: Path) -> None:
    cases = [
        (["--config", str(EXAMPLE), "--hardware", "tpu"], "unknown hardware 'tpu'; known: h100"),
        (["--config", str(tmp_path / "missing.yaml")], "does not exist"),
        (["--config", str(EXAMPLE), "--nodes", "0"], "--nodes must be >= 1"),
    ]
    for args, message in cases:
        result = subprocess.run(["miles-memory", "plan", *args], capture_output=True, text=True)
        assert result.returncode == 2, result.stderr
        assert message in result.stderr and len(result.stderr.strip().splitlines()) == 1, result.stderr
