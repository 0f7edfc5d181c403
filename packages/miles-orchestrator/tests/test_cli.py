"""CLI tier (real `miles-orchestrator` processes; no Ray): help lists every config field, `config show` resolves
files and overrides, bad values fail at start-up naming the field; and the run directory's bookkeeping
(latest complete checkpoint, metrics truncation on resume, the step line)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess

import yaml

import miles_orchestrator
from miles_orchestrator.config import RunConfig
from miles_orchestrator.run_dir import RunDir, step_line


def run_cli(*args: str, cache: str = "/nonexistent/miles-cache") -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "MILES_CACHE_DIR": cache}  # never touch the user's cache
    return subprocess.run(["miles-orchestrator", *args], capture_output=True, text=True, timeout=120, env=env)


def test_help_lists_commands_and_every_config_field() -> None:
    assert miles_orchestrator.__doc__
    assert shutil.which("miles-orchestrator"), "console script miles-orchestrator is not on PATH"
    result = run_cli("run", "--help")
    assert result.returncode == 0
    for section, model in RunConfig.model_fields.items():
        assert model.annotation is not None
        for field in model.annotation.model_fields:  # type: ignore[union-attr]
            assert f"{section}.{field}" in result.stdout, f"{section}.{field} missing from run --help"


def test_config_show_applies_file_then_overrides(tmp_path) -> None:
    config = tmp_path / "job.yaml"
    config.write_text("trainer:\n  lr: 0.001\nrun:\n  num_steps: 7\n")
    result = run_cli("config", "show", "--config", str(config), "trainer.lr=2e-6")
    assert result.returncode == 0, result.stderr
    shown = yaml.safe_load(result.stdout)
    assert shown["trainer"]["lr"] == 2e-6 and shown["run"]["num_steps"] == 7


def test_bad_values_fail_at_start_up_naming_the_field(tmp_path) -> None:
    cases = {
        ("trainer.lr=-1",): "trainer.lr",
        ("trainer.nope=1",): "trainer.nope",
        ("rollout.num_prompts_per_step=3",): "global_batch_size",
        ("reward.name=no_such_module:fn",): "reward.name='no_such_module:fn': plug-in",
        ("model.path=/no/such/model",): "model.path=/no/such/model: no config.json",
    }
    for overrides, expected in cases.items():
        result = run_cli("run", f"run.run_dir={tmp_path / 'never'}", *overrides)
        assert result.returncode == 2, (overrides, result.stderr)
        assert expected in result.stderr, (overrides, result.stderr)
    assert not (tmp_path / "never").exists() or not any((tmp_path / "never").glob("checkpoints/*"))
    result = run_cli("run", "--resume", str(tmp_path / "missing"))
    assert result.returncode == 2 and "no config.yaml" in result.stderr


def test_run_dir_finds_the_latest_complete_checkpoint_and_truncates_metrics(tmp_path) -> None:
    run = RunDir(tmp_path / "run", quiet=True)
    for step in (2, 4):
        run.checkpoint_dir(step).mkdir(parents=True)
        (run.checkpoint_dir(step) / "trainer_state.json").write_text("{}")
    (run.path / "checkpoints" / "step_000006.tmp").mkdir()  # an interrupted save
    run.checkpoint_dir(8).mkdir()  # no trainer_state.json: incomplete
    run.pending_checkpoint_dir(10).mkdir()  # saved, but the run died before the step's metrics were written
    (run.pending_checkpoint_dir(10) / "trainer_state.json").write_text("{}")
    assert run.latest_checkpoint() == run.checkpoint_dir(4)
    run.commit_checkpoint(10)
    assert run.latest_checkpoint() == run.checkpoint_dir(10) and not run.pending_checkpoint_dir(10).exists()
    run.commit_checkpoint(12)  # no checkpoint saved at that step: nothing to do
    shutil.rmtree(run.checkpoint_dir(10))
    for step in range(7):
        run.metrics.write(step, {"reward_mean": step / 10})
    run.metrics.truncate_after(4)
    assert [row["step"] for row in run.metrics.history()] == [0, 1, 2, 3, 4]
    lines = (run.path / "metrics.jsonl").read_text().splitlines()
    assert json.loads(lines[-1])["reward_mean"] == 0.4
    assert step_line(3, {"reward_mean": 0.25, "train_rollout_logprob_abs_diff": 0.0}) == (
        "step 3: reward 0.250, mismatch 0"
    )


def test_config_reference_doc_is_generated_from_the_config() -> None:
    from pathlib import Path

    from miles_orchestrator.cli import config_reference

    doc = Path(__file__).resolve().parents[3] / "docs" / "config-reference.md"
    assert doc.read_text() == config_reference(), "regenerate: uv run miles-orchestrator config reference > " + str(
        doc
    )


def test_metrics_go_to_tensorboard_when_enabled(tmp_path) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run = RunDir(tmp_path / "run", tensorboard=True, quiet=True)
    for step in (1, 2):
        run.metrics.write(step, {"reward_mean": step / 4, "note": "text is skipped"})
    events = EventAccumulator(str(tmp_path / "run" / "tensorboard"))
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars("reward_mean")] == [(1, 0.25), (2, 0.5)]


def test_advantage_plugin_path_is_checked_at_start_up(tmp_path) -> None:
    result = run_cli("run", f"run.run_dir={tmp_path / 'never'}", "trainer.advantage_estimator=no_such_mod:adv")
    assert result.returncode == 2
    assert "trainer.advantage_estimator='no_such_mod:adv'" in result.stderr, result.stderr
