"""Plug-ins that SIGKILL a rollout engine in a chosen phase of a run (imported by the run's processes in
test_fault_tolerance.py): the kill lands inside the phase, not wherever a timer in the test happens to fall.

`MILES_TEST_ENGINE_FAULTS` (JSON) names, per phase, the call that kills and the engine it kills:
`{"rollout": [call, engine], "reward": [weight_version, engine], "train": [call, engine], "sync": [call, engine],
"eval": [call, engine]}`. The calls counted: a training prompt group's rollout (`rollout`) or an evaluation
group's (`eval`, greedy) in the driver; a policy-loss call in trainer rank 0 (`train`); the weight file written or
the buckets posted by trainer rank 0 (`sync`, the process that sends the weights: the engine dies between the
trainer's write and its load, or as the buckets go out). `reward` kills at the first sample scored whose weights
are `weight_version`. Each phase kills once (`MILES_TEST_FAULTS_DIR/<phase>` records the engine's pid), reading the
engine's pid from the run directory's `actors.json`.
"""

from __future__ import annotations

import json
import os
import signal
from collections import Counter
from pathlib import Path
from typing import Any

from miles_contracts import Sample, SamplingParams
from miles_orchestrator.cluster.transport import file, http
from miles_orchestrator.data.task import verify
from miles_orchestrator.rollout.single_turn import single_turn
from miles_trainer.losses import policy_loss

_PLAN: dict[str, list[int]] = json.loads(os.environ.get("MILES_TEST_ENGINE_FAULTS", "{}"))
_CALLS: Counter[str] = Counter()


def _kill_once(phase: str) -> None:
    """SIGKILL the phase's engine, the first time the phase fires in the whole run (any process)."""
    engine = _PLAN[phase][1]
    run_dir, faults = Path(os.environ["MILES_TEST_RUN_DIR"]), Path(os.environ["MILES_TEST_FAULTS_DIR"])
    try:
        marker = os.open(faults / phase, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
    except FileExistsError:
        return
    pid = json.loads((run_dir / "actors.json").read_text())["engines"][engine]["pid"]
    os.kill(pid, signal.SIGKILL)  # (the engine being restarted, if another phase killed it: a test plan's mistake)
    os.write(marker, json.dumps({"engine": engine, "pid": pid}).encode())
    os.close(marker)


def _count(phase: str) -> None:
    if phase in _PLAN:
        _CALLS[phase] += 1
        with open(Path(os.environ["MILES_TEST_FAULTS_DIR"]) / "calls.log", "a") as log:
            log.write(f"{phase} {_CALLS[phase]} {os.getpid()}\n")
        if _CALLS[phase] == _PLAN[phase][0]:
            _kill_once(phase)


async def rollout(client: Any, group: list[Sample], params: SamplingParams) -> list[Sample]:
    """The one-turn rollout, killing an engine at the planned training (or evaluation: greedy) group."""
    _count("eval" if params.temperature == 0 else "rollout")
    return await single_turn(client, group, params)


def reward(sample: Sample) -> float:
    """The task's reward, killing an engine at the first sample of the planned weight version."""
    if "reward" in _PLAN and sample.weight_version == _PLAN["reward"][0]:
        _kill_once("reward")
    return verify(sample.response, sample.label)


def loss(*args: Any, **kwargs: Any) -> Any:
    """PPO-clip (the default loss), killing an engine at the planned call."""
    _count("train")
    return policy_loss(*args, **kwargs)


def _killing_first(send: Any) -> Any:
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        _count("sync")
        return send(*args, **kwargs)

    return wrapped


def _killing_after(write: Any) -> Any:
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        written = write(*args, **kwargs)
        if kwargs.get("is_writer", True):
            _count("sync")
        return written

    return wrapped


# In the trainer ranks (which import the loss): the weight file is written, then the engine dies before it loads it
# (shm, disk); the buckets start going out to an engine that dies (http).
file.write_weight_file = _killing_after(file.write_weight_file)
http.HttpRankSide.send_weight_buckets = _killing_first(http.HttpRankSide.send_weight_buckets)
