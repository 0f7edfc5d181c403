"""The saved rollouts of a run (`run.save_rollouts`): each trained batch as the trainer took it, for
`miles-orchestrator inspect`, `mismatch` and `replay` (docs/debugging.md).

    RUN_DIR/rollouts/step_N.parquet   one row per sample: every `Sample` field, the advantages it trained with and
                                      the trainer's log-probs where the trainer recomputed them (fast mode, tokens
                                      of another weight version); written before the optimizer step
    RUN_DIR/rollouts/step_N.json      after the step: its training metrics and the trainer's per-tensor weight
                                      digests (sha256 of each weight in its own dtype)

Parquet (pyarrow), so the files open in pandas, polars or DuckDB: token ids as int32 lists, log-probs and advantages
as float64 lists (the exact Python floats the run held), routed experts as the raw int32 bytes, the prompt, label,
metadata and the teacher's top-k as JSON text. Both files are written whole and renamed into place; beyond
`run.save_rollouts_max_bytes` the oldest steps are deleted. Nothing here unpickles: a dump is data only.
"""

from __future__ import annotations

import base64
import json
import os
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from miles_contracts import Sample
from miles_orchestrator.run_dir import write_durably

ROLLOUTS = "rollouts"
FORMAT = "1"
_JSON_FIELDS = ("prompt", "label", "teacher_top_logprobs", "metadata")
_TYPES: dict[str, pa.DataType] = {
    "index": pa.int64(), "group_index": pa.int64(), "prompt": pa.string(), "label": pa.string(),
    "prompt_tokens": pa.list_(pa.int32()), "response_tokens": pa.list_(pa.int32()), "response": pa.string(),
    "rollout_logprobs": pa.list_(pa.float64()), "teacher_logprobs": pa.list_(pa.float64()),
    "teacher_top_logprobs": pa.string(), "loss_mask": pa.list_(pa.int8()), "reward": pa.float64(),
    "status": pa.string(), "finish_reason": pa.string(), "error": pa.string(), "weight_version": pa.int64(),
    "weight_versions": pa.list_(pa.int64()), "routed_experts": pa.binary(), "metadata": pa.string(),
    "advantages": pa.list_(pa.float64()), "trainer_logprobs": pa.list_(pa.float64()),
}  # fmt: skip
SCHEMA = pa.schema([pa.field(name, kind) for name, kind in _TYPES.items()])
assert set(Sample.model_fields) | {"advantages", "trainer_logprobs"} == set(_TYPES), "a Sample field has no column"


@dataclass(frozen=True)
class SavedStep:
    """One step's saved batch; `outcome` (training metrics, weight digests) once the step trained, else None."""

    step: int
    trained_version: int | None
    samples: list[Sample]
    advantages: list[list[float]]
    trainer_logprobs: list[list[float]] | None
    outcome: dict[str, Any] | None

    @property
    def logprob_pairs(self) -> list[tuple[list[float], list[float]]] | None:
        """(rollout, trainer) log-probs of each sample's response tokens, where the trainer recomputed them."""
        if self.trainer_logprobs is None:
            return None
        return [(s.rollout_logprobs or [], t) for s, t in zip(self.samples, self.trainer_logprobs, strict=True)]


def step_file(run_dir: Path, step: int, suffix: str = ".parquet") -> Path:
    return Path(run_dir) / ROLLOUTS / f"step_{step:06d}{suffix}"


def saved_steps(run_dir: Path) -> list[int]:
    """The steps whose batch is saved, in order."""
    root = Path(run_dir) / ROLLOUTS
    files = root.glob("step_*.parquet") if root.is_dir() else []
    return sorted(int(m.group(1)) for m in (re.fullmatch(r"step_(\d+)\.parquet", p.name) for p in files) if m)


