"""The run directory: everything a run writes, and what `--resume` reads back.

    RUN_DIR/config.yaml          the resolved config (resume reads it)
    RUN_DIR/policy.json          the model directory the run started from (replay, inspect, mismatch read it)
    RUN_DIR/metrics.jsonl        one JSON line per step (step 0: the evaluation before training)
    RUN_DIR/checkpoints/step_N/  trainer checkpoint (+ data position, step) — atomic, see miles_trainer; saved as
                                 pending_step_N/ and renamed once the step's metrics line is written
    RUN_DIR/final/               the trained policy as a Hugging Face directory
    RUN_DIR/summary.png          reward and evaluation curves; RUN_DIR/run.log  the log
    RUN_DIR/tensorboard/         TensorBoard events (run.log.tensorboard); RUN_DIR/wandb/  W&B's files (run.log.wandb)
    RUN_DIR/mlflow.db, mlartifacts/  the default MLflow store (run.log.mlflow); RUN_DIR/trackers.json  their run ids
    RUN_DIR/timeline.jsonl, timeline.png  every step's phases (timeline.py)
    RUN_DIR/rollouts/            each trained batch and its outcome (run.save_rollouts, rollout_dump.py)
    RUN_DIR/profiles/step_N/     torch.profiler traces (run.profile_steps, profiles.py)
    RUN_DIR/replay/, mismatch/   what miles-orchestrator replay and mismatch write (docs/debugging.md)

Durability: a metrics line is flushed and fsynced as it is appended, and a rewrite of metrics.jsonl is a temp file,
fsynced, renamed over it; a committed checkpoint has every file and directory fsynced before and after its rename.
A power cut therefore loses at most the line being written, and `--resume` skips such a torn last line (warning).
A committed checkpoint also holds `manifest.sha256.json` (each file's sha256, computed in the same pass as the
fsync); `--resume` verifies it and refuses a checkpoint whose files differ (its DCP metadata is a pickle).

It also owns the console: rich progress bars for the phases of a step and one summary line per step. Messages are
shown literally (a prompt quoting `[/INST]` is text, not rich markup).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import stat
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.text import Text

from miles_orchestrator.timeline import Timeline

if TYPE_CHECKING:
    from miles_orchestrator.config import RunConfig
    from miles_orchestrator.trackers import Tracker

CHECKPOINTS = "checkpoints"
POLICY = "policy.json"
MANIFEST = "manifest.sha256.json"  # in each committed checkpoint: {relative path: sha256 hex} of its other files


class MetricsLog:
    """metrics.jsonl (always), then the trackers `run.log` enables (trackers.py: TensorBoard, W&B, MLflow), which
    `start_trackers` opens and `finish_trackers` closes."""

    def __init__(self, path: Path, warn: Callable[[str], None] = print) -> None:
        self.path = path
        self.warn = warn
        self.trackers: list[Tracker] = []
        self._tracked_through = -1  # the last step the trackers hold from before this process (--resume)

    def start_trackers(self, cfg: RunConfig, *, is_resumed: bool) -> None:
        """Open the trackers and log the resolved config to them; a missing package is a ValueError naming it."""
        from miles_orchestrator.trackers import open_trackers

        self.trackers = open_trackers(cfg.run.log, self.path.parent, cfg.model_dump(mode="json"),
                                      is_resumed=is_resumed, warn=self.warn)  # fmt: skip
        if is_resumed:  # it redoes the steps after its checkpoint, which the trackers have (W&B refuses a step twice)
            self._tracked_through = max((row["step"] for row in self.history()), default=-1)

    def write(self, step: int, metrics: dict[str, Any]) -> None:
        with self.path.open("a") as f:
            f.write(json.dumps({"step": step, "time": time.time(), **metrics}) + "\n")
            f.flush()
            os.fsync(f.fileno())
        if step > self._tracked_through:
            numbers = {k: float(v) for k, v in metrics.items() if isinstance(v, (int, float))}
            for tracker in self.trackers:
                tracker.log_metrics(step, numbers)

    def finish_trackers(self, *, is_success: bool) -> None:
        """Give each tracker the run's plots (RUN_DIR/*.png: summary.png) and close it; a tracker that fails to is
        reported, and the others still close."""
        artifacts = sorted(self.path.parent.glob("*.png"))
        for tracker in self.trackers:
            try:
                tracker.finish(artifacts, is_success=is_success)
            except Exception as error:
                self.warn(f"warning: {type(tracker).__name__} did not finish: {type(error).__name__}: {error}")
        self.trackers = []

    def history(self) -> list[dict[str, Any]]:
        """Every step's metrics; a torn last line (the run died writing it) is skipped with a warning."""
        if not self.path.is_file():
            return []
        lines = [line for line in self.path.read_text(errors="replace").splitlines() if line.strip()]
        rows = []
        for number, line in enumerate(lines, start=1):
            try:
                rows.append(json.loads(line))
            except ValueError as error:
                if number < len(lines):
                    raise ValueError(
                        f"{self.path} line {number} is not JSON ({error}): only the last line can be torn by a "
                        "crash; repair or delete that line"
                    ) from error
                self.warn(f"warning: skipped the torn last line of {self.path} (the run died writing it)")
        return rows

    def truncate_after(self, step: int) -> None:
        """Drop lines of steps after `step` (written after the checkpoint a resumed run restarts from), and a
        torn last line; the file is replaced whole (temp file, fsync, rename)."""
        kept = [row for row in self.history() if row["step"] <= step]
        write_durably(self.path, "".join(json.dumps(row) + "\n" for row in kept).encode())


