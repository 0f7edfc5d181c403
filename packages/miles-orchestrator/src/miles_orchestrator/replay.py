"""`miles-orchestrator replay RUN_DIR --step N`: train a saved step again and say whether the update is the run's.

The trainer starts from the newest checkpoint before step N (or from the policy itself when there is none), then
trains each saved batch from there to step N (run.save_rollouts: every step after that checkpoint must be saved)
through the loop's own `prepare_batch` and `train`. Each replayed step is compared with what the run recorded:
the trainer's per-tensor weight digests after it (every weight in its own dtype: equal digests are a bitwise
equal update), its training metrics, and what went into it (the advantages; π_old where the trainer recomputed
it). The verdict names what differs. The replay runs in RUN_DIR/replay/step_N/ (its own log and scratch space)
and writes its report there as replay.json; the run's own files are only read.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from miles_orchestrator.cluster import Cluster, start_cluster
from miles_orchestrator.config import RunConfig
from miles_orchestrator.rollout_dump import SavedStep, load_step, saved_steps, step_file
from miles_orchestrator.run_dir import RunDir
from miles_orchestrator.steps import PreparedBatch, prepare_batch, train

VARYING_SUFFIXES = ("_s", "_mfu")  # wall-clock measurements (train_time_s, tokens_per_s, train_mfu, ...)
VARYING_PREFIXES = ("mem_",)  # memory measurements depend on what the process did before, not only on the step


@dataclass
class StepVerdict:
    """What a replayed step changed compared with the run: weights (by name), metrics (name: [run, replay]) and
    the step's inputs (advantages, π_old: the first differing sample)."""

    step: int
    differing_tensors: list[str] = field(default_factory=list)
    differing_metrics: dict[str, list[float | None]] = field(default_factory=dict)
    differing_inputs: dict[str, str] = field(default_factory=dict)

    @property
    def is_identical(self) -> bool:
        return not (self.differing_tensors or self.differing_metrics or self.differing_inputs)

    def describe(self) -> str:
        if self.is_identical:
            return f"step {self.step}: bitwise the same update (every weight digest and training metric equal)"
        parts = [f"{name}: {why}" for name, why in self.differing_inputs.items()]
        if self.differing_tensors:
            shown = ", ".join(self.differing_tensors[:6]) + (" ..." if len(self.differing_tensors) > 6 else "")
            parts.append(f"{len(self.differing_tensors)} weight(s) differ: {shown}")
        parts += [f"{key} {run!r} (run) vs {now!r} (replay)" for key, (run, now) in self.differing_metrics.items()]
        return f"step {self.step}: DIFFERS -- " + "; ".join(parts)


def replay_plan(run: RunDir, through: int, before: int) -> tuple[int, Path | None]:
    """Where the trainer's state after step `through` is rebuilt from: the newest checkpoint of a step before
    `before` (its step and directory; 0 and None: the policy itself), once every step after it up to `through` is
    saved with its outcome (ValueError naming the missing ones)."""
    earlier = {s: path for s, path in run.checkpoints().items() if s < before}
    start = max(earlier, default=0)
    saved = set(saved_steps(run.path))
    missing = [s for s in range(start + 1, through + 1)
               if s not in saved or not step_file(run.path, s, ".json").is_file()]  # fmt: skip
    if missing:
        where = f"checkpoint step {start}" if start else "the start of the run (no checkpoint before it)"
        raise ValueError(
            f"the trainer's state after step {through} is rebuilt from {where} and needs the saved batch and "
            f"outcome of steps {start + 1}..{through}; {run.path} lacks steps {missing} (a run saves them with "
            "run.save_rollouts=true and run.save_rollouts_every=1; run.checkpoint_every sets how far back a "
            "replay starts)"
        )
    return start, earlier.get(start)


async def replay(cfg: RunConfig, model_dir: str, run: RunDir, step: int, scratch: RunDir) -> list[StepVerdict]:
    """Replay `step` (and the saved steps between its checkpoint and it), in `scratch`; one verdict per step,
    written to scratch/replay.json."""
    cluster = await start_cluster(cfg, model_dir, scratch.path, scratch.log)
    try:
        start, verdicts = await train_to(cfg, cluster, run, step, scratch, checkpoint_before=step)
    finally:
        await cluster.shutdown()
    report = {"run_dir": str(run.path), "step": step, "start_checkpoint": start,
              "steps": [asdict(v) | {"is_identical": v.is_identical} for v in verdicts]}  # fmt: skip
    (scratch.path / "replay.json").write_text(json.dumps(report, indent=1) + "\n")
    return verdicts


async def train_to(
    cfg: RunConfig, cluster: Cluster, run: RunDir, step: int, scratch: RunDir, checkpoint_before: int
) -> tuple[int, list[StepVerdict]]:
    """Bring a fresh cluster's trainer to its state after `step`: the newest checkpoint before step
    `checkpoint_before`, then the saved steps up to `step` (each compared with the run); (the checkpoint's step,
    the verdicts). The engine's memory is released (colocated) first: nothing generates during a replay."""
    start, checkpoint = replay_plan(run, step, checkpoint_before)
    if cfg.run.colocate:
        await cluster.engine.release_memory_occupation()
    if checkpoint is not None:
        run.verify_checkpoint(checkpoint)  # before any of it is unpickled
        await cluster.load(checkpoint)
        scratch.log(f"replay: loaded {checkpoint}")
    verdicts = []
    for s in range(start + 1, step + 1):
        verdict = await replay_step(cfg, cluster, load_step(run.path, s), scratch)
        scratch.log(verdict.describe())
        verdicts.append(verdict)
    return start, verdicts


async def replay_step(cfg: RunConfig, cluster: Cluster, saved: SavedStep, scratch: RunDir) -> StepVerdict:
    """One saved batch through `prepare_batch` and `train`, compared with the run's record of it."""
    assert saved.outcome is not None
    prepared = await prepare_batch(cfg, cluster, saved.samples, saved.trained_version)
    metrics = prepared.metrics | await train(cfg, cluster, prepared, scratch)
    digests = await cluster.trainer_digests()
    verdict = StepVerdict(saved.step, differing_inputs=_differing_inputs(saved, prepared))
    recorded: dict[str, str] = saved.outcome["digests"]
    verdict.differing_tensors = sorted(n for n in set(recorded) | set(digests) if recorded.get(n) != digests.get(n))
    verdict.differing_metrics = {
        key: [value, metrics.get(key)] for key, value in saved.outcome["metrics"].items()
        if is_deterministic_metric(key) and metrics.get(key) != value
    }  # fmt: skip
    return verdict


def is_deterministic_metric(key: str) -> bool:
    """Whether a training metric is a function of the step alone (not a time or a memory reading)."""
    return not key.endswith(VARYING_SUFFIXES) and not key.startswith(VARYING_PREFIXES)


def _differing_inputs(saved: SavedStep, prepared: PreparedBatch) -> dict[str, str]:
    """The step's inputs the replay recomputed differently: {what: the first sample it differs at}."""
    out: dict[str, str] = {}
    checks: list[tuple[str, Any, Any]] = [("advantages", saved.advantages, prepared.advantages),
                                          ("old_logprobs", saved.trainer_logprobs, prepared.old_logprobs)]  # fmt: skip
    for name, was, now in checks:
        if (was is None) != (now is None):
            out[name] = f"{'the run' if was is not None else 'the replay'} recomputed them, the other did not"
        elif was is not None and was != now:
            first = next(i for i, (a, b) in enumerate(zip(was, now, strict=True)) if a != b)
            out[name] = f"first differ at sample {first} (index {saved.samples[first].index})"
    return out
