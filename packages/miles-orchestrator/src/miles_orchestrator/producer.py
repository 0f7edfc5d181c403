"""The rollout side of the loop: the batches of steps start+1, start+2, ... in order, each made by `generate_batch`
(the same rollout, rewards and filters in every mode; docs/scale-out.md).

The batch of step s is trained by the weights of version s - 1, and is started once the engines serve version
s - 1 - lag or newer, so no token lags the trained version by more than `lag`:

- sync (lag 0): each batch is made inline when the loop asks for it, after the previous step's weights are out;
- one_step_off (lag 1): a producer task makes the batch of step s + 1 while step s trains; the weight sync after
  step s waits for that rollout to finish (`steps.publish_weights`), so no generation spans a sync and every sample
  after the first is exactly one version old;
- async (lag `run.max_staleness`): the weight sync happens as soon as a step is trained, pausing the generations in
  flight (`rollout.pause_mode`): retract continues them under the new weights (the engine recomputes their KV),
  abort ends them and rollout/partial.py continues or regenerates them. Tokens keep the versions that generated them.

Each batch carries the data source's position after its prompts were drawn: a checkpoint saves the position of the
batch it follows, so a resumed run regenerates the batches after it — no prompt lost, none trained twice.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
from dataclasses import dataclass
from types import TracebackType
from typing import Any

from miles_contracts import Sample
from miles_orchestrator.cluster import Cluster
from miles_orchestrator.config import RunConfig
from miles_orchestrator.parts import RunParts
from miles_orchestrator.rollout.batch import DataExhausted, generate_batch
from miles_orchestrator.rollout.partial import aborted_policy
from miles_orchestrator.run_dir import RunDir
from miles_orchestrator.timeline import CURRENT_STEP


@dataclass(frozen=True)
class Produced:
    """One step's batch as the producer made it, with the data source's position after its prompts were drawn."""

    step: int
    batch: list[Sample]
    metrics: dict[str, float]
    position: dict[str, Any]


class Served:
    """The weight version the engines serve; the producer waits on it."""

    def __init__(self, version: int) -> None:
        self.version = version
        self._changed = asyncio.Condition()

    async def at_least(self, version: int) -> None:
        async with self._changed:
            await self._changed.wait_for(lambda: self.version >= version)

    async def set(self, version: int) -> None:
        async with self._changed:
            self.version = version
            self._changed.notify_all()


def lag(cfg: RunConfig) -> int:
    """How many weight versions a token may lag the trained one."""
    return {"sync": 0, "one_step_off": 1}.get(cfg.run.mode, cfg.run.max_staleness)


class Producer:
    """The run's batches in step order (see the module docstring); an async context manager (the producer task, if
    any, is cancelled on exit)."""

    def __init__(self, cfg: RunConfig, cluster: Cluster, run: RunDir, parts: RunParts, start: int) -> None:
        self.cfg, self.cluster, self.run, self.parts, self.start = cfg, cluster, run, parts, start
        self.lag = lag(cfg)
        self.served = Served(start)
        self.generating = asyncio.Lock()  # held while a batch is generated; one_step_off's sync waits for it
        is_default_fn = cfg.rollout.rollout_fn is None and cfg.rollout.agent.env is None
        self.aborted = aborted_policy(cfg.run.mode, cfg.rollout.pause_mode, cfg.rollout.partial_rollout, is_default_fn)
        self._queue: asyncio.Queue[Produced | DataExhausted] = asyncio.Queue()
        self._task: asyncio.Task[None] | None = None

    async def __aenter__(self) -> Producer:
        if self.lag:
            self._task = asyncio.create_task(self._produce(), name="miles-rollout-producer")
        return self

    async def __aexit__(
        self, kind: type[BaseException] | None, error: BaseException | None, traceback: TracebackType | None
    ) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._task

    async def next(self, step: int) -> Produced | DataExhausted:
        """The batch of `step` (or the data source's end); overlapped runs add how long the trainer waited for it
        (`rollout_wait_s`)."""
        if not self.lag:
            return await self._make(step)
        waited = time.perf_counter()
        item = await self._next_queued()
        if isinstance(item, DataExhausted):
            return item
        assert item.step == step, (item.step, step)
        return dataclasses.replace(item, metrics=item.metrics | {"rollout_wait_s": time.perf_counter() - waited})

    async def published(self, version: int) -> None:
        """The engines serve `version` now: batches that wait for it may start."""
        await self.served.set(version)

    async def _make(self, step: int) -> Produced | DataExhausted:
        CURRENT_STEP.set(step)  # this task's timeline spans are the step's
        async with self.generating:
            try:
                with self.run.timeline.span("rollout"):
                    batch, metrics = await generate_batch(
                        self.cfg, self.parts, self.cluster.engine, self.run, self.aborted
                    )
            except DataExhausted as end:
                return end
        return Produced(step, batch, metrics, self.parts.source.state_dict())

    async def _produce(self) -> None:
        for step in range(self.start + 1, self.cfg.run.num_steps + 1):
            await self.served.at_least(step - 1 - self.lag)
            item = await self._make(step)
            await self._queue.put(item)
            if isinstance(item, DataExhausted):
                return

    async def _next_queued(self) -> Produced | DataExhausted:
        """The next queued batch, or the producer's exception if it failed before making one."""
        assert self._task is not None
        getting = asyncio.ensure_future(self._queue.get())
        await asyncio.wait({getting, self._task}, return_when=asyncio.FIRST_COMPLETED)
        if getting.done():
            return getting.result()
        getting.cancel()
        self._task.result()  # raises the producer's error
        raise RuntimeError("the rollout producer stopped without a batch for the next step")
