"""Pure-logic tier (torch is imported with loop.py, never run): the run directory survives what a crash, a power
cut or a hostile sample does to it.

- `RunDir.log` shows a message literally: a sample quoting `[/INST]` (rich's closing-tag syntax) or `[bold]` is
  text, not markup;
- metrics.jsonl appends are flushed and fsynced; a rewrite is a temp file, fsynced, renamed; a torn last line (a run
  killed while writing it) is skipped with a warning, a bad line before the last is an error naming it;
- a committed checkpoint has its files and directories fsynced and a sha256 manifest; `--resume` (loop.resume)
  refuses a checkpoint whose files do not match it, naming the file, before the trainer loads anything.
"""

from __future__ import annotations

import asyncio
import io
import json
import os
from pathlib import Path
from typing import Any

import pytest
from rich.console import Console

from miles_orchestrator.loop import resume
from miles_orchestrator.run_dir import MANIFEST, RunDir


@pytest.fixture
def synced(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The path of every file or directory fsynced from now on."""
    paths: list[str] = []
    real = os.fsync

    def fsync(fd: int) -> None:
        paths.append(os.readlink(f"/proc/self/fd/{fd}"))
        real(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    return paths


def test_log_messages_are_shown_literally(tmp_path: Path) -> None:
    run = RunDir(tmp_path / "run")
    shown = io.StringIO()
    run.console = Console(file=shown, width=200, log_path=False, log_time=False, color_system=None)
    run.log("sample 3: <s>[INST] add 2 and 2 [/INST] 4</s>")
    run.log("a [bold]plain[/bold] answer and [red]")
    assert "[INST] add 2 and 2 [/INST] 4" in shown.getvalue()
    assert "a [bold]plain[/bold] answer and [red]" in shown.getvalue()
    assert "[/INST]" in (run.path / "run.log").read_text()


def test_metrics_lines_are_fsynced_as_they_are_appended(tmp_path: Path, synced: list[str]) -> None:
    run = RunDir(tmp_path / "run", quiet=True)
    run.metrics.write(1, {"reward_mean": 0.5})
    assert synced == [str(run.path / "metrics.jsonl")]


def test_a_torn_last_metrics_line_is_skipped_on_resume(tmp_path: Path, synced: list[str]) -> None:
    run = RunDir(tmp_path / "run", quiet=True)
    for step in range(4):
        run.metrics.write(step, {"reward_mean": step / 10})
    with (run.path / "metrics.jsonl").open("a") as f:
        f.write('{"step": 4, "time": 17.5, "reward_me')  # killed mid-line
    asyncio.run(resume(FakeCluster(), run, source=None))  # no checkpoint: starts at step 0, keeps step 0's line
    assert [row["step"] for row in run.metrics.history()] == [0]
    assert "skipped the torn last line" in (run.path / "run.log").read_text()
    assert (run.path / "metrics.jsonl").read_text().endswith("\n")
    assert str(run.path) in synced  # the rewrite's rename reached the disk
    assert not [p for p in run.path.iterdir() if "tmp" in p.name]


def test_a_bad_metrics_line_before_the_last_is_an_error(tmp_path: Path) -> None:
    run = RunDir(tmp_path / "run", quiet=True)
    run.metrics.write(0, {})
    with (run.path / "metrics.jsonl").open("a") as f:
        f.write("not json\n")
    run.metrics.write(2, {})
    with pytest.raises(ValueError, match=r"metrics\.jsonl line 2 is not JSON"):
        run.metrics.history()


def pending_checkpoint(run: RunDir, step: int) -> Path:
    pending = run.pending_checkpoint_dir(step)
    (pending / "shard").mkdir(parents=True)
    (pending / "trainer_state.json").write_text(json.dumps({"step": step}))
    (pending / ".metadata").write_bytes(b"pickled metadata")
    (pending / "shard" / "__0_0.distcp").write_bytes(bytes(range(256)) * 64)
    return pending


def test_a_committed_checkpoint_is_fsynced_and_has_a_manifest(tmp_path: Path, synced: list[str]) -> None:
    run = RunDir(tmp_path / "run", quiet=True)
    pending = pending_checkpoint(run, 3)
    run.commit_checkpoint(3)
    final = run.checkpoint_dir(3)
    manifest = json.loads((final / MANIFEST).read_text())
    assert sorted(manifest) == [".metadata", "shard/__0_0.distcp", "trainer_state.json"]
    assert all(len(digest) == 64 for digest in manifest.values())
    for name in manifest:
        assert str(pending / name) in synced
    assert {str(pending), str(pending / "shard"), str(final.parent)} <= set(synced)  # the dirs, and the rename
    run.verify_checkpoint(final)


@pytest.mark.parametrize("tamper", ["change", "remove", "add"])
def test_resume_refuses_a_checkpoint_that_does_not_match_its_manifest(tmp_path: Path, tamper: str) -> None:
    run = RunDir(tmp_path / "run", quiet=True)
    pending_checkpoint(run, 3)
    run.commit_checkpoint(3)
    final = run.checkpoint_dir(3)
    target = final / "shard" / "__0_0.distcp"
    if tamper == "change":
        target.write_bytes(target.read_bytes()[:-1] + b"!")
    elif tamper == "remove":
        target.unlink()
    else:
        target = final / "shard" / "extra.pt"
        target.write_bytes(b"another pickle")
    expected = {"change": "has sha256", "remove": "is missing", "add": "is not listed"}[tamper]
    cluster = FakeCluster()
    with pytest.raises(ValueError, match=rf"--resume refused: .*{MANIFEST}: {target} {expected}"):
        asyncio.run(resume(cluster, run, source=None))
    assert cluster.loaded == []  # refused before the trainer unpickled anything


def test_a_checkpoint_without_a_manifest_still_resumes(tmp_path: Path) -> None:
    run = RunDir(tmp_path / "run", quiet=True)
    run.checkpoint_dir(2).mkdir(parents=True)  # saved before manifests existed
    (run.checkpoint_dir(2) / "trainer_state.json").write_text("{}")
    cluster, source = FakeCluster(), FakeSource()
    assert asyncio.run(resume(cluster, run, source)) == 2
    assert cluster.loaded == [run.checkpoint_dir(2)] and source.state == {"position": 7}


class FakeCluster:
    def __init__(self) -> None:
        self.loaded: list[Path] = []

    async def load(self, directory: Path) -> dict[str, Any]:
        self.loaded.append(directory)
        return {"step": 2, "data": {"position": 7}}


class FakeSource:
    def __init__(self) -> None:
        self.state: dict[str, Any] = {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.state = state
