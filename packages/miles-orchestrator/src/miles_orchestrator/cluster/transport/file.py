"""The file transports (`run.sync_transport=shm`, `disk`): trainer rank 0 overwrites one safetensors file, then the
driver tells every engine to load it (`/update_weights_from_disk`): in /dev/shm when every engine shares rank 0's
node (`SharedMemoryDir`), else in a directory every node reads (`run.sync_dir`, default RUN_DIR/sync). Every rank
gathers the weights for it (a collective); the backend writes the file in place after the first sync
(`miles_trainer.WeightSender.write_weights`). A restarted engine loads the same file (`WeightFile`): a lone engine
comes back without a peer to copy from. The distributed transport writes one too, for restarted SGLang engines.

/dev/shm is shared by every user of the node, so the shm transport's directory is private to the driver: made by
it with mode 0700 under a name no one can guess (`miles-sync-<driver pid>-<random>`), never one that exists already
(a directory or a symlink someone made there), and locked (`flock`) for as long as the driver lives. The lock is what
tells a live run's directory from a dead one's: the kernel drops it when the driver dies, however it dies, so every
start-up removes the unlocked ones this user left behind (`remove_stale_sync_dirs`). The engines and trainer rank 0,
which read and write the weight file there, run as the driver's user (a local Ray, or `ray start` by that user).
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import os
import re
import secrets
import shutil
import stat
from abc import ABC, abstractmethod
from pathlib import Path
from typing import Any, ClassVar

from miles_orchestrator.cluster.transport.protocol import RankSide, SyncContext, TrainerRanks
from miles_rollout import Client
from miles_trainer import WeightSender

SHARED_MEMORY = Path("/dev/shm")
SYNC_DIR_NAME = re.compile(r"miles-sync-\d+-[0-9a-f]{16}")  # SharedMemoryDir's names, pid then random


class SharedMemoryDir:
    """The shm transport's directory: this driver's own, in `root` (/dev/shm), locked while it lives (see the module
    docstring). `remove()` deletes it; a driver killed before that leaves it to the next start-up's
    `remove_stale_sync_dirs`."""

    def __init__(self, root: Path = SHARED_MEMORY) -> None:
        self.path = root / f"miles-sync-{os.getpid()}-{secrets.token_hex(8)}"
        try:
            os.mkdir(self.path, 0o700)  # never follows a symlink, never accepts what is there
        except FileExistsError:
            raise RuntimeError(
                f"{self.path} exists already, and this run did not make it (a name chosen at random): someone else "
                "may be reading or writing the weights there; remove it, or use run.sync_transport=disk"
            ) from None
        self._fd = os.open(self.path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
        try:
            # Locked at once. Another run's start-up that found it unlocked in between holds the lock or has removed
            # it (no name left): either way, not ours to use.
            try:
                fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                raise RuntimeError(f"{self.path} was taken while this run made it; start again") from None
            made = os.fstat(self._fd)
            if made.st_nlink == 0 or made.st_uid != os.geteuid():
                raise RuntimeError(f"{self.path} was removed or replaced while this run made it; start again")
            os.fchmod(self._fd, 0o700)  # whatever the umask
        except BaseException:
            os.close(self._fd)
            raise

    def remove(self) -> None:
        """Delete the directory and drop the lock (idempotent)."""
        if self._fd < 0:
            return
        shutil.rmtree(self.path, ignore_errors=True)
        os.close(self._fd)
        self._fd = -1


def remove_stale_sync_dirs(root: Path = SHARED_MEMORY) -> list[Path]:
    """Remove the `SharedMemoryDir`s in `root` of this user's dead drivers (no lock held on them); the removed.
    Another user's, a symlink, a live run's, anything not named like one: left alone."""
    removed = []
    for path in root.iterdir() if root.is_dir() else []:
        if not SYNC_DIR_NAME.fullmatch(path.name):
            continue
        with contextlib.suppress(OSError):  # gone meanwhile, or not ours to open
            seen = path.lstat()
            if not stat.S_ISDIR(seen.st_mode) or seen.st_uid != os.geteuid():
                continue
            fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
            try:
                opened = os.fstat(fd)
                if (opened.st_dev, opened.st_ino) != (seen.st_dev, seen.st_ino):
                    continue  # replaced between the two looks
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # BlockingIOError (an OSError): its driver lives
                shutil.rmtree(path)
                removed.append(path)
            finally:
                os.close(fd)
    return removed


def sync_directory(run_dir: Path, sync_dir: str | None) -> Path:
    """The directory every node reads that the weight file goes to (disk; distributed's restart file): `sync_dir`
    (`run.sync_dir`) or RUN_DIR/sync, made if missing."""
    directory = Path(sync_dir) if sync_dir else run_dir / "sync"
    directory.mkdir(parents=True, exist_ok=True)
    return directory


def write_weight_file(weights: WeightSender, model_dir: str, directory: Path, is_writer: bool) -> int:
    """Every rank gathers the weights (a collective); the writer (rank 0) writes them, and the model's config
    once, as a checkpoint directory the engine loads. Returns the tensor bytes."""
    num_bytes = weights.write_weights(directory / "model.safetensors", write=is_writer)
    if is_writer and not (directory / "config.json").is_file():
        shutil.copy(Path(model_dir) / "config.json", directory / "config.json")
    return num_bytes


class WeightFile:
    """A weight file the trainer ranks write and engines load (`directory`): the version it holds, which moves ahead
    of the engines' while a sync's engines load it, and the lock that keeps a restarted engine from loading it half
    written."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.version: int | None = None
        self._writing = asyncio.Lock()

    async def write(self, ranks: TrainerRanks, version: int) -> int:
        """Every rank gathers the weights, rank 0 writes them as `version`; the tensor bytes."""
        async with self._writing:
            num_bytes: int = (await ranks.all("write_weights", str(self.directory)))[0]
            self.version = version
        return num_bytes

    async def load_into(self, client: Client) -> None:
        """The engine of `client` loads the file, once no write is under way."""
        async with self._writing:
            await client.update_weights_from_disk(str(self.directory), self.version)


class FileRankSide:
    """A trainer rank's part: it gathers the weights; rank 0 writes the file."""

    CALLS: ClassVar[tuple[str, ...]] = ("write_weights",)

    def __init__(self, weights: WeightSender, model_dir: str, rank: int) -> None:
        self.weights, self.model_dir, self.rank = weights, model_dir, rank

    def write_weights(self, directory: str) -> int:
        """`write_weight_file` on this rank (rank 0 writes)."""
        return write_weight_file(self.weights, self.model_dir, Path(directory), is_writer=self.rank == 0)


class FileTransport(ABC):
    """The driver's half of both file transports: the ranks write the file, every engine loads it; a restarted engine
    loads it too. Where the file lives is the subclass's (`_open`)."""

    name: ClassVar[str]
    rank_side: ClassVar[type[RankSide]] = FileRankSide

    def __init__(self, context: SyncContext) -> None:
        self.context = context
        self.file: WeightFile | None = None

    @property
    def _file(self) -> WeightFile:
        assert self.file is not None, "prepare() first"
        return self.file

    async def prepare(self) -> None:
        self.file = WeightFile(self._open())

    @abstractmethod
    def _open(self) -> Path:
        """The directory the weight file goes to, made for this run."""

    async def send(self, version: int, bucket_bytes: int) -> dict[str, Any]:
        file = self._file
        num_bytes = await file.write(self.context.ranks, version)
        reply = await self.context.engines.update_weights_from_disk(str(file.directory), version)
        return {**reply, "num_buckets": 1, "num_bytes": num_bytes}

    async def after_restart(self, engine: int, client: Client) -> bool:
        await self._file.load_into(client)
        return True


class SharedMemoryTransport(FileTransport):
    """shm: the file in a `SharedMemoryDir` (every engine on rank 0's node), removed at close."""

    name = "shm"

    def __init__(self, context: SyncContext) -> None:
        super().__init__(context)
        self.shared_memory: SharedMemoryDir | None = None

    def _open(self) -> Path:
        self.shared_memory = SharedMemoryDir()
        return self.shared_memory.path

    @property
    def description(self) -> str:
        return self.context.describe(f"shared memory ({self._file.directory})")

    async def close(self) -> None:
        if self.shared_memory is not None:
            self.shared_memory.remove()


class DiskTransport(FileTransport):
    """disk: the file in a directory every node reads (`sync_directory`)."""

    name = "disk"

    def _open(self) -> Path:
        return sync_directory(self.context.run_dir, self.context.cfg.run.sync_dir)

    @property
    def description(self) -> str:
        return self.context.describe(f"a file in {self._file.directory}")

    async def close(self) -> None:
        """Nothing to release: the file stays in the run's directory."""
