"""Pure logic tier (the planner is torch-free; one small model directory is written): the start-up memory check of
`miles-orchestrator run` plans the run on its device, keeps the plan, refuses a config that does not fit unless
forced, and an OOM anywhere in an error's chain (Ray wraps a rank's) becomes RUN_DIR/oom_report.json."""

from __future__ import annotations

import json

import pytest
import torch

from miles_kernels.testing import save_random_model, tiny_config
from miles_memory import RUN_KEYS, OOMReport, out_of_memory, read_run
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
    assert plan is not None and plan.fits and plan.hardware == "cpu"
    assert lines[0].startswith("memory plan: ") and "fits" in lines[0]
    assert json.loads((tmp_path / "memory_plan.json").read_text())["peak_bytes"] == plan.peak_bytes


def test_sglang_engines_on_the_cpu_profile_are_not_planned_and_say_so(model_dir: str, tmp_path) -> None:
    sglang = [f"model.path={model_dir}", "rollout.backend=sglang", "kernel.mode=fast",
              "rollout.sglang.launch_command=[python, stand_in.py]"]  # fmt: skip
    lines: list[str] = []
    assert check_plan(load_config(None, sglang), model_dir, tmp_path, lines.append, force=False) is None
    assert lines == [lines[0]] and "not made" in lines[0] and "memory.plan.hardware" in lines[0]
    assert not (tmp_path / "memory_plan.json").exists()
    on_gpus = check_plan(load_config(None, [*sglang, "memory.plan.hardware=h100"]), model_dir, tmp_path,
                         lines.append, force=False)  # fmt: skip
    assert on_gpus is not None and on_gpus.layout["rollout_engine"] == "sglang"


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


def test_the_planner_reads_run_config_keys_with_their_defaults() -> None:
    """`miles_memory.RUN_KEYS` (the planner's one reading of a run config, a run's own or a YAML file) names real
    fields, and a key absent from a YAML file means what RunConfig's default means."""
    defaults = load_config(None, []).model_dump(mode="json")
    for name, (dotted, default) in RUN_KEYS.items():
        node = defaults
        for key in dotted.split("."):
            assert isinstance(node, dict) and key in node, f"{name}: {dotted} is not a run config field"
            node = node[key]
        assert node == default, f"{name}: {dotted} defaults to {node!r} in a run, {default!r} in the planner"


def test_a_run_is_planned_with_its_own_layout() -> None:
    cfg = load_config(None, ["trainer.backend.name=megatron", "trainer.backend.device=cuda", "kernel.mode=fast",
                             "trainer.backend.megatron.tp=2", "trainer.num_ranks=2", "memory.plan.hardware=h100",
                             "trainer.rank_resources={CPU: 1, GPU: 1}"])  # fmt: skip
    run = read_run(cfg.model_dump(mode="json"))
    assert (run.plan.trainer_backend, run.plan.tp, run.plan.distributed_optimizer) == ("megatron", 2, False)
    with pytest.raises(ValueError, match=r"unknown key 'memory\.plan\.tp' \(now trainer\.backend\.megatron\.tp\)"):
        load_config(None, ["memory.plan.tp=2"])
