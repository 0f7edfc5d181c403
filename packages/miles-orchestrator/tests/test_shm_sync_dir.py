"""Pure-logic tier (torch imported with the transports, never run; one plain Python subprocess): the shm
transport's directory in /dev/shm is the driver's own (cluster/transport/file.py).

It is made 0700 whatever the umask, under a name with the driver's pid and 16 random hex digits, and refused when
anything (a directory, a symlink) is there already; the kernel lock it holds tells a live run's directory from a
killed driver's, which the next start-up removes, leaving a live run's, another user's, a symlink and foreign names
alone. The tests use a temporary root in place of /dev/shm.
"""

from __future__ import annotations

import os
import signal
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from miles_orchestrator.cluster.transport import file
from miles_orchestrator.cluster.transport.file import SYNC_DIR_NAME, SharedMemoryDir, remove_stale_sync_dirs


def test_the_directory_is_private_and_unpredictable(tmp_path: Path) -> None:
    previous = os.umask(0o000)  # a permissive umask must not open it up
    try:
        first, second = SharedMemoryDir(tmp_path), SharedMemoryDir(tmp_path)
    finally:
        os.umask(previous)
    for made in (first, second):
        info = made.path.lstat()
        assert stat.S_ISDIR(info.st_mode) and stat.S_IMODE(info.st_mode) == 0o700 and info.st_uid == os.geteuid()
        assert SYNC_DIR_NAME.fullmatch(made.path.name) and f"-{os.getpid()}-" in made.path.name
    assert first.path != second.path
    first.remove()
    first.remove()  # idempotent
    assert not first.path.exists() and second.path.is_dir()
    second.remove()


@pytest.mark.parametrize("planted", ["directory", "symlink"])
def test_a_directory_or_symlink_planted_at_the_name_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, planted: str
) -> None:
    monkeypatch.setattr(file.secrets, "token_hex", lambda n: "0" * 2 * n)  # a name guessed right
    path = tmp_path / f"miles-sync-{os.getpid()}-{'0' * 16}"
    elsewhere = tmp_path / "attacker"
    elsewhere.mkdir(mode=0o777)
    if planted == "directory":
        path.mkdir(mode=0o777)
    else:
        path.symlink_to(elsewhere)
    with pytest.raises(RuntimeError, match=r"exists already, and this run did not make it"):
        SharedMemoryDir(tmp_path)
    assert list(elsewhere.iterdir()) == []  # nothing was written through it
    assert path.is_symlink() == (planted == "symlink")  # nor was it touched


def test_a_killed_drivers_directory_is_removed_at_the_next_start(tmp_path: Path) -> None:
    live = SharedMemoryDir(tmp_path)  # a run still going: kept
    (live.path / "model.safetensors").write_bytes(b"weights")
    dead = tmp_path / f"miles-sync-999999-{'a' * 16}"
    holder = subprocess.Popen(  # a driver holding its directory's lock as SharedMemoryDir does, then killed
        [sys.executable, "-c", (
            "import fcntl, os, sys, time\n"
            f"os.mkdir({str(dead)!r}, 0o700)\n"
            f"fd = os.open({str(dead)!r}, os.O_RDONLY | os.O_DIRECTORY)\n"
            "fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)\n"
            f"open(os.path.join({str(dead)!r}, 'model.safetensors'), 'wb').write(b'w' * 4096)\n"
            "print('ready', flush=True)\n"
            "time.sleep(60)\n"
        )],
        stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert holder.stdout is not None and holder.stdout.readline() == "ready\n"
        assert remove_stale_sync_dirs(tmp_path) == []  # its driver lives: kept
        holder.send_signal(signal.SIGKILL)
        holder.wait(timeout=10)
    finally:
        holder.kill()
    other = tmp_path / "miles-sync-1-bbbbbbbbbbbbbbbb"  # another user's (only root can make one here)
    if os.geteuid() == 0:
        other.mkdir()
        os.chown(other, 12345, 12345)
    link = tmp_path / f"miles-sync-2-{'c' * 16}"
    link.symlink_to(live.path)
    foreign = tmp_path / "miles-sync-notours"
    foreign.mkdir()
    assert remove_stale_sync_dirs(tmp_path) == [dead]
    assert not dead.exists()
    assert (live.path / "model.safetensors").read_bytes() == b"weights"
    assert link.is_symlink() and foreign.is_dir()
    assert other.is_dir() == (os.geteuid() == 0)
    live.remove()
