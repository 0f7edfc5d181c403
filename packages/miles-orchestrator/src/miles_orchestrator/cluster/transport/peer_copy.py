"""A restarted engine's weights copied from a healthy one (http, and distributed to Miles engines): the transports
without a weight file to load (docs/fault-tolerance.md). The driver reads the healthy engine's served weights bucket
by bucket (`GET /weight_buckets`, under its served version) and posts each to the restarted engine
(`/update_weights_from_tensor`; the last bucket applies the version), in the run's bucket size
(`run.sync_bucket_bytes`, what every sync sends).
"""

from __future__ import annotations

from http import HTTPStatus

from miles_orchestrator.cluster.transport.protocol import SyncContext
from miles_rollout import Client, RolloutClientError


async def copy_from_peer(context: SyncContext, engine: int, client: Client, transport: str) -> bool:
    """Engine `engine`, restarted (`client`), gets a healthy engine's weights; False when there was nothing to copy
    (the others' memory released, or being released mid-copy): the next sync, right after training, sends them.
    `transport`: the run's, for the error when no engine is healthy."""
    if context.engines.released:  # the others hold no weights now; the next sync (right after training) sends them
        return False
    peer = context.healthy_peer(engine)
    if peer is None:
        raise RuntimeError(
            f"no healthy engine to copy the weights from: with run.sync_transport={transport} a restarted "
            "engine copies them from another engine; use run.sync_transport=shm (one node) or disk (a shared "
            "run.sync_dir), whose weight file re-syncs a lone engine"
        )
    index, count = 0, 1
    while index < count:
        try:
            data, count = await peer.get_weight_bucket(index, context.cfg.run.sync_bucket_bytes)
        except RolloutClientError as error:
            if error.status_code != HTTPStatus.CONFLICT:
                raise
            # the peer released its weights since (the fleet is releasing for the trainer's turn): this engine
            # is released with the others, and the next sync sends it the weights
            context.log(f"rollout engine {engine}: its peer released its weights mid-copy; the next sync sends them")
            return False
        await client.update_weights_from_tensor(data)
        index += 1
    return True
