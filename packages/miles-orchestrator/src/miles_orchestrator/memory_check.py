"""The run's memory at start-up and at an OOM (docs/memory.md): the memory planner's verdict on the device the run
uses, printed and written to RUN_DIR/memory_plan.json, a refusal when the config will not fit (unless `--force`),
and, when a step runs out of memory for good, RUN_DIR/oom_report.json: what held memory by tag, what the planner
predicted and the lever to pull.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from miles_memory import MemoryPlan, plan_memory
from miles_orchestrator.config import RunConfig

PLAN_FILE = "memory_plan.json"
OOM_FILE = "oom_report.json"
GPU_PROFILES = ("gb300", "b200", "h200", "h100")  # matched against torch.cuda.get_device_name(), longest first


class PlanRefused(Exception):
    """The planner says the config does not fit its device; the message names the lever and `--force`."""


def run_hardware(cfg: RunConfig) -> str:
    """The hardware profile of the device the run uses: `memory.plan.hardware` if set, else this CPU, or the GPU
    torch reports."""
    if cfg.memory.plan.hardware is not None:
        return cfg.memory.plan.hardware
    if cfg.trainer.backend.device == "cpu" and cfg.rollout.engine.device == "cpu":
        return "cpu"
    import torch

    name = torch.cuda.get_device_name(0).lower() if torch.cuda.is_available() else ""
    found = next((key for key in GPU_PROFILES if key in name.replace(" ", "")), None)
    if found is None:
        raise ValueError(f"no memory profile matches the GPU {name!r}: set memory.plan.hardware to one of "
                         f"{list(GPU_PROFILES)}")  # fmt: skip
    return found


def check_plan(
    cfg: RunConfig, model_dir: str, run_dir: Path, log: Callable[[str], None], force: bool
) -> MemoryPlan | None:
    """Plan the run on its device, log the verdict, keep the plan; PlanRefused when it does not fit and not
    `force`. None, said in the log, for SGLang engines on the cpu profile, which the planner does not plan (a CPU
    machine runs them only through a stand-in `rollout.sglang.launch_command`; `memory.plan.hardware` plans the
    GPUs the config is for)."""
    hardware = run_hardware(cfg)
    if hardware == "cpu" and cfg.rollout.backend == "sglang":
        log("memory plan: not made: the planner plans SGLang engines for GPU profiles only (set memory.plan.hardware "
            "to plan the GPUs this config is for)")  # fmt: skip
        return None
    data = cfg.model_dump(mode="json")
    data["model"]["path"] = model_dir
    plan = plan_memory(data, hardware=hardware)
    (run_dir / PLAN_FILE).write_text(plan.model_dump_json(indent=2))
    log(f"memory plan: {plan.summary()}")
    if not plan.fits:
        if not force:
            raise PlanRefused(
                f"the memory planner says this config does not fit: {plan.summary()}. "
                f"Change it ({plan.lever or 'see ' + str(run_dir / PLAN_FILE)}), or pass --force to run anyway"
            )
        log("--force: running a config the planner says does not fit")
    return plan


def oom_report(error: BaseException) -> dict[str, Any] | None:
    """The report of a `torch.OutOfMemoryError` anywhere in `error`'s chain (Ray wraps a rank's error), else None."""
    seen: set[int] = set()
    current: BaseException | None = error
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        report = getattr(current, "report", None)
        if report is not None and hasattr(report, "to_dict"):
            return dict(report.to_dict())
        if type(current).__name__ == "OutOfMemoryError" or "out of memory" in str(current).lower():
            return {"what": str(current).splitlines()[0][:500]}
        current = getattr(current, "cause", None) or current.__cause__
    return None


def write_oom_report(run_dir: Path, report: dict[str, Any]) -> str:
    """RUN_DIR/oom_report.json with the planner's prediction beside what was measured; returns the advice line."""
    plan_file = run_dir / PLAN_FILE
    predicted = json.loads(plan_file.read_text()) if plan_file.is_file() else None
    lever = (
        "lower trainer.backend.max_tokens_per_micro_batch or turn on trainer.backend.activation_checkpointing "
        "(activations), raise memory.limit_bytes, or add trainer.num_ranks (weights and optimizer shard over them)"
    )
    out = {"report": report, "lever": lever, "planned": None if predicted is None else {
        k: predicted.get(k) for k in ("phases", "peak_bytes", "capacity_bytes", "fits", "lever")
    }}  # fmt: skip
    (run_dir / OOM_FILE).write_text(json.dumps(out, indent=2))
    return f"out of memory (report: {run_dir / OOM_FILE}); {lever}. The last checkpoint is intact: fix, then --resume"
