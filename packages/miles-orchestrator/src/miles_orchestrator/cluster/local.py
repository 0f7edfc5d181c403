"""`LocalCluster` (`run.cluster=local`): the engine and one trainer rank in the driver process, no Ray, no HTTP.

The loop's client of the engine is a `miles_rollout.InProcessClient`; trainer calls and weight syncs run on the
engine's own thread, between engine steps (`Engine.control`): every torch op of the run then runs on one thread,
because a second thread that has run parallel ops keeps an OpenMP team of its own, and two teams on the same cores
slowed both sides ~1.5-2x (measured). A weight sync is one in-memory copy of the trainer's weights into the
engine's (`transport/in_process.py`), with no file or bucket in between. More trainer ranks need `run.cluster=ray`;
the run config says so at start-up. See protocol.py for the interface.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar, cast

import torch

from miles_contracts import Sample
from miles_orchestrator.cluster.protocol import CriticTargets
from miles_orchestrator.cluster.settings import num_threads, trainer_settings
from miles_orchestrator.cluster.trainer_rank import TrainerRank
from miles_orchestrator.cluster.transport import InProcessTransport, WeightTransport
from miles_orchestrator.config import RunConfig
from miles_rollout import Engine, InProcessClient
from miles_trainer import ensure_process_group

T = TypeVar("T")


class LocalCluster:
    """An in-process `Engine` and `TrainerRank`; every call runs on the engine's thread."""

    def __init__(self, engine: Engine, owns_process_group: bool) -> None:
        self._engine = engine
        self.engine = InProcessClient(engine)
        self._owns_process_group = owns_process_group
        self.trainer: TrainerRank | None = None
        self.trainer_fingerprint = ""
        self.transport: WeightTransport | None = None

    @classmethod
    async def start(cls, cfg: RunConfig, model_dir: str, run_dir: Path) -> LocalCluster:
        torch.set_num_threads(num_threads(cfg))  # the engine thread takes its creator's setting
        engine = Engine(model_dir, cfg.kernel, cfg.rollout.engine)
        self = cls(engine, owns_process_group=False)
        try:
            self._owns_process_group = ensure_process_group()
            settings = trainer_settings(cfg, run_dir)
            self.trainer = await self._on_engine(lambda: TrainerRank(model_dir, settings))
            self.trainer_fingerprint = await self._on_engine(self._trainer.fingerprint)
            self.transport = InProcessTransport(engine, self._trainer.backend.weights, self._on_engine)
            await self.transport.prepare()
        except BaseException:
            await self.shutdown()
            raise
        return self

    @property
    def _trainer(self) -> TrainerRank:
        assert self.trainer is not None, "start() first"
        return self.trainer

    @property
    def _transport(self) -> WeightTransport:
        assert self.transport is not None, "start() first"
        return self.transport

    @property
    def engine_model(self) -> torch.nn.Module:
        """The engine's model (the mismatch analyzer's hooks read its layers; generate through `engine`)."""
        return self._engine.model

    @property
    def trainer_model(self) -> torch.nn.Module:
        """The trainer's policy model (the mismatch analyzer's hooks; forward through `compute_logprobs`)."""
        return self._trainer.backend.model

    @property
    def sync_method(self) -> str:
        """How weights reach the engine, for the log: the transport's description."""
        return self._transport.description

    async def _on_engine(self, fn: Callable[[], T]) -> T:
        """Run `fn` on the engine thread once no request is running; its exception comes back as raised (with
        its traceback), not as the engine's wrapped error."""

        def call() -> tuple[T | None, BaseException | None]:
            try:
                return fn(), None
            except Exception as error:
                return None, error

        result, error = await self._engine.control(call, needs_idle=True)
        if error is not None:
            raise error
        return cast(T, result)

    async def train(
        self, samples: list[Sample], advantages: list[list[float]], old_logprobs: list[list[float]] | None,
        measure: bool, critic: CriticTargets | None = None,
    ) -> dict[str, float]:  # fmt: skip
        return await self._on_engine(lambda: self._trainer.train(samples, advantages, old_logprobs, measure, critic))

    async def compute_logprobs(self, samples: list[Sample]) -> list[list[float]]:
        return await self._on_engine(lambda: self._trainer.compute_logprobs(samples))

    async def compute_values(self, samples: list[Sample]) -> list[list[float]]:
        return await self._on_engine(lambda: self._trainer.compute_values(samples))

    async def sync_weights(self, version: int, bucket_bytes: int) -> dict[str, Any]:
        return await self._transport.send(version, bucket_bytes)

    async def trainer_checksum(self) -> str:
        return await self._on_engine(self._trainer.weights_checksum)

    async def start_profile(self, directory: Path) -> None:
        """One torch.profiler trace of the engine thread, where the engine's and the trainer's ops both run:
        DIRECTORY/engine_and_trainer-TP-0.trace.json (a profiler records only the thread that starts it, and two in
        one process crash it, so the driver thread is not profiled beside it)."""
        await self.engine.start_profile(str(directory), "engine_and_trainer")

    async def stop_profile(self) -> None:
        await self.engine.stop_profile()

    async def trainer_digests(self) -> dict[str, str]:
        return await self._on_engine(self._trainer.weights_digests)

    async def offload_trainer(self, room_for: int | None = None) -> int:
        return await self._on_engine(lambda: self._trainer.offload(room_for))

    async def onload_trainer(self) -> int:
        return await self._on_engine(self._trainer.onload)

    async def save(self, directory: Path, extra: dict[str, Any]) -> None:
        await self._on_engine(lambda: self._trainer.save(str(directory), extra))

    async def load(self, directory: Path) -> dict[str, Any]:
        return await self._on_engine(lambda: self._trainer.load(str(directory)))

    async def export(self, directory: Path, tokenizer_dir: str) -> None:
        await self._on_engine(lambda: self._trainer.export(str(directory), tokenizer_dir))

    def fault_metrics(self) -> dict[str, float]:
        """The engine runs in this process: nothing restarts it (rollout.fault_tolerance is for run.cluster=ray)."""
        return {}

    async def shutdown(self) -> None:
        if self.transport is not None:
            await self.transport.close()
        self._engine.shutdown()
        if self._owns_process_group:
            import torch.distributed as dist

            with contextlib.suppress(Exception):
                dist.destroy_process_group()
