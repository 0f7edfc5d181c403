"""Overlapped rollout and training: `run.mode=one_step_off` and `run.mode=async` (docs/scale-out.md).

A producer task generates the batches of steps start+1, start+2, ... (`generate_batch`, the same rollout, rewards
and filters as a sync run) into a queue while the trainer loop trains them in order. The batch of step s is
trained by the weights of version s - 1; the producer starts it once the engines serve version s - 1 - lag or
newer, so no token lags the trained version by more than `lag`:

- one_step_off (lag 1): the rollout of step s + 1 overlaps the training of step s; the weight sync after step s
  waits for that rollout to finish, so no generation spans a sync and every sample after the first is exactly one
  version old;
- async (lag `run.max_staleness`): the weight sync happens as soon as a step is trained, pausing the generations in
  flight (`rollout.pause_mode`): retract continues them under the new weights (the engine recomputes their KV),
  abort ends them and partial.py continues or regenerates them. Tokens keep the versions that generated them.

Before training, `staleness.bound_staleness` drops any group staler than the bound (counted in the metrics, never
trained on silently) and reports the staleness histogram. The behaviour policy's log-probs are the rollout's, per
token; π_old is the trainer's recomputation at the trained version (`loop.train`); TIS / MIS
(`trainer.loss.is_mode`) corrects between the two; the mismatch metric covers the tokens the trained version
generated, exactly 0 under true on-policy.

A checkpoint saves the data position recorded with the batch it follows, so a resumed run regenerates the batches
after it: no prompt lost, none trained twice.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from dataclasses import dataclass
from typing import Any

from miles_contracts import Sample
from miles_orchestrator.cluster import Cluster
from miles_orchestrator.config import RunConfig
from miles_orchestrator.evaluation import evaluate_held_out
from miles_orchestrator.partial import aborted_policy
from miles_orchestrator.rollout import DataExhausted, generate_batch
from miles_orchestrator.run_dir import RunDir
from miles_orchestrator.steps import LoopParts, checked_versions, send_weights, train_batch


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
    """How many versions a token may lag the trained one."""
    return 1 if cfg.run.mode == "one_step_off" else cfg.run.max_staleness


async def run_overlapped(
    cfg: RunConfig, cluster: Cluster, run: RunDir, start: int, parts: LoopParts, model_dir: str
) -> None:
    """Steps start+1 .. run.num_steps with rollout and training overlapped (see the module docstring), from the
    run's components (`LoopParts`: data source, rewards, filters, rollout function, encoder, held-out prompts)."""
    served, bound = Served(start), lag(cfg)
    queue: asyncio.Queue[Produced | DataExhausted] = asyncio.Queue()
    generating = asyncio.Lock()  # held while a batch is generated; one_step_off's sync waits for it
    is_default_fn = cfg.rollout.rollout_fn is None and cfg.rollout.agent.env is None
    aborted = aborted_policy(cfg.run.mode, cfg.rollout.pause_mode, cfg.rollout.partial_rollout, is_default_fn)

    async def produce() -> None:
        for step in range(start + 1, cfg.run.num_steps + 1):
            await served.at_least(step - 1 - bound)
            async with generating:
                try:
                    batch, metrics = await generate_batch(
                        cfg, cluster, parts.rewards, parts.source, parts.filters, parts.rollout_fn, parts.encode, run,
                        aborted,
                    )  # fmt: skip
                except DataExhausted as end:
                    await queue.put(end)
                    return
            await queue.put(Produced(step, batch, metrics, parts.source.state_dict()))

    producer = asyncio.create_task(produce(), name="miles-rollout-producer")
    last_position = parts.source.state_dict()
    finished = time.perf_counter()
    try:
        for step in range(start + 1, cfg.run.num_steps + 1):
            waited = time.perf_counter()
            item = await next_batch(queue, producer)
            wait_s = time.perf_counter() - waited
            if isinstance(item, DataExhausted):
                run.log(f"stopping before step {step}: {item}")
                await cluster.save(run.checkpoint_dir(step - 1), {"step": step - 1, "data": last_position})
                await cluster.export(run.path / "final", model_dir)
                break
            assert item.step == step, (item.step, step)
            metrics = item.metrics | {"rollout_wait_s": wait_s}
            batch, version_metrics = checked_versions(item.batch, step - 1, bound, cfg, run)
            metrics |= version_metrics
            metrics |= await train_batch(cfg, cluster, batch, run, trained_version=step - 1)
            is_last = step == cfg.run.num_steps
            position = {"step": step, "data": item.position}
            if is_last or (cfg.run.checkpoint_every and step % cfg.run.checkpoint_every == 0):
                await cluster.save(run.pending_checkpoint_dir(step), position)
            if is_last:
                await cluster.export(run.path / "final", model_dir)
            metrics |= await sync_during_rollout(cfg, cluster, run, step, generating)
            await served.set(step)
            last_position = item.position
            if parts.eval_prompts and cfg.run.eval_every and step % cfg.run.eval_every == 0:
                metrics |= await evaluate_held_out(
                    cfg, cluster, parts.rewards, parts.eval_prompts, parts.encode, run, parts.eval_fn
                )
            now = time.perf_counter()
            run.record(step, metrics | cluster.fault_metrics() | {"step_time_s": now - finished})
            finished = now
            run.commit_checkpoint(step)
    finally:
        producer.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await producer


async def next_batch(
    queue: asyncio.Queue[Produced | DataExhausted], producer: asyncio.Task[None]
) -> Produced | DataExhausted:
    """The next batch, or the producer's exception if it failed before making one."""
    getting = asyncio.ensure_future(queue.get())
    await asyncio.wait({getting, producer}, return_when=asyncio.FIRST_COMPLETED)
    if getting.done():
        return getting.result()
    getting.cancel()
    producer.result()  # raises the producer's error
    raise RuntimeError("the rollout producer stopped without a batch for the next step")


async def sync_during_rollout(
    cfg: RunConfig, cluster: Cluster, run: RunDir, version: int, generating: asyncio.Lock
) -> dict[str, float]:
    """The trained weights to every engine as `version`. one_step_off: once the rollout in flight finished. async:
    at once, the generations in flight paused (`rollout.pause_mode`) and continued after."""
    began = time.perf_counter()
    if cfg.run.mode == "one_step_off":
        async with generating:
            waited = time.perf_counter() - began
            synced = await send_weights(cfg, cluster, version, run)
        return synced | {"sync_wait_s": waited}
    num_paused = await cluster.engine.pause_generation(cfg.rollout.pause_mode)
    try:
        synced = await send_weights(cfg, cluster, version, run)
    finally:
        await cluster.engine.continue_generation()
    paused = num_paused if isinstance(num_paused, int) else int(num_paused.get("num_paused_requests", 0))
    return synced | {"num_paused_requests": float(paused), "sync_wait_s": 0.0}
