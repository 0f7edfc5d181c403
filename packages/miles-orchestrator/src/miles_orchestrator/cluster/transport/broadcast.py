"""The distributed transport (`run.sync_transport=distributed`; `auto` for several engines off rank 0's node, and
for SGLang engines where their layout allows it): trainer rank 0 hosts a `torch.distributed` group of its own with
every engine (rank 0 of it; engine i is rank i + 1), gloo on CPUs, NCCL from a CUDA trainer to SGLang's GPUs
(`weight_group_backend`). Every rank gathers the weights bucket by bucket (a collective,
`miles_trainer.WeightSender.iter_tensor_buckets`); rank 0 broadcasts each bucket's raw tensors while every engine
receives them (`/update_weights_from_distributed`). A Miles engine's buckets are bracketed by `/begin_weight_update`
and `/end_weight_update(version)`, so no request runs on half-updated weights; an SGLang engine's (whose routes of
those names serve quantized weights) carry the version and the cache flush on the last bucket, as slime sends them,
and no request runs meanwhile: a sync run syncs between rollouts, an async one pauses generation around the sync.

A restarted engine died with its membership: it copies a healthy engine's weights (peer_copy.py), or, SGLang engines
having no route for that, loads the weight file each sync also writes when fault tolerance is on (`run.sync_dir`,
file.py); the next sync first rebuilds the group with it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any, ClassVar, TypeVar

from miles_kernels import (
    WeightUpdateGroup,
    broadcast_tensors,
    destroy_weight_update_group,
    dtype_name,
    init_weight_update_group,
)
from miles_orchestrator.cluster.transport.engine_clients import EngineClients
from miles_orchestrator.cluster.transport.file import WeightFile, sync_directory, write_weight_file
from miles_orchestrator.cluster.transport.peer_copy import copy_from_peer
from miles_orchestrator.cluster.transport.protocol import RankSide, SyncContext
from miles_rollout import Client
from miles_trainer import WeightSender

T = TypeVar("T")
WEIGHT_GROUP = "miles_weight_sync"  # the weight-update group of trainer rank 0 and the engines


def weight_group_backend(sglang_engines: bool, trainer_device: str) -> str:
    """The weight-update group's backend: NCCL from a CUDA trainer to SGLang engines (their weights are on GPUs;
    rank 0 moves each bucket to its GPU), else gloo (the embedded engine, a CPU trainer)."""
    return "nccl" if sglang_engines and trainer_device.startswith("cuda") else "gloo"


class BroadcastRankSide:
    """A trainer rank's part: it gathers the buckets; rank 0 hosts the group (`host_weight_group`), holds the
    engines' clients (`connect_engines`) and broadcasts. Every rank writes the restart file with the others."""

    CALLS: ClassVar[tuple[str, ...]] = (
        "connect_engines",
        "host_weight_group",
        "leave_weight_group",
        "broadcast_weights",
        "write_weights",
    )

    def __init__(self, weights: WeightSender, model_dir: str, rank: int) -> None:
        self.weights, self.model_dir, self.rank = weights, model_dir, rank
        self.engines = EngineClients()
        self.group: WeightUpdateGroup | None = None  # rank 0: the weight-update group it hosts

    def connect_engines(self, urls: list[str], admin_key: str) -> None:
        """Rank 0: a client of every engine, kept across syncs."""
        self.engines.connect(urls, admin_key)

    def host_weight_group(self, address: str, port: int, world_size: int, backend: str) -> None:
        """Rank 0: host the weight-update group at address:port as its rank 0 (blocks until every engine joined)."""
        self.group = init_weight_update_group(address, port, 0, world_size, WEIGHT_GROUP, backend)

    def leave_weight_group(self) -> None:
        """Rank 0: leave the weight-update group it hosts (an engine of it was restarted; a new group follows)."""
        if self.group is not None:
            destroy_weight_update_group(self.group)
            self.group = None

    def broadcast_weights(self, version: int, bucket_bytes: int, sglang: bool) -> dict[str, Any]:
        """Every rank gathers the buckets; rank 0 broadcasts each while every engine receives it. Miles engines:
        inside one `/begin_weight_update` .. `/end_weight_update(version)` bracket; `sglang` engines: the last
        bucket carries the version and flushes the cache."""
        group, clients = self.group, self.engines.clients
        result: dict[str, Any] = {"num_buckets": 0, "num_bytes": 0}
        bracket = group is not None and not sglang
        if bracket:
            self.engines.gather(c.begin_weight_update() for c in clients)
        for tensors, last in _with_last(self.weights.iter_tensor_buckets(bucket_bytes)):
            if group is not None:
                stamp = {"weight_version": version if last else None, "flush_cache": last} if sglang else {}
                replies = self.engines.run(_broadcast_bucket(group, clients, tensors, stamp))
                if sglang and last and "weight_version" in replies[0]:  # SGLang's reply has none; a stand-in's may
                    result["weight_version"] = replies[0]["weight_version"]
            result["num_buckets"] += 1
            result["num_bytes"] += sum(t.numel() * t.element_size() for t in tensors.values())
        if bracket:
            replies = self.engines.gather(c.end_weight_update(version) for c in clients)
            result["weight_version"] = replies[0]["weight_version"]
        return result

    def write_weights(self, directory: str) -> int:
        """The restart file (`file.write_weight_file` on this rank: rank 0 writes)."""
        return write_weight_file(self.weights, self.model_dir, Path(directory), is_writer=self.rank == 0)


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


