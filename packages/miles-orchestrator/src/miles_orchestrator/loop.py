"""The RL loop: rollout → reward → filter → advantages → train → checkpoint → publish weights → evaluate → record.

`run_training` is the algorithm, start to finish, for every `run.mode`: the rollout side is a `Producer`
(producer.py: inline in sync runs, a task ahead of training by up to `lag` weight versions in one_step_off and async
ones), and every step goes through the one tail below. Everything it calls lives in its own module (parts,
preflight, steps, turns, the cluster, the run directory). It runs on one event loop and talks to a `Cluster`
(cluster/protocol.py): Ray actors or everything in this process, it does not know which. Under true on-policy
(deterministic kernels, the same `KernelConfig` on both sides) the rollout log-probs are the trainer's old
log-probs and the measured mismatch is exactly 0; in fast mode the trainer recomputes them first and the mismatch
is reported (and corrected with TIS / MIS when `trainer.loss.is_mode` is set).
"""

from __future__ import annotations

import asyncio
import gc
import time
from typing import Any

from miles_orchestrator.cluster import Cluster, start_cluster
from miles_orchestrator.config import RunConfig, check_batch_identity
from miles_orchestrator.evaluation import evaluate_held_out, evaluate_teacher
from miles_orchestrator.parts import open_parts
from miles_orchestrator.preflight import check_model, check_on_policy, with_fresh_draft, with_fresh_eagle3
from miles_orchestrator.producer import Produced, Producer
from miles_orchestrator.profiles import StepProfiler
from miles_orchestrator.rollout.batch import DataExhausted
from miles_orchestrator.rollout_dump import RolloutDump
from miles_orchestrator.run_dir import RunDir
from miles_orchestrator.steps import checked_versions, publish_weights, train_batch
from miles_orchestrator.timeline import CURRENT_STEP
from miles_orchestrator.turns import Turns


def run_training(cfg: RunConfig, model_dir: str, run: RunDir) -> list[dict[str, Any]]:
    """Train `cfg.run.num_steps` rollouts, continuing from the latest checkpoint in `run` if there is one; the
    metric lines."""
    asyncio.run(_run_training(cfg, model_dir, run))
    return run.metrics.history()


async def _run_training(cfg: RunConfig, model_dir: str, run: RunDir) -> None:
    check_batch_identity(cfg)
    model_dir = with_fresh_draft(cfg, model_dir, run)
    with_fresh_eagle3(cfg, model_dir, run)
    check_model(cfg, model_dir)
    with open_parts(cfg, model_dir, run.log) as parts:
        cluster = await start_cluster(cfg, model_dir, run.path, run.log)
        turns = Turns(cluster, is_colocated=cfg.run.colocate, is_partial=cfg.memory.partial_offload)
        try:
            await turns.measure_engine()
            start = await resume(cluster, run, parts.source)
            await check_on_policy(cfg, cluster, version=start, log=run.log)
            await turns.engine_turn()
            if start == 0 and parts.eval_prompts and cfg.run.eval_every:
                run.record(0, await evaluate_held_out(cfg, parts, cluster.engine, run) | await evaluate_teacher(
                    cfg, parts, run))  # fmt: skip
            last_position = parts.source.state_dict()  # the data position the next checkpoint follows
            finished = time.perf_counter()
            dump = open_dump(cfg, run)
            profiler = StepProfiler(cfg, cluster, run)
            # What start-up made (modules, models, tokenizers, the data) outlives the run: out of the collector's
            # scans from here, so a full collection walks what the steps made, not every object of the process (a
            # pause of a fraction of a second on a small CPU, now and then), as SGLang freezes its scheduler's
            # start-up. Unfrozen when the run ends, so a process that runs again can collect them.
            gc.freeze()
            async with Producer(cfg, cluster, run, parts, start) as producer:
                for step in range(start + 1, cfg.run.num_steps + 1):
                    async with profiler.step(step):
                        item = await producer.next(step)
                        if isinstance(item, DataExhausted):
                            run.log(f"stopping before step {step}: {item}")
                            async with turns.trainer_turn():
                                await cluster.save(run.checkpoint_dir(step - 1),
                                                   {"step": step - 1, "data": last_position})  # fmt: skip
                                await cluster.export(run.path / "final", model_dir)
                            break
                        metrics = await train_step(cfg, cluster, run, item, turns, producer, model_dir, dump)
                        last_position = item.position
                        if parts.eval_prompts and cfg.run.eval_every and step % cfg.run.eval_every == 0:
                            with run.timeline.span("eval", step):
                                metrics |= await evaluate_held_out(cfg, parts, cluster.engine, run)
                        metrics |= turns.memory_metrics() | cluster.fault_metrics()
                        now = time.perf_counter()
                        run.record(step, metrics | {"step_time_s": now - finished})
                        finished = now
                        run.commit_checkpoint(step)  # only now: the step's metrics line is written
        finally:
            gc.unfreeze()
            await cluster.shutdown()


async def train_step(
    cfg: RunConfig, cluster: Cluster, run: RunDir, item: Produced, turns: Turns, producer: Producer, model_dir: str,
    dump: RolloutDump | None = None,
) -> dict[str, float]:  # fmt: skip
    """One step's batch through the trainer's turn: version check, train (the batch saved to `dump` first, with
    run.save_rollouts), checkpoint (and the final export), then the new weights to the engines; the step's metrics
    so far."""
    step = item.step
    CURRENT_STEP.set(step)
    batch, version_metrics = checked_versions(item.batch, step - 1, producer.lag, cfg, run)
    metrics = item.metrics | version_metrics
    async with turns.trainer_turn():
        with run.timeline.span("train"):
            metrics |= await train_batch(cfg, cluster, batch, run, trained_version=step - 1, dump=dump, step=step,
                                         throughput=producer.parts.throughput)  # fmt: skip
        is_last = step == cfg.run.num_steps
        with run.timeline.span("checkpoint"):
            if is_last or (cfg.run.checkpoint_every and step % cfg.run.checkpoint_every == 0):
                await cluster.save(run.pending_checkpoint_dir(step), {"step": step, "data": item.position})
            if is_last:
                await cluster.export(run.path / "final", model_dir)
        with run.timeline.span("sync"):
            metrics |= await publish_weights(cfg, cluster, run, step, turns, producer.generating)
    await producer.published(step)
    return metrics


def open_dump(cfg: RunConfig, run: RunDir) -> RolloutDump | None:
    """Where run.save_rollouts writes each trained batch (None when it is off)."""
    if not cfg.run.save_rollouts:
        return None
    return RolloutDump(run.path, cfg.run.save_rollouts_every, cfg.run.save_rollouts_max_bytes, run.log)


async def resume(cluster: Cluster, run: RunDir, source: Any) -> int:
    """Load the latest checkpoint (trainer state, data position), once its files match its sha256 manifest, and
    drop metrics logged after it (and a torn last line); the step."""
    checkpoint = run.latest_checkpoint()
    start = 0
    if checkpoint is not None:
        run.verify_checkpoint(checkpoint)  # before any of it is unpickled
        state = await cluster.load(checkpoint)
        start = int(state["step"])
        source.load_state_dict(state["data"])
        run.log(f"resuming from {checkpoint} (step {start})")
    run.metrics.truncate_after(start)
    run.timeline.truncate_after(start)
    return start
