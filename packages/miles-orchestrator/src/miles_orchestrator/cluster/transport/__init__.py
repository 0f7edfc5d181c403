"""How a run moves the trainer's weights to the engines (step 7 of the RL data path; docs/architecture.md, "Weight
sync"): the orchestrator's whole part of weight sync, between the trainer's sender (`miles_trainer.WeightSender`,
`backend.weights`) and the engine's receiver (`miles_rollout/weight_receiver.py`, behind its HTTP routes).

One file per transport, each holding its driver's half (a `WeightTransport`, protocol.py), its part in every trainer
rank (a `RankSide`) and the engine routes they call:
- file.py: `shm` and `disk`, one safetensors file rank 0 overwrites and every engine loads;
- http.py: `http`, buckets rank 0 posts to every engine;
- broadcast.py: `distributed`, buckets rank 0 broadcasts over a `torch.distributed` group with every engine;
- in_process.py: the local cluster's in-memory copy into the engine in the same process.
A restarted engine copies a healthy one's weights where there is no weight file (peer_copy.py); rank 0 keeps its
clients of the engines on one event loop (engine_clients.py). Every Ray transport sends from trainer rank 0: all
ranks gather each tensor from their shards (a collective), rank 0 sends the full tensors to every engine. Nothing
is pickled: a file or a bucket is safetensors, a broadcast is raw tensors, the in-process copy is tensors.

`TRANSPORTS` names the Ray transports by `run.sync_transport`; `make_transport` builds the one a run resolves to
(`resolve_transport`). A new transport is a new file and a line here.
"""

from __future__ import annotations

import os
from pathlib import Path

from miles_orchestrator.cluster.transport.broadcast import BroadcastTransport
from miles_orchestrator.cluster.transport.file import (
    SHARED_MEMORY,
    DiskTransport,
    SharedMemoryTransport,
    remove_stale_sync_dirs,
)
from miles_orchestrator.cluster.transport.http import HttpTransport
from miles_orchestrator.cluster.transport.in_process import InProcessTransport
from miles_orchestrator.cluster.transport.protocol import (
    RankSide,
    RayTransport,
    SyncContext,
    TrainerRanks,
    WeightTransport,
)

SHM_SYNC_MAX_BYTES = 1 << 30  # `auto` syncs through shared memory up to this checkpoint size (one copy in RAM)
NETWORK = ("http", "distributed")  # the network transports a Miles engine takes

TRANSPORTS: dict[str, type[RayTransport]] = {
    "shm": SharedMemoryTransport,
    "disk": DiskTransport,
    "http": HttpTransport,
    "distributed": BroadcastTransport,
}


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


def checkpoint_bytes(model_dir: str) -> int:
    return sum(f.stat().st_size for f in Path(model_dir).glob("*.safetensors"))


def make_transport(context: SyncContext, model_dir: str) -> RayTransport:
    """The transport of a Ray run, resolved from where the engines landed (`context`'s nodes) and the checkpoint's
    size, not yet prepared. The shm directories of this user's dead runs are removed first, whichever it is."""
    cfg = context.cfg
    same_node = all(node == context.rank0_node for node in context.engine_nodes)
    sglang = cfg.rollout.backend == "sglang"
    network = cfg.rollout.sglang.network_transports(cfg.run.colocate) if sglang else NETWORK
    name = resolve_transport(cfg.run.sync_transport, same_node, checkpoint_bytes(model_dir),
                             len(context.engine_nodes), network)  # fmt: skip
    for stale in remove_stale_sync_dirs():
        context.log(f"removed {stale}: the shm weight-sync directory of a run that died")
    return TRANSPORTS[name](context)


def rank_side(name: str) -> type[RankSide]:
    """The class of transport `name`'s part in each trainer rank."""
    return TRANSPORTS[name].rank_side


__all__ = [
    "NETWORK", "TRANSPORTS", "InProcessTransport", "RankSide", "RayTransport", "SyncContext", "TrainerRanks",
    "WeightTransport", "make_transport", "rank_side", "resolve_transport",
]  # fmt: skip
