"""How a run moves the trainer's weights to the engine (step 7 of the RL data path; docs/architecture.md, "Weight
sync"): the orchestrator's part of weight sync, between the trainer's sender (`miles_trainer/weight_sender.py`) and
the engine's receiver (`miles_rollout/weight_receiver.py`).

- `shared_sync_dir` picks the transport of a Ray run (`run.sync_transport`): a safetensors file in /dev/shm when
  the engine shares trainer rank 0's node and the model fits in RAM twice, else buckets over HTTP;
- `write_shared_file`: every rank gathers the weights, rank 0 overwrites the file, the driver then tells the engine
  to load it (`/update_weights_from_disk`);
- `post_buckets`: every rank gathers the weights bucket by bucket, rank 0 posts each to the engine
  (`/update_weights_from_tensor`; the last bucket applies the version);
- `copy_in_process`: the local cluster's sync, one in-memory copy from the trainer into the engine's model.

Nothing is pickled: a file or a bucket is safetensors, the in-process copy is tensors.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import shutil
from pathlib import Path
from typing import Any

from miles_orchestrator.trainer_rank import TrainerRank
from miles_rollout import Client, Engine

SHARED_MEMORY = Path("/dev/shm")
SHM_SYNC_MAX_BYTES = 1 << 30  # `auto` syncs through shared memory up to this checkpoint size (one copy in RAM)


def shared_sync_dir(transport: str, run_dir: Path, same_node: bool, weight_bytes: int) -> Path | None:
    """Where weight syncs go through shared memory, or None for buckets over HTTP (`run.sync_transport`).

    The directory is named after the run dir, so a resumed run reuses (and a finished run removes) the same one.
    """
    usable = same_node and SHARED_MEMORY.is_dir() and os.access(SHARED_MEMORY, os.W_OK)
    if transport == "shm" and not usable:
        raise ValueError(
            "run.sync_transport=shm needs the engine on trainer rank 0's node and a writable /dev/shm; "
            "use run.sync_transport=http (or auto)"
        )
    if transport == "http" or (transport == "auto" and (not usable or weight_bytes > SHM_SYNC_MAX_BYTES)):
        return None
    directory = SHARED_MEMORY / f"miles-sync-{hashlib.sha256(str(run_dir.resolve()).encode()).hexdigest()[:16]}"
    directory.mkdir(exist_ok=True)
    return directory


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
    trainer: TrainerRank, client: Client | None, loop: asyncio.AbstractEventLoop, version: int, bucket_bytes: int
) -> dict[str, Any]:
    """Every rank gathers the weights bucket by bucket (a collective); the rank holding a `client` (rank 0) posts
    each bucket to the engine, whose reply to the last one carries the applied version. An engine that refuses a
    bucket raises `RolloutClientError`."""
    result: dict[str, Any] = {"num_buckets": 0, "num_bytes": 0}
    for data in trainer.backend.iter_weight_buckets(version, bucket_bytes):
        if client is not None:
            result.update(loop.run_until_complete(client.update_weights_from_tensor(data)))
        result["num_buckets"] += 1
        result["num_bytes"] += len(data)
    return result


def copy_in_process(trainer: TrainerRank, engine: Engine, version: int) -> dict[str, Any]:
    """The trainer's weights (HF names, kernel dtype) copied into the engine's model as `version`; call it on the
    engine's thread, between engine steps (`Engine.control`)."""
    tensors = trainer.backend.export_weights()
    applied = engine.weights.load_tensors(tensors, version)
    num_bytes = sum(t.numel() * t.element_size() for t in tensors.values())
    return {"num_buckets": 0, "num_bytes": num_bytes, "weight_version": applied}
