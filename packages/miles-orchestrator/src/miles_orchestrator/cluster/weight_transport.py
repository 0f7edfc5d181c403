"""How a run moves the trainer's weights to the engines (step 7 of the RL data path; docs/architecture.md, "Weight
sync"): the orchestrator's part of weight sync, between the trainer's sender (`miles_trainer/weight_sender.py`) and
the engine's receiver (`miles_rollout/weight_receiver.py`). Every transport sends from trainer rank 0: all ranks
gather each tensor from their shards (a collective), rank 0 sends the full tensors to every engine.

- `resolve_transport` picks the transport of a Ray run (`run.sync_transport`); `SharedMemoryDir` is the shm
  transport's directory, `sync_directory` the disk transport's;
- `write_shared_file` (shm, disk): rank 0 overwrites one safetensors file, the driver then tells every engine to load
  it (`/update_weights_from_disk`): /dev/shm when the engines share rank 0's node, else a directory every node reads;
- `post_buckets` (http): rank 0 posts each bucket to every engine (`/update_weights_from_tensor`; the last bucket
  applies the version);
- `broadcast_buckets` (distributed): rank 0 broadcasts each bucket's tensors over a `torch.distributed` group of its
  own with every engine (`/update_weights_from_distributed`: a Miles engine's buckets bracketed by
  `/begin_weight_update` and `/end_weight_update` so no request runs on half-updated weights; an SGLang engine's
  carry the version and the cache flush on the last bucket, as slime sends them, and no request runs meanwhile: a
  sync run syncs between rollouts, an async one pauses generation around the sync); gloo on CPUs, NCCL from a
  CUDA trainer to SGLang's GPUs (`weight_group_backend`);
- `copy_in_process`: the local cluster's sync, one in-memory copy from the trainer into the engine's model.

Nothing is pickled: a file or a bucket is safetensors, a broadcast is raw tensors, the in-process copy is tensors.

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
from collections.abc import Awaitable, Iterable, Iterator
from pathlib import Path
from typing import Any, TypeVar

from miles_kernels import WeightUpdateGroup, broadcast_tensors, dtype_name
from miles_orchestrator.cluster.trainer_rank import TrainerRank
from miles_rollout import Client, Engine

T = TypeVar("T")
SHARED_MEMORY = Path("/dev/shm")
SHM_SYNC_MAX_BYTES = 1 << 30  # `auto` syncs through shared memory up to this checkpoint size (one copy in RAM)
SYNC_DIR_NAME = re.compile(r"miles-sync-\d+-[0-9a-f]{16}")  # SharedMemoryDir's names, pid then random


NETWORK = ("http", "distributed")  # the network transports a Miles engine takes
WEIGHT_GROUP = "miles_weight_sync"  # the weight-update group of trainer rank 0 and the engines (distributed)


def resolve_transport(
    transport: str, same_node: bool, weight_bytes: int, num_engines: int,
    network: tuple[str, ...] = NETWORK,
) -> str:  # fmt: skip
    """The transport a Ray run syncs with (`run.sync_transport`); `same_node`: every engine is on trainer rank 0's
    node; `network`: the network transports the engines take (SGLang's: distributed where its layout allows it,
    `SGLangConfig.network_transports`). auto: shm when every engine is on rank 0's node, /dev/shm is writable and the
    checkpoint is at most `SHM_SYNC_MAX_BYTES`; else http for one engine, distributed for several (one gather, one
    broadcast to all), whichever the engines take; else disk."""
    usable = same_node and SHARED_MEMORY.is_dir() and os.access(SHARED_MEMORY, os.W_OK)
    if transport == "shm" and not usable:
        raise ValueError(
            "run.sync_transport=shm needs every engine on trainer rank 0's node and a writable /dev/shm; use "
            "run.sync_transport=disk (a directory every node reads), distributed, http or auto"
        )
    if transport != "auto":
        return transport
    if usable and weight_bytes <= SHM_SYNC_MAX_BYTES:
        return "shm"
    if "http" in network and (num_engines == 1 or "distributed" not in network):
        return "http"
    return "distributed" if "distributed" in network else "disk"


def weight_group_backend(sglang_engines: bool, trainer_device: str) -> str:
    """The weight-update group's backend: NCCL from a CUDA trainer to SGLang engines (their weights are on GPUs;
    rank 0 moves each bucket to its GPU), else gloo (the embedded engine, a CPU trainer)."""
    return "nccl" if sglang_engines and trainer_device.startswith("cuda") else "gloo"


def sync_directory(transport: str, run_dir: Path, sync_dir: str | None) -> Path | None:
    """Where the disk transport writes the weights: `sync_dir` or RUN_DIR/sync; None for the others (shm writes to
    a `SharedMemoryDir`)."""
    if transport != "disk":
        return None
    directory = Path(sync_dir) if sync_dir else run_dir / "sync"
    directory.mkdir(parents=True, exist_ok=True)
    return directory


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


def checkpoint_bytes(model_dir: str) -> int:
    return sum(f.stat().st_size for f in Path(model_dir).glob("*.safetensors"))


def write_shared_file(trainer: TrainerRank, directory: Path, is_writer: bool) -> int:
    """Every rank gathers the weights (a collective); the writer (rank 0) writes them, and the model's config
    once, as a checkpoint directory the engine loads. Returns the tensor bytes."""
    num_bytes = trainer.backend.write_weights(directory / "model.safetensors", write=is_writer)
    if is_writer and not (directory / "config.json").is_file():
        shutil.copy(Path(trainer.model_dir) / "config.json", directory / "config.json")
    return num_bytes


def post_buckets(
    trainer: TrainerRank, clients: list[Client], loop: asyncio.AbstractEventLoop, version: int, bucket_bytes: int
) -> dict[str, Any]:
    """Every rank gathers the weights bucket by bucket (a collective); the rank holding the engines' `clients`
    (rank 0; the others pass none) posts each bucket to every engine at once; the replies to the last one carry the
    applied version. An engine that refuses a bucket raises `RolloutClientError`."""
    result: dict[str, Any] = {"num_buckets": 0, "num_bytes": 0}
    for data in trainer.backend.iter_weight_buckets(version, bucket_bytes):
        if clients:
            replies = loop.run_until_complete(_together(*(c.update_weights_from_tensor(data) for c in clients)))
            result.update(replies[0])
        result["num_buckets"] += 1
        result["num_bytes"] += len(data)
    return result


def broadcast_buckets(
    trainer: TrainerRank, group: WeightUpdateGroup | None, clients: list[Client], loop: asyncio.AbstractEventLoop,
    version: int, bucket_bytes: int, sglang: bool = False,
) -> dict[str, Any]:  # fmt: skip
    """Every rank gathers the weights bucket by bucket (a collective); rank 0, which hosts the weight-update `group`
    (rank 0 of it; engine i is rank i + 1) and holds the engines' `clients`, broadcasts each bucket while every
    engine receives it (`/update_weights_from_distributed`). Miles engines: inside one `/begin_weight_update` ..
    `/end_weight_update(version)` bracket. `sglang` engines (whose routes of those names serve quantized weights):
    the last bucket carries the version and flushes the cache."""
    result: dict[str, Any] = {"num_buckets": 0, "num_bytes": 0}
    bracket = group is not None and not sglang
    if bracket:
        loop.run_until_complete(_together(*(c.begin_weight_update() for c in clients)))
    for tensors, last in _with_last(trainer.backend.iter_tensor_buckets(bucket_bytes)):
        if group is not None:
            stamp = {"weight_version": version if last else None, "flush_cache": last} if sglang else {}
            replies = loop.run_until_complete(_broadcast_bucket(group, clients, tensors, stamp))
            if sglang and last and "weight_version" in replies[0]:  # SGLang's reply has none; a stand-in's may
                result["weight_version"] = replies[0]["weight_version"]
        result["num_buckets"] += 1
        result["num_bytes"] += sum(t.numel() * t.element_size() for t in tensors.values())
    if bracket:
        replies = loop.run_until_complete(_together(*(c.end_weight_update(version) for c in clients)))
        result["weight_version"] = replies[0]["weight_version"]
    return result


def _with_last(items: Iterable[T]) -> Iterator[tuple[T, bool]]:
    """Each item with whether it is the last one (one item read ahead)."""
    iterator = iter(items)
    try:
        current = next(iterator)
    except StopIteration:
        return
    for following in iterator:
        yield current, False
        current = following
    yield current, True


async def _together(*calls: Awaitable[Any]) -> list[Any]:
    """`asyncio.gather` inside a coroutine, so that it runs on the loop that runs the coroutine."""
    return list(await asyncio.gather(*calls))


async def _broadcast_bucket(
    group: WeightUpdateGroup, clients: list[Client], tensors: dict[str, Any], stamp: dict[str, Any]
) -> list[dict[str, Any]]:
    """Every engine receives the bucket (`/update_weights_from_distributed`, with `stamp`'s fields) while rank 0
    broadcasts it (from its GPU over NCCL); the engines' replies."""
    values = list(tensors.values())
    dtypes, shapes = [dtype_name(t.dtype) for t in values], [list(t.shape) for t in values]
    if group.backend == "nccl":
        values = [t.to("cuda") for t in values]
    names = list(tensors)
    receives = [
        c.update_weights_from_distributed(names, dtypes, shapes, group_name=WEIGHT_GROUP, **stamp) for c in clients
    ]
    replies, _ = await asyncio.gather(
        asyncio.gather(*receives), asyncio.to_thread(broadcast_tensors, group, values, 0)
    )
    return list(replies)


def copy_in_process(trainer: TrainerRank, engine: Engine, version: int) -> dict[str, Any]:
    """The trainer's weights (HF names, kernel dtype) copied into the engine's model as `version`; call it on the
    engine's thread, between engine steps (`Engine.control`)."""
    tensors = trainer.backend.export_weights()
    applied = engine.weights.load_tensors(tensors, version)
    num_bytes = sum(t.numel() * t.element_size() for t in tensors.values())
    return {"num_buckets": 0, "num_bytes": num_bytes, "weight_version": applied}
