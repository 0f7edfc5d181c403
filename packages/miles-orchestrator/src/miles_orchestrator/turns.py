"""Colocation turns: with `run.colocate` the engine and the trainer take turns on the same devices (docs/memory.md);
separate, every turn is a no-op."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

from miles_orchestrator.cluster import Cluster


class Turns:
    """Colocated (`run.colocate`), the engine and the trainer take turns on the same devices: the engine releases
    its KV cache and weights while the trainer works, the trainer offloads while the engine works. Each switch is
    made once (a resumed engine is not resumed again); separate, nothing moves. `is_partial`
    (`memory.partial_offload`): the trainer offloads only what it must for the engine's memory to fit beside it
    within `memory.limit_bytes` (docs/memory.md)."""

    def __init__(self, cluster: Cluster, is_colocated: bool, is_partial: bool = False) -> None:
        self.cluster, self.is_colocated, self.is_partial = cluster, is_colocated, is_partial
        self.engine_released = self.trainer_offloaded = False
        self.engine_bytes = 0  # what the engine holds when resident (weights and KV cache)
        self.offloaded_bytes = 0  # what the trainer moved out at its last offload (all ranks)

    async def measure_engine(self) -> None:
        """Read the engine's resident bytes of the tags it releases and resumes (before it releases any): the room
        it takes back on the device; its routed-experts buffer is host memory it never releases."""
        held = (await self.cluster.engine.get_server_info()).get("memory_bytes", {})
        self.engine_bytes = sum(held.get(tag, 0) for tag in ("weights", "kv_cache"))

    def memory_metrics(self) -> dict[str, float]:
        return {
            "mem_engine_bytes": float(self.engine_bytes),
            "mem_trainer_offloaded_bytes": float(self.offloaded_bytes),
        }

    async def resume_engine(self) -> None:
        """The engine takes its memory back (before it receives weights)."""
        if self.engine_released:
            await self.cluster.engine.resume_memory_occupation()
            self.engine_released = False

    async def engine_turn(self) -> None:
        await self.resume_engine()
        if self.is_colocated and not self.trainer_offloaded:
            room_for = self.engine_bytes if self.is_partial else None
            self.offloaded_bytes = await self.cluster.offload_trainer(room_for)
            self.trainer_offloaded = True

    @contextlib.asynccontextmanager
    async def trainer_turn(self) -> AsyncIterator[None]:
        """The trainer's turn; on exit (a weight sync inside has resumed the engine already) the engine's."""
        if self.is_colocated:
            await self.cluster.engine.release_memory_occupation()
            self.engine_released = True
            await self.cluster.onload_trainer()
            self.trainer_offloaded = False
        try:
            yield
        finally:
            await self.engine_turn()
