"""CPU tier (one in-process gloo rank, a tiny model): a trainer checkpoint reaches the disk before it is renamed.

`miles_trainer.save_checkpoint` writes `<dir>.tmp` and renames it `<dir>`; a power cut after a rename whose files
were still in the page cache would leave a complete-looking checkpoint of empty or torn files. Every file and
directory of it must be fsynced before the rename, and the parent directory (the rename itself) after it. The
orchestrator's commit (`pending_step_N` -> `step_N`) is tested in test_run_dir_durability.py.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from miles_kernels import KernelConfig, save_model
from miles_kernels.testing import random_model, tiny_config
from miles_trainer import BackendConfig, FSDP2Backend, ensure_process_group, load_checkpoint, save_checkpoint


def test_a_saved_checkpoint_is_fsynced_before_and_after_its_rename(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    save_model(random_model(tiny_config("dense"), seed=5), tmp_path / "model")
    ensure_process_group()
    backend = FSDP2Backend(str(tmp_path / "model"), KernelConfig(), config=BackendConfig())
    synced: list[str] = []
    real = os.fsync

    def fsync(fd: int) -> None:
        synced.append(os.readlink(f"/proc/self/fd/{fd}"))
        real(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    final = save_checkpoint(backend, tmp_path / "ckpt")
    staging = tmp_path / "ckpt.tmp"
    written = sorted(p.relative_to(final) for p in final.rglob("*") if p.is_file())
    assert {"trainer_state.json", "config.json", "rng_rank0.safetensors", ".metadata"} <= {str(p) for p in written}
    for name in written:
        assert str(staging / name) in synced, f"{name} was renamed into place unsynced"
    assert str(staging) in synced
    assert synced.index(str(tmp_path)) > max(synced.index(str(staging / name)) for name in written)  # the rename
    load_checkpoint(backend, final)  # still a checkpoint