class RunDir:
    def __init__(self, path: str | Path, *, quiet: bool = False) -> None:
        self.path = Path(path)
        self.path.mkdir(parents=True, exist_ok=True)
        self.console = Console(quiet=quiet, log_path=False)
        self.metrics = MetricsLog(self.path / "metrics.jsonl", self.log)
        self.timeline = Timeline(self.path / "timeline.jsonl")
        self._previous: dict[str, Any] = {}
        self._warned: set[str] = set()
        self._showing = False  # a progress bar is on the console

    def log(self, message: str) -> None:
        with (self.path / "run.log").open("a") as f:
            f.write(f"{time.strftime('%Y-%m-%d %H:%M:%S')} {message}\n")
        self.console.log(Text(message))  # literally: a sample quoting "[/INST]" is not rich markup

    def record(self, step: int, metrics: dict[str, Any]) -> None:
        self.metrics.write(step, metrics)
        self.log(step_line(step, metrics))
        for key, warning in PERSISTENT_WARNINGS.items():  # once per run, when it shows on two steps in a row
            if metrics.get(key) and self._previous.get(key) and key not in self._warned:
                self._warned.add(key)
                self.log(f"warning: {warning}")
        self._previous = metrics

    @contextlib.contextmanager
    def progress(self, label: str, total: int) -> Iterator[Callable[[], None]]:
        """A transient rich progress bar; yields `advance()`. While one is shown (overlapped runs: the rollout's and
        the trainer's at once), another is not: a console shows one live display at a time."""
        if self._showing:
            yield lambda: None
            return
        columns = (TextColumn(f"[bold]{label}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
        self._showing = True
        try:
            with Progress(*columns, console=self.console, transient=True, disable=not self.console.is_terminal) as bar:
                task = bar.add_task(label, total=total)
                yield lambda: bar.advance(task)
        finally:
            self._showing = False

    def record_policy(self, model_dir: str) -> None:
        """RUN_DIR/policy.json: the model directory the run started from (replay, inspect and mismatch read it)."""
        (self.path / POLICY).write_text(json.dumps({"model_dir": str(Path(model_dir).resolve())}) + "\n")

    def policy(self) -> str | None:
        """The model directory the run started from, if it recorded one that still holds a model."""
        file = self.path / POLICY
        model_dir = json.loads(file.read_text())["model_dir"] if file.is_file() else None
        return model_dir if model_dir is not None and (Path(model_dir) / "config.json").is_file() else None

    def checkpoint_dir(self, step: int) -> Path:
        return self.path / CHECKPOINTS / f"step_{step:06d}"

    def pending_checkpoint_dir(self, step: int) -> Path:
        """Where step N's checkpoint is saved before the step's metrics are recorded. `commit_checkpoint` then
        makes it `step_N`: a run killed in between resumes from the previous checkpoint and redoes step N, so a
        resumed run never lacks a step's metrics line (nor repeats one)."""
        return self.path / CHECKPOINTS / f"pending_step_{step:06d}"

    def commit_checkpoint(self, step: int) -> None:
        """Make step N's pending checkpoint (if it saved one) the resumable `step_N`: its files fsynced and listed
        with their sha256 in its manifest, then renamed, the rename fsynced."""
        pending, final = self.pending_checkpoint_dir(step), self.checkpoint_dir(step)
        if not pending.is_dir():
            return
        write_durably(pending / MANIFEST, json.dumps(hash_and_sync(pending), indent=1).encode())
        if final.exists():  # left by an earlier, interrupted attempt of this step
            shutil.rmtree(final)
        pending.rename(final)
        fsync_directory(final.parent)

    def verify_checkpoint(self, checkpoint: Path) -> None:
        """Refuse (ValueError naming the file) a checkpoint whose files differ from its manifest: changed, missing,
        or not listed. A checkpoint without a manifest (saved before manifests) is accepted as it is."""
        manifest_file = checkpoint / MANIFEST
        if not manifest_file.is_file():
            return
        refuse = f"--resume refused: {checkpoint} does not match its {MANIFEST}"
        try:
            manifest = json.loads(manifest_file.read_text())
        except ValueError as error:
            raise ValueError(f"{refuse}: the manifest is not JSON ({error})") from error
        if not isinstance(manifest, dict):
            raise ValueError(f"{refuse}: the manifest is not a JSON object {{file: sha256}}")
        actual = hash_and_sync(checkpoint, sync=False)
        for name in sorted(set(manifest) | set(actual)):
            if name not in actual:
                raise ValueError(f"{refuse}: {checkpoint / name} is missing (or not a regular file)")
            if name not in manifest:
                raise ValueError(f"{refuse}: {checkpoint / name} is not listed in it")
            if actual[name] != manifest[name]:
                raise ValueError(f"{refuse}: {checkpoint / name} has sha256 {actual[name]}, the manifest "
                                 f"{manifest[name]}; restore it, or resume from an earlier checkpoint")  # fmt: skip

    def latest_checkpoint(self) -> Path | None:
        """The newest complete checkpoint (an interrupted save, `*.tmp`, is ignored)."""
        complete = self.checkpoints()
        return complete[max(complete)] if complete else None

    def checkpoints(self) -> dict[int, Path]:
        """{step: directory} of the complete checkpoints (an interrupted save, `*.tmp`, is left out)."""
        root = self.path / CHECKPOINTS
        complete = {}
        for candidate in sorted(root.glob("step_*")) if root.is_dir() else []:
            name = candidate.name.removesuffix(".old")
            if name.endswith(".tmp") or not (candidate / "trainer_state.json").is_file():
                continue
            complete[int(name.split("_")[1])] = candidate
        return complete


def write_durably(path: Path, data: bytes) -> None:
    """Replace `path` with `data` so that a crash leaves the old file or the new one, never a torn one: a temp file
    beside it, fsynced, renamed over it, the directory fsynced."""
    staging = path.with_name(f".{path.name}.tmp{os.getpid()}")
    with staging.open("wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(staging, path)
    fsync_directory(path.parent)


def fsync_directory(directory: Path) -> None:
    """fsync a directory: the renames and new names in it reach the disk."""
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def hash_and_sync(root: Path, sync: bool = True) -> dict[str, str]:
    """{path relative to `root`: sha256} of every regular file under `root` but the manifest (symlinks are not
    followed, nor listed); with `sync`, each file and directory is fsynced in the same pass."""
    digests = {}
    for directory, _, names in os.walk(root):
        for name in names:
            path = Path(directory) / name
            relative = path.relative_to(root).as_posix()
            if relative == MANIFEST or not stat.S_ISREG(path.lstat().st_mode):
                continue
            with path.open("rb") as f:
                digests[relative] = hashlib.file_digest(f, "sha256").hexdigest()
                if sync:
                    os.fsync(f.fileno())
        if sync:
            fsync_directory(Path(directory))
    return digests


STEP_LINE_KEYS = (
    ("reward_mean", "reward {:.3f}"), ("pass_rate", "pass {:.1%}"), ("eval_pass@1", "eval pass@1 {:.1%}"),
    ("train_rollout_logprob_abs_diff", "mismatch {:.3g}"), ("kl", "kl {:.4f}"), ("tokens_per_s", "{:.0f} tok/s"),
    ("num_filtered_groups_trained", "{:.0f} filtered group(s) trained"), ("staleness_mean", "staleness {:.2f}"),
    ("num_stale_groups_dropped", "{:.0f} stale group(s) dropped"), ("step_time_s", "{:.1f} s"),
)  # fmt: skip
SHOWN_WHEN_NONZERO = {"num_filtered_groups_trained", "staleness_mean", "num_stale_groups_dropped"}
PERSISTENT_WARNINGS = {
    "num_filtered_groups_trained": "fewer prompt groups than rollout.num_prompts_per_step pass the filters, so "
    "some groups the filters dropped are trained on (num_filtered_groups_trained in the metrics); raise "
    "filter.max_oversample_rounds to over-sample more",
}


def step_line(step: int, metrics: dict[str, Any]) -> str:
    parts = [fmt.format(metrics[key]) for key, fmt in STEP_LINE_KEYS
             if key in metrics and (metrics[key] or key not in SHOWN_WHEN_NONZERO)]  # fmt: skip
    return f"step {step}: " + ", ".join(parts)