class BroadcastTransport:
    """The driver's half: the group built at start-up and rebuilt after engine restarts; every rank sends."""

    name = "distributed"
    rank_side: ClassVar[type[RankSide]] = BroadcastRankSide

    def __init__(self, context: SyncContext) -> None:
        self.context = context
        cfg = context.cfg
        self.sglang = cfg.rollout.backend == "sglang"
        self.group_backend = weight_group_backend(self.sglang, cfg.trainer.backend.device)
        # SGLang engines with fault tolerance: each sync also writes the weights to a file, for a restarted engine to
        # load (SGLang has no route to copy a peer's weights)
        self.restart_file: WeightFile | None = None
        self.restarted: set[int] = set()  # engines restarted since the last sync: the group is rebuilt first

    @property
    def description(self) -> str:
        return self.context.describe(f"a {self.group_backend} broadcast from trainer rank 0")

    async def prepare(self) -> None:
        await self._connect()
        cfg = self.context.cfg
        if self.sglang and cfg.rollout.fault_tolerance.enabled:
            self.restart_file = WeightFile(sync_directory(self.context.run_dir, cfg.run.sync_dir))
        await self._join_group()

    async def _connect(self) -> None:
        """Rank 0: a client of every engine, at its URL now."""
        await self.context.ranks.first("connect_engines", self.context.urls(), self.context.admin_key)

    async def _join_group(self) -> None:
        """Trainer rank 0 hosts the weight-update group (its rank 0); engine i joins it as rank i + 1."""
        members = self.context.engines.members
        world_size = len(members) + 1
        address, port = await self.context.ranks.rank0_address(self.context.cfg.rollout.engine_host)
        joins = [
            member.init_weights_update_group(address, port, rank_offset=i + 1, world_size=world_size,
                                             group_name=WEIGHT_GROUP, backend=self.group_backend)
            for i, member in enumerate(members)
        ]  # fmt: skip
        host = self.context.ranks.first("host_weight_group", address, port, world_size, self.group_backend)
        await asyncio.gather(host, *joins)

    async def _rebuild_group(self) -> None:
        """After engine restarts, before the next sync: rank 0 gets clients of the new URLs, and the weight-update
        group, whose restarted members died with it, is rebuilt: the others leave it, rank 0 drops it, everyone
        joins a new one."""
        await self._connect()
        leaving = [m for i, m in enumerate(self.context.engines.members) if i not in self.restarted]
        await asyncio.gather(*(m.destroy_weights_update_group(WEIGHT_GROUP) for m in leaving))
        await self.context.ranks.first("leave_weight_group")
        await self._join_group()
        self.restarted.clear()

    async def send(self, version: int, bucket_bytes: int) -> dict[str, Any]:
        if self.restarted:
            await self._rebuild_group()
        ranks = self.context.ranks
        result: dict[str, Any] = (await ranks.all("broadcast_weights", version, bucket_bytes, self.sglang))[0]
        if self.restart_file is not None:
            await self.restart_file.write(ranks, version)
        return result

    async def after_restart(self, engine: int, client: Client) -> bool:
        self.restarted.add(engine)
        if self.restart_file is not None:
            await self.restart_file.load_into(client)
            return True
        return await copy_from_peer(self.context, engine, client, self.name)

    async def close(self) -> None:
        """Nothing to release: the group goes with rank 0's actor and the engines."""
