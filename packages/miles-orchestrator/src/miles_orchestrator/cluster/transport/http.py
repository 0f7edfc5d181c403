"""The http transport (`run.sync_transport=http`; `auto` for one engine off rank 0's node): every rank gathers the
weights bucket by bucket (a collective, `miles_trainer.WeightSender.iter_weight_buckets`); rank 0 posts each bucket,
safetensors bytes in the `miles_kernels` codec, to every engine at once (`/update_weights_from_tensor`); the replies
to the last one carry the applied version. A restarted engine copies a healthy one's weights (peer_copy.py); the
next sync reconnects rank 0 to it first.
"""

from __future__ import annotations

from typing import Any, ClassVar

from miles_orchestrator.cluster.transport.engine_clients import EngineClients
from miles_orchestrator.cluster.transport.peer_copy import copy_from_peer
from miles_orchestrator.cluster.transport.protocol import RankSide, SyncContext
from miles_rollout import Client
from miles_trainer import WeightSender


class HttpRankSide:
    """A trainer rank's part: it gathers the buckets; rank 0 (`connect_engines`) posts them."""

    CALLS: ClassVar[tuple[str, ...]] = ("connect_engines", "send_weight_buckets")

    def __init__(self, weights: WeightSender, model_dir: str, rank: int) -> None:
        self.weights = weights
        self.engines = EngineClients()

    def connect_engines(self, urls: list[str], admin_key: str) -> None:
        """Rank 0: a client of every engine, kept across syncs."""
        self.engines.connect(urls, admin_key)

    def send_weight_buckets(self, version: int, bucket_bytes: int) -> dict[str, Any]:
        """Every rank gathers the buckets; the rank holding the engines' clients (rank 0) posts each to every engine.
        An engine that refuses a bucket raises `RolloutClientError`."""
        result: dict[str, Any] = {"num_buckets": 0, "num_bytes": 0}
        for data in self.weights.iter_weight_buckets(version, bucket_bytes):
            if self.engines.clients:
                replies = self.engines.gather(c.update_weights_from_tensor(data) for c in self.engines.clients)
                result.update(replies[0])
            result["num_buckets"] += 1
            result["num_bytes"] += len(data)
        return result


class HttpTransport:
    """The driver's half: rank 0 connected at start-up and after engine restarts; every rank sends."""

    name = "http"
    rank_side: ClassVar[type[RankSide]] = HttpRankSide

    def __init__(self, context: SyncContext) -> None:
        self.context = context
        self.restarted: set[int] = set()  # engines restarted since the last sync: rank 0 reconnects first

    @property
    def description(self) -> str:
        return self.context.describe("HTTP buckets")

    async def prepare(self) -> None:
        await self._connect()

    async def _connect(self) -> None:
        """Rank 0: a client of every engine, at its URL now."""
        await self.context.ranks.first("connect_engines", self.context.urls(), self.context.admin_key)

    async def send(self, version: int, bucket_bytes: int) -> dict[str, Any]:
        if self.restarted:
            await self._connect()
            self.restarted.clear()
        result: dict[str, Any] = (await self.context.ranks.all("send_weight_buckets", version, bucket_bytes))[0]
        return result

    async def after_restart(self, engine: int, client: Client) -> bool:
        self.restarted.add(engine)
        return await copy_from_peer(self.context, engine, client, self.name)

    async def close(self) -> None:
        """Nothing to release: rank 0's clients go with its actor."""
