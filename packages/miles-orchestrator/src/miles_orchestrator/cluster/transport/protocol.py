"""The two halves of a weight transport and what the Ray cluster gives them (docs/architecture.md, "Weight sync").

- `WeightTransport`, the driver's half: what `RayCluster` and `LocalCluster` call, never asking which transport
  it is: `prepare` once the engines and trainer ranks are up, `send` for every sync, `after_restart` for an engine
  the supervisor replaced, `close` at shutdown.
- `RankSide`, the half inside each trainer rank (`TrainerRankActor.weight_sync`): built once per rank from the
  backend's `WeightSender`, then called by name, one of the `CALLS` its class declares.
- `SyncContext`: what a Ray run's transport reaches (`TrainerRanks`, the engines, the run config); a Ray transport
  is built from it alone (`RayTransport`, the registry's classes, transport/__init__.py).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Protocol, runtime_checkable

from miles_orchestrator.config import RunConfig
from miles_rollout import Client
from miles_trainer import WeightSender

if TYPE_CHECKING:
    from miles_orchestrator.cluster.ray.fleet import EngineFleet


@runtime_checkable
class WeightTransport(Protocol):
    """The driver's half of a weight transport (`RayCluster`, `LocalCluster`)."""

    @property
    def name(self) -> str:
        """`run.sync_transport`, resolved (`in_process` for the local cluster)."""

    @property
    def description(self) -> str:
        """How the weights reach the engines, for the log (the cluster's `sync_method`)."""

    async def prepare(self) -> None:
        """Set up what every sync uses (a directory, trainer rank 0's clients of the engines, a weight-update group),
        once the engines and the trainer ranks are up."""

    async def send(self, version: int, bucket_bytes: int) -> dict[str, Any]:
        """The trainer's weights to every engine as `version`: `num_buckets`, `num_bytes` and the engines' reply
        (`weight_version`, where they report it)."""

    async def after_restart(self, engine: int, client: Client) -> bool:
        """Engine `engine`, restarted (`client`), gets the weights the others serve, and the next `send` reaches it;
        False when there was nothing to copy (the others' memory released): the next sync sends it the weights."""

    async def close(self) -> None:
        """Release what `prepare` set up (idempotent; after a failed `prepare` too)."""


class RankSide(Protocol):
    """A transport's part in one trainer rank, called by the driver's half with one of `CALLS` (nothing else:
    `TrainerRankActor.weight_sync` refuses other names). Rank 0 sends; the other ranks only join the gathers."""

    CALLS: ClassVar[tuple[str, ...]]

    def __init__(self, weights: WeightSender, model_dir: str, rank: int) -> None: ...


class TrainerRanks(Protocol):
    """The trainer ranks as a transport's driver half calls them: its `RankSide`'s calls, by name."""

    async def all(self, call: str, *args: Any) -> list[Any]:
        """`call` on every rank at once (the gathers are collectives); the results in rank order."""

    async def first(self, call: str, *args: Any) -> Any:
        """`call` on rank 0 alone (it holds the engines' clients and hosts the weight-update group)."""

    async def rank0_address(self, engine_host: str) -> tuple[str, int]:
        """Where engines bound to `engine_host` reach rank 0 (loopback when they bind loopback, else its node's IP)
        and a free port there."""


@dataclass(frozen=True)
class SyncContext:
    """What `RayCluster` gives a Ray run's transport."""

    cfg: RunConfig
    run_dir: Path
    ranks: TrainerRanks
    engines: EngineFleet  # every engine's admin client (`members`, engine order), the fleet's state (`released`)
    urls: Callable[[], list[str]]  # the engines' URLs now (a restarted engine's replaces its predecessor's)
    admin_key: str
    healthy_peer: Callable[[int], Client | None]  # an engine other than the given one, not being restarted
    log: Callable[[str], None]
    rank0_node: str  # the Ray node of trainer rank 0, and of each engine
    engine_nodes: list[str]

    def describe(self, where: str) -> str:
        """`where` the weights go, with the Ray nodes they go from and to (the transport's `description`)."""
        engines = "1 engine" if len(self.engine_nodes) == 1 else f"{len(self.engine_nodes)} engines"
        nodes = ", ".join(node[:8] for node in self.engine_nodes)
        return f"{where} (Ray node {self.rank0_node[:8]}) to {engines} (Ray nodes {nodes})"


class RayTransport(WeightTransport, Protocol):
    """A transport of the registry (`run.sync_transport`): built from a `SyncContext`, with the class of its part in
    each trainer rank."""

    rank_side: ClassVar[type[RankSide]]

    def __init__(self, context: SyncContext) -> None: ...
