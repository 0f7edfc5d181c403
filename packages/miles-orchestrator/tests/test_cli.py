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


def test_help_lists_commands_and_every_config_field(leaf_fields) -> None:
    assert miles_orchestrator.__doc__
    assert shutil.which("miles-orchestrator"), "console script miles-orchestrator is not on PATH"
    result = run_cli("run", "--help")
    assert result.returncode == 0
    for dotted in leaf_fields(RunConfig):  # the nested component models' fields too
        assert f"  {dotted} (" in result.stdout, f"{dotted} missing from run --help"


def test_config_show_applies_file_then_overrides(tmp_path) -> None:
    config = tmp_path / "job.yaml"
    config.write_text("trainer:\n  optimizer:\n    lr: 0.001\nrun:\n  num_steps: 7\n")
    result = run_cli("config", "show", "--config", str(config), "trainer.optimizer.lr=2e-6")
    assert result.returncode == 0, result.stderr
    shown = yaml.safe_load(result.stdout)
    assert shown["trainer"]["optimizer"]["lr"] == 2e-6 and shown["run"]["num_steps"] == 7


def test_bad_values_fail_at_start_up_naming_the_field(tmp_path) -> None:
    cases = {
        ("trainer.optimizer.lr=-1",): "trainer.optimizer.lr",
        ("trainer.nope=1",): "trainer.nope",
        ("rollout.num_prompts_per_step=3",): "global_batch_size",
        ("reward.name=no_such_module:fn",): "reward.name='no_such_module:fn': plug-in",
        ("model.path=/no/such/model",): "model.path=/no/such/model: no config.json",
    }
    for overrides, expected in cases.items():
        result = run_cli("run", f"run.run_dir={tmp_path / 'never'}", *overrides)
        assert result.returncode == 2, (overrides, result.stderr)
        assert expected in result.stderr, (overrides, result.stderr)
        assert len(result.stderr.strip().splitlines()) == 1 and "Traceback" not in result.stderr, result.stderr
    assert not (tmp_path / "never").exists() or not any((tmp_path / "never").glob("checkpoints/*"))
    result = run_cli("run", "--resume", str(tmp_path / "missing"))
    assert result.returncode == 2 and "no config.yaml" in result.stderr


def test_an_error_during_the_run_keeps_its_traceback_and_names_the_log(tmp_path) -> None:
    """Not a config error: the model directory passes the start-up check (it has a config.json) but cannot be
    loaded, which only the run finds out. It exits with 1, prints the traceback and where the log is."""
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    run_dir = tmp_path / "run"
    result = run_cli("run", "run.cluster=local", f"model.path={model}", f"run.run_dir={run_dir}")
    assert result.returncode == 1, result.stderr
    assert "Traceback (most recent call last)" in result.stderr
    assert "the run failed" in result.stderr and str(run_dir / "run.log") in result.stderr
    assert "Traceback (most recent call last)" in (run_dir / "run.log").read_text()


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
    assert step_line(4, {"reward_mean": 0.25, "num_filtered_groups_trained": 0.0}) == "step 4: reward 0.250"
    assert step_line(5, {"num_filtered_groups_trained": 2.0}) == "step 5: 2 filtered group(s) trained"


def test_a_filter_shortfall_is_counted_every_step_and_warned_about_once(tmp_path) -> None:
    run = RunDir(tmp_path / "run", quiet=True)
    for step, count in enumerate([1, 0, 1, 2, 3, 1], start=1):
        run.record(step, {"num_filtered_groups_trained": float(count)})
    log = (run.path / "run.log").read_text()
    assert log.count("warning: fewer prompt groups") == 1  # on two steps in a row (3, 4), once
    assert "raise filter.max_oversample_rounds" in log
    assert log.index("warning:") > log.index("step 4:") and "only" not in log


def test_summary_best_follows_each_metrics_direction() -> None:
    from miles_orchestrator.report import summary_table

    history = [{"step": 1, "tokens_per_s": 100.0, "step_time_s": 2.0, "reward_mean": 0.1, "entropy": 0.5},
               {"step": 2, "tokens_per_s": 300.0, "step_time_s": 1.0, "reward_mean": 0.3, "entropy": 0.4},
               {"step": 3, "tokens_per_s": 200.0, "step_time_s": 3.0, "reward_mean": 0.2, "entropy": 0.3}]  # fmt: skip
    table = summary_table(history)
    best = dict(zip(table.columns[0]._cells, table.columns[3]._cells, strict=True))
    assert best == {"reward_mean": "0.3", "entropy": "-", "tokens_per_s": "300", "step_time_s": "1"}


def test_config_reference_doc_is_generated_from_the_config() -> None:
    from pathlib import Path

    from miles_orchestrator.cli import config_reference

    doc = Path(__file__).resolve().parents[3] / "docs" / "config-reference.md"
    assert doc.read_text() == config_reference(), "regenerate: uv run miles-orchestrator config reference > " + str(
        doc
    )


def test_advantage_plugin_path_is_checked_at_start_up(tmp_path) -> None:
    result = run_cli("run", f"run.run_dir={tmp_path / 'never'}", "trainer.advantage_estimator=no_such_mod:adv")
    assert result.returncode == 2
    assert "trainer.advantage_estimator='no_such_mod:adv'" in result.stderr, result.stderr


def test_a_failed_bootstrap_leaves_no_staging_directory(tmp_path, monkeypatch) -> None:
    import pytest

    from miles_orchestrator.data import bootstrap

    monkeypatch.setenv("MILES_CACHE_DIR", str(tmp_path / "cache"))

    def fail(cfg, staging, log) -> None:
        (staging / "base").mkdir()
        raise RuntimeError("killed mid-SFT")

    monkeypatch.setattr(bootstrap, "_build", fail)
    with pytest.raises(RuntimeError, match="killed mid-SFT"):
        bootstrap.bootstrap_policy(RunConfig(), log=lambda message: None)
    assert list((tmp_path / "cache" / "bootstrap").iterdir()) == []
