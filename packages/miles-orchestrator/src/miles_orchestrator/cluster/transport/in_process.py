"""The local cluster's weight sync (`run.cluster=local`): the engine and the trainer share the driver process, so a
sync is one in-memory copy of the trainer's weights (HF names, kernel dtype; `miles_trainer.WeightSender`'s
`export_weights`) into the engine's model (`miles_rollout.Engine.weights.load_tensors`), with no file or bucket in
between. It runs on the engine's thread, between engine steps (`LocalCluster._on_engine`); the trainer rank is the
local cluster's own, so there is no rank side to call.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from miles_rollout import Client, Engine
from miles_trainer import WeightSender

OnEngine = Callable[[Callable[[], dict[str, Any]]], Awaitable[dict[str, Any]]]


class InProcessTransport:
    """A copy from `weights` into `engine`, run by `on_engine` (on the engine's thread, once no request runs)."""

    name = "in_process"
    description = "an in-process copy"

    def __init__(self, engine: Engine, weights: WeightSender, on_engine: OnEngine) -> None:
        self.engine, self.weights, self.on_engine = engine, weights, on_engine

    async def prepare(self) -> None:
        """Nothing to set up: the engine is in this process."""

    async def send(self, version: int, bucket_bytes: int) -> dict[str, Any]:
        return await self.on_engine(lambda: self._copy(version))

    def _copy(self, version: int) -> dict[str, Any]:
        """The trainer's weights copied into the engine's model as `version`."""
        tensors = self.weights.export_weights()
        applied = self.engine.weights.load_tensors(tensors, version)
        num_bytes = sum(t.numel() * t.element_size() for t in tensors.values())
        return {"num_buckets": 0, "num_bytes": num_bytes, "weight_version": applied}

    async def after_restart(self, engine: int, client: Client) -> bool:
        """Nothing restarts an engine in this process (rollout.fault_tolerance is for run.cluster=ray)."""
        raise NotImplementedError("the local cluster's engine is never restarted")

    async def close(self) -> None:
        """Nothing to release."""
