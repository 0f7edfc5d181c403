"""Pure logic tier (the planner is torch-free; one small model directory is written): the start-up memory check of
`miles-orchestrator run` plans the run on its device, keeps the plan, refuses a config that does not fit unless
forced, and an OOM anywhere in an error's chain (Ray wraps a rank's) becomes RUN_DIR/oom_report.json."""

from __future__ import annotations

import json

import pytest
import torch

from miles_kernels.testing import save_random_model, tiny_config
from miles_memory import OOMReport, out_of_memory
from miles_orchestrator.config import load_config
from miles_orchestrator.memory_check import PlanRefused, check_plan, oom_report, run_hardware, write_oom_report


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("policy")
    save_random_model(path, tiny_config("dense"), seed=0)
    return str(path)


def test_a_config_that_fits_is_planned_and_kept(model_dir: str, tmp_path) -> None:
    cfg = load_config(None, [f"model.path={model_dir}"])
    assert run_hardware(cfg) == "cpu"
    lines: list[str] = []
    plan = check_plan(cfg, model_dir, tmp_path, lines.append, force=False)
    assert plan.fits and plan.hardware == "cpu"
    assert lines[0].startswith("memory plan: ") and "fits" in lines[0]
    assert json.loads((tmp_path / "memory_plan.json").read_text())["peak_bytes"] == plan.peak_bytes


def test_a_config_that_does_not_fit_is_refused_unless_forced(model_dir: str, tmp_path) -> None:
    cfg = load_config(None, [f"model.path={model_dir}", "memory.limit_bytes=1000000"])
    with pytest.raises(PlanRefused, match=r"does not fit.*--force to run anyway"):
        check_plan(cfg, model_dir, tmp_path, lambda line: None, force=False)
    lines: list[str] = []
    plan = check_plan(cfg, model_dir, tmp_path, lines.append, force=True)
    assert not plan.fits and lines[-1].startswith("--force")


def test_an_oom_in_an_error_chain_becomes_a_report_file(tmp_path) -> None:
    report = OOMReport("the forward's saved activations", 2000, 1000, 0, {"weights": 900})
    try:
        try:
            raise out_of_memory(report)
        except torch.OutOfMemoryError as oom:
            raise RuntimeError("rank 1 failed") from oom  # what a cluster's wrapper looks like
    except RuntimeError as wrapped:
        found = oom_report(wrapped)
    assert found == report.to_dict()
    assert oom_report(ValueError("not memory")) is None
    advice = write_oom_report(tmp_path, found)
    saved = json.loads((tmp_path / "oom_report.json").read_text())
    assert saved["report"]["held_bytes"] == {"weights": 900} and saved["planned"] is None
    assert "--resume" in advice and "max_tokens_per_micro_batch" in advice
