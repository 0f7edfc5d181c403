"""`RayCluster` (`run.cluster=ray`): the engine actor and the trainer rank actors in one placement group, on a
local Ray (started for the run) or an existing cluster (`run.ray_address`). The loop's one client of the engine
is a `miles_rollout.Client` over HTTP. See cluster.py for the interface.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import secrets
import shutil
import tempfile
from pathlib import Path
from typing import Any

# Under `uv run`, Ray would rebuild the uv environment for every worker from the current directory (and refuse to
# start outside the project). Workers run the driver's own interpreter and venv instead. Read when ray is imported.
os.environ.setdefault("RAY_ENABLE_UV_RUN_RUNTIME_ENV", "0")

import ray
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from miles_contracts import Sample
from miles_orchestrator.actors import RolloutEngineActor, TrainerRankActor
from miles_orchestrator.cluster import CriticTargets, num_threads, trainer_settings
from miles_orchestrator.config import RunConfig
from miles_orchestrator.weight_transport import checkpoint_bytes, shared_sync_dir
from miles_rollout import Client

RAY_TEMP_MAX_CHARS = 40


def start_ray(address: str | None, run_dir: Path, num_cpus: int) -> None:
    """Connect to `address`, or start a local Ray for this run (dashboard off, temp files in a short dir)."""
    if ray.is_initialized():
        return
    if address:
        ray.init(address=address, log_to_driver=False)
        return
    # Ray's unix sockets (TEMP/session_<date>_<time>_<us>_<pid>/sockets/plasma_store, at most 107 bytes) need a
    # short path: keep its temp dir under the run dir only when that leaves room for the ~62 bytes Ray appends.
    temp = run_dir.resolve() / "ray"
    if len(str(temp)) > RAY_TEMP_MAX_CHARS:
        temp = Path(tempfile.mkdtemp(prefix="miles-ray-"))
    ray.init(num_cpus=num_cpus, include_dashboard=False, _temp_dir=str(temp), log_to_driver=False,
             configure_logging=False)  # fmt: skip


class RayCluster:
    """The engine actor, the trainer rank actors and their placement group."""

    def __init__(self) -> None:
        self.engine: Client
        self.trainer_fingerprint = ""
        self.sync_method = ""
        self.sync_dir: Path | None = None
        self.group: Any = None
        self.engine_actor: Any = None
        self.trainers: list[Any] = []

    @classmethod
    async def start(cls, cfg: RunConfig, model_dir: str, run_dir: Path) -> RayCluster:
        self = cls()
        try:
            await self._start(cfg, model_dir, run_dir)
        except BaseException:
            await self.shutdown()
            raise
        return self

    async def _start(self, cfg: RunConfig, model_dir: str, run_dir: Path) -> None:
        num_ranks, threads = cfg.trainer.num_ranks, num_threads(cfg)
        start_ray(cfg.run.ray_address, run_dir, max(threads, num_ranks + 1))
        self.admin_key = secrets.token_hex(16)
        self.group = placement_group([{"CPU": 1}] * (num_ranks + 1), strategy="PACK")
        await asyncio.wait_for(self.group.ready(), timeout=120)

        def place(index: int) -> PlacementGroupSchedulingStrategy:
            return PlacementGroupSchedulingStrategy(self.group, placement_group_bundle_index=index)

        self.engine_actor = (
            ray.remote(RolloutEngineActor)
            .options(num_cpus=1, scheduling_strategy=place(num_ranks))
            .remote(model_dir, cfg.kernel, cfg.rollout.engine, self.admin_key, threads)
        )
        self.trainers = [
            ray.remote(TrainerRankActor)
            .options(num_cpus=1, scheduling_strategy=place(rank))
            .remote(rank, num_ranks, max(1, threads // num_ranks))
            for rank in range(num_ranks)
        ]
        master = await self.trainers[0].address.remote()
        fingerprints = await self._all("setup", master, model_dir, trainer_settings(cfg, run_dir))
        self.trainer_fingerprint = fingerprints[0]
        url = str(await self.engine_actor.get_url.remote())
        self.engine = Client(url, admin_key=self.admin_key, timeout=600)
        self.url = url
        same_node = await self.engine_actor.node_id.remote() == await self.trainers[0].node_id.remote()
        self.sync_dir = shared_sync_dir(cfg.run.sync_transport, run_dir, same_node, checkpoint_bytes(model_dir))
        self.sync_method = "HTTP buckets" if self.sync_dir is None else f"shared memory ({self.sync_dir})"

    async def _all(self, method: str, *args: Any) -> list[Any]:
        return list(await asyncio.gather(*(getattr(t, method).remote(*args) for t in self.trainers)))

    async def _sharded(self, method: str, per_rank: list[Any], *args: Any) -> list[Any]:
        calls = (getattr(t, method).remote(share, *args) for t, share in zip(self.trainers, per_rank, strict=True))
        return list(await asyncio.gather(*calls))

    def _shares(self, samples: list[Sample]) -> list[list[dict[str, Any]]]:
        world = len(self.trainers)
        return [[s.model_dump(mode="json") for s in samples[rank::world]] for rank in range(world)]

    async def train(
        self, samples: list[Sample], advantages: list[list[float]], old_logprobs: list[list[float]] | None,
        measure: bool, critic: CriticTargets | None = None,
    ) -> dict[str, float]:  # fmt: skip
        world = len(self.trainers)
        calls = [
            trainer.train.remote(
                share, advantages[rank::world], None if old_logprobs is None else old_logprobs[rank::world], measure,
                None if critic is None else critic.part(slice(rank, None, world)),
            )
            for rank, (trainer, share) in enumerate(zip(self.trainers, self._shares(samples), strict=True))
        ]  # fmt: skip
        results: list[dict[str, float]] = await asyncio.gather(*calls)
        return results[0]

    async def compute_logprobs(self, samples: list[Sample]) -> list[list[float]]:
        return await self._gathered("compute_logprobs", samples)

    async def compute_values(self, samples: list[Sample]) -> list[list[float]]:
        return await self._gathered("compute_values", samples)

    async def _gathered(self, method: str, samples: list[Sample]) -> list[list[float]]:
        """Per-sample rows each rank computes for its share, back in the batch's order."""
        world = len(self.trainers)
        shares = await self._sharded(method, self._shares(samples))
        out: list[list[float]] = [[] for _ in samples]
        for rank, share in enumerate(shares):
            out[rank::world] = share
        return out

    async def sync_weights(self, version: int, bucket_bytes: int) -> dict[str, Any]:
        if self.sync_dir is None:
            results = await self._all("send_weight_buckets", self.url, self.admin_key, version, bucket_bytes)
            result: dict[str, Any] = results[0]
            return result
        num_bytes = (await self._all("write_weights", str(self.sync_dir)))[0]
        reply = await self.engine.update_weights_from_disk(str(self.sync_dir), version)
        return {**reply, "num_buckets": 1, "num_bytes": num_bytes}

    async def trainer_checksum(self) -> str:
        result: str = (await self._all("weights_checksum"))[0]
        return result

    async def offload_trainer(self, room_for: int | None = None) -> int:
        return sum(await self._all("offload", room_for))

    async def onload_trainer(self) -> int:
        return sum(await self._all("onload"))

    async def save(self, directory: Path, extra: dict[str, Any]) -> None:
        await self._all("save", str(directory), extra)

    async def load(self, directory: Path) -> dict[str, Any]:
        result: dict[str, Any] = (await self._all("load", str(directory)))[0]
        return result

    async def export(self, directory: Path, tokenizer_dir: str) -> None:
        await self._all("export", str(directory), tokenizer_dir)

    async def shutdown(self) -> None:
        """Stop the engine, kill the actors, free the placement group; never masks the run's own error."""
        if getattr(self, "engine", None) is not None:
            with contextlib.suppress(Exception):
                await self.engine.aclose()
        if self.engine_actor is not None:
            with contextlib.suppress(Exception):  # the engine may be gone already
                await asyncio.wait_for(self.engine_actor.shutdown.remote(), timeout=30)
        for actor in [self.engine_actor, *self.trainers]:
            if actor is not None:
                with contextlib.suppress(Exception):
                    ray.kill(actor)
        if self.group is not None:
            with contextlib.suppress(Exception):
                remove_placement_group(self.group)
        if self.sync_dir is not None:
            shutil.rmtree(self.sync_dir, ignore_errors=True)