class RolloutDump:
    """Writes the steps `run.save_rollouts` asks for, within its size bound."""

    def __init__(self, run_dir: Path, every: int, max_bytes: int, log: Callable[[str], None] = print) -> None:
        self.root = Path(run_dir) / ROLLOUTS
        self.root.mkdir(parents=True, exist_ok=True)
        self.every, self.max_bytes, self.log = every, max_bytes, log

    def wants(self, step: int) -> bool:
        return step % self.every == 0

    def write_batch(
        self, step: int, samples: list[Sample], advantages: list[list[float]],
        trainer_logprobs: list[list[float]] | None, trained_version: int | None,
    ) -> Path:  # fmt: skip
        """step_N.parquet, before the step trains (a step that fails in training still leaves its batch)."""
        rows = [_row(s, a, None if trainer_logprobs is None else trainer_logprobs[i])
                for i, (s, a) in enumerate(zip(samples, advantages, strict=True))]  # fmt: skip
        meta = {"miles.format": FORMAT, "miles.step": str(step), "miles.trained_version": json.dumps(trained_version)}
        table = pa.Table.from_pylist(rows, schema=SCHEMA.with_metadata(meta))
        path = step_file(self.root.parent, step)
        staging = path.with_name(f".{path.name}.tmp{os.getpid()}")
        pq.write_table(table, staging, compression="zstd")
        os.replace(staging, path)
        step_file(self.root.parent, step, ".json").unlink(missing_ok=True)  # a rerun step's old outcome
        self._bound(keep=step)
        return path

    def write_outcome(self, step: int, metrics: dict[str, float], digests: dict[str, str]) -> None:
        """step_N.json, once the step trained: its training metrics and the trainer's weight digests after it."""
        outcome = {"step": step, "metrics": metrics, "digests": digests}
        write_durably(step_file(self.root.parent, step, ".json"), json.dumps(outcome, indent=1).encode())

    def _bound(self, keep: int) -> None:
        """Delete the oldest saved steps (not `keep`) while the directory holds more than `max_bytes`."""
        if not self.max_bytes:
            return
        sizes = {s: sum(p.stat().st_size for p in self._files(s)) for s in saved_steps(self.root.parent)}
        total = sum(sizes.values())
        for step in sorted(sizes):
            if total <= self.max_bytes or step == keep:
                break
            for path in self._files(step):
                path.unlink(missing_ok=True)
            total -= sizes[step]
            self.log(f"deleted the saved rollouts of step {step}: {self.root} holds more than "
                     f"run.save_rollouts_max_bytes={self.max_bytes}")  # fmt: skip

    def _files(self, step: int) -> list[Path]:
        return [p for p in (step_file(self.root.parent, step), step_file(self.root.parent, step, ".json"))
                if p.is_file()]  # fmt: skip


def _row(sample: Sample, advantages: list[float], trainer_logprobs: list[float] | None) -> dict[str, Any]:
    row: dict[str, Any] = sample.model_dump(mode="python")
    for name in _JSON_FIELDS:
        row[name] = None if row[name] is None else json.dumps(row[name])
    row["status"] = str(sample.status)
    if sample.routed_experts is not None:
        row["routed_experts"] = base64.b64decode(sample.routed_experts)
    return row | {"advantages": advantages, "trainer_logprobs": trainer_logprobs}


def load_step(run_dir: Path, step: int) -> SavedStep:
    """Step N's saved batch (ValueError naming the saved steps when it is not there)."""
    path = step_file(run_dir, step)
    if not path.is_file():
        saved = saved_steps(run_dir)
        shown = f"steps {saved[0]}..{saved[-1]} ({len(saved)} saved)" if saved else "no step"
        raise ValueError(
            f"{path} does not exist: {run_dir} holds the rollouts of {shown}; a run saves them with "
            "run.save_rollouts=true (every run.save_rollouts_every steps)"
        )
    table = pq.read_table(path)
    meta = {k.decode(): v.decode() for k, v in (table.schema.metadata or {}).items()}
    if meta.get("miles.format") != FORMAT:
        raise ValueError(f"{path}: not a Miles rollout file of format {FORMAT} (its metadata: {meta})")
    samples, advantages, trainer_logprobs = [], [], []
    for row in table.to_pylist():
        advantages.append(row.pop("advantages"))
        trainer_logprobs.append(row.pop("trainer_logprobs"))
        for name in _JSON_FIELDS:
            row[name] = None if row[name] is None else json.loads(row[name])
        if row["routed_experts"] is not None:
            row["routed_experts"] = base64.b64encode(row["routed_experts"]).decode()
        samples.append(Sample(**{k: v for k, v in row.items() if v is not None or k == "label"}))
    outcome_file = step_file(run_dir, step, ".json")
    outcome = json.loads(outcome_file.read_text()) if outcome_file.is_file() else None
    has_trainer = all(t is not None for t in trainer_logprobs)
    return SavedStep(step, json.loads(meta["miles.trained_version"]), samples, advantages,
                     trainer_logprobs if has_trainer and trainer_logprobs else None, outcome)  # fmt: skip
