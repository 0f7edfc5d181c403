"""The synchronous RL loop: generate → reward → filter → advantages → train → sync weights → (eval, checkpoint).

`run_sync` is the algorithm, start to finish; everything it calls lives below it or in its own module (rollout,
rewards, filters, the cluster, the run directory). It runs on one event loop and talks to a `Cluster`
(cluster.py): Ray actors or everything in this process, it does not know which. Under true on-policy
(deterministic kernels, the same `KernelConfig` on both sides) the rollout log-probs are the trainer's old
log-probs and the measured mismatch is exactly 0; in fast mode the trainer recomputes them first and the mismatch
is reported (and corrected with TIS / MIS when `trainer.loss.is_mode` is set).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

from miles_kernels import num_absent_mtp_layers, read_model_config
from miles_orchestrator.agentic import agent_rollout
from miles_orchestrator.async_loop import run_overlapped
from miles_orchestrator.cluster import Cluster, start_cluster
from miles_orchestrator.config import RunConfig, check_batch_identity
from miles_orchestrator.data import build_data_source, build_eval_samples, check_data_source
from miles_orchestrator.env_pool import resolve_env
from miles_orchestrator.evaluation import evaluate_held_out
from miles_orchestrator.filters import build_filters
from miles_orchestrator.rewards import RewardPool, check_reward
from miles_orchestrator.rollout import DataExhausted, PromptEncoder, generate_batch, resolve_rollout_fn
from miles_orchestrator.run_dir import RunDir
from miles_orchestrator.steps import LoopParts, checked_versions, send_weights, train_batch
from miles_spec import add_mtp_modules
from miles_trainer import (
    load_advantage_estimator,
    resolve_loss_fn,
)


def run_sync(cfg: RunConfig, model_dir: str, run: RunDir) -> list[dict[str, Any]]:
    """Train `cfg.run.num_steps` rollouts, continuing from the latest checkpoint in `run` if there is one."""
    asyncio.run(_run_sync(cfg, model_dir, run))
    return run.metrics.history()


async def _run_sync(cfg: RunConfig, model_dir: str, run: RunDir) -> None:
    check_batch_identity(cfg)
    model_dir = with_fresh_draft(cfg, model_dir, run)
    check_model(cfg, model_dir)
    source, eval_prompts = build_data_source(cfg.data), build_eval_samples(cfg.data)
    encode = PromptEncoder(model_dir)
    filters = build_filters(cfg.filter)
    with RewardPool.from_config(cfg.reward) as rewards, agent_rollout(cfg.rollout, encode.tokenizer) as agent:
        rollout_fn = agent or resolve_rollout_fn(cfg.rollout.rollout_fn, cfg.rollout.return_routed_experts)
        # a held-out episode plays as a training one, through the same rollout function (slime's eval function
        # defaults to its rollout function), without the routed experts only training replays
        eval_fn = agent or resolve_rollout_fn(cfg.rollout.rollout_fn)
        cluster = await start_cluster(cfg, model_dir, run.path, run.log)
        turns = Turns(cluster, is_colocated=cfg.run.colocate, is_partial=cfg.memory.partial_offload)
        try:
            await turns.measure_engine()
            start = await resume(cluster, run, source)
            await check_on_policy(cfg, cluster, version=start, log=run.log)
            await turns.engine_turn()
            if start == 0 and eval_prompts and cfg.run.eval_every:
                run.record(0, await evaluate_held_out(cfg, cluster, rewards, eval_prompts, encode, run, eval_fn))
            if cfg.run.mode != "sync":
                parts = LoopParts(source, rewards, filters, rollout_fn, encode, eval_prompts, eval_fn)
                await run_overlapped(cfg, cluster, run, start, parts, model_dir)
                return
            for step in range(start + 1, cfg.run.num_steps + 1):
                began = time.perf_counter()
                try:
                    batch, metrics = await generate_batch(
                        cfg, cluster, rewards, source, filters, rollout_fn, encode, run
                    )
                except DataExhausted as end:
                    run.log(f"stopping before step {step}: {end}")
                    async with turns.trainer_turn():
                        await cluster.save(run.checkpoint_dir(step - 1), position(step - 1, source))
                        await cluster.export(run.path / "final", model_dir)
                    break
                batch, version_metrics = checked_versions(batch, step - 1, 0, cfg, run)
                metrics |= version_metrics
                async with turns.trainer_turn():
                    metrics |= await train_batch(cfg, cluster, batch, run)
                    is_last = step == cfg.run.num_steps
                    if is_last or (cfg.run.checkpoint_every and step % cfg.run.checkpoint_every == 0):
                        await cluster.save(run.pending_checkpoint_dir(step), position(step, source))
                    if is_last:
                        await cluster.export(run.path / "final", model_dir)
                    metrics |= await sync_weights(cfg, cluster, turns, version=step, run=run)
                if eval_prompts and cfg.run.eval_every and step % cfg.run.eval_every == 0:
                    metrics |= await evaluate_held_out(cfg, cluster, rewards, eval_prompts, encode, run, eval_fn)
                metrics |= turns.memory_metrics() | cluster.fault_metrics()
                run.record(step, metrics | {"step_time_s": time.perf_counter() - began})
                run.commit_checkpoint(step)  # only now: the step's metrics line is written
        finally:
            await cluster.shutdown()


def position(step: int, source: Any) -> dict[str, Any]:
    """What a checkpoint keeps besides the trainer's state: the step and the data source's position."""
    return {"step": step, "data": source.state_dict()}


def check_plugins(cfg: RunConfig) -> None:
    """Import and check every plug-in the config names (data source, reward, rollout function, filters, loss,
    advantage; the http reward's server), so a wrong path or signature fails at start-up with the field named."""
    env = cfg.rollout.agent.env
    checks: list[tuple[str, str | None, Callable[[], object]]] = [
        ("data.source", cfg.data.source, lambda: check_data_source(cfg.data)),
        ("reward.name", cfg.reward.name, lambda: check_reward(cfg.reward)),
        ("rollout.rollout_fn", cfg.rollout.rollout_fn, lambda: resolve_rollout_fn(cfg.rollout.rollout_fn)),
        ("rollout.agent.env", env, lambda: env is not None and resolve_env(env)),
        ("filter.custom", cfg.filter.custom, lambda: build_filters(cfg.filter)),
        ("trainer.loss.loss_fn", cfg.trainer.loss.loss_fn, lambda: resolve_loss_fn(cfg.trainer.loss.loss_fn)),
        ("trainer.advantage_estimator", cfg.trainer.advantage_estimator, lambda: _check_estimator(cfg)),
    ]
    for field, value, check in checks:
        try:
            check()
        except (ValueError, TypeError) as error:
            raise ValueError(f"{field}={value!r}: {error}") from error


def check_model(cfg: RunConfig, model_dir: str) -> None:
    """What the run asks of the model's architecture: MTP modules when the engine drafts with them (spec.mode
    frozen or online; online accepts a checkpoint whose config.json declares MTP modules it holds no tensor of,
    which `with_fresh_draft` completes); MoE layers when the run records or replays routing. (Other runs read the
    model only when they load it.)"""
    if not (cfg.spec.drafts or cfg.rollout.return_routed_experts):
        return
    model = read_model_config(model_dir)
    if cfg.rollout.return_routed_experts and not model.is_moe:
        setting = (
            "trainer.routing_replay=rollout"
            if cfg.trainer.routing_replay == "rollout"
            else "rollout.return_routed_experts=true"
        )
        raise ValueError(
            f"{setting} records MoE routing, but {model_dir} is a dense {model.model_type} model; drop the setting, "
            "or use an MoE policy (e.g. model.bootstrap_architecture=qwen3_moe)"
        )
    if not cfg.spec.drafts or model.num_nextn_predict_layers:
        return
    absent = num_absent_mtp_layers(model_dir)
    if absent and cfg.spec.mode == "online":
        return  # the run starts them fresh (with_fresh_draft)
    if absent:
        raise ValueError(
            f"spec.mode=frozen drafts with the policy's MTP modules as loaded, but {model_dir} holds none: its "
            f"config.json declares {absent} (num_nextn_predict_layers) and the checkpoint has no tensor of them "
            "(transformers' save_pretrained does not write them), and an untrained draft left frozen would reject "
            "nearly every token; use spec.mode=online (fresh MTP modules, trained on the rollouts), train a draft "
            f"first (miles-spec train --model {model_dir} --data ROWS.jsonl --out DIR, then model.path=DIR), or "
            "spec.mode=off"
        )
    raise ValueError(
        f"spec.mode={cfg.spec.mode} drafts with the policy's MTP modules, but {model_dir} has none "
        "(num_nextn_predict_layers = 0 in its config.json); use a checkpoint with MTP layers (miles-spec train "
        "--num-mtp-layers 1 adds one), or spec.mode=off"
    )


FRESH_DRAFT_DIR = "model_with_draft"  # in the run directory


def with_fresh_draft(cfg: RunConfig, model_dir: str, run: RunDir) -> str:
    """The checkpoint the run loads. For spec.mode=online on a checkpoint whose config.json declares MTP modules it
    holds no tensor of (one saved by transformers: any GLM-4.5 fine-tuned with Hugging Face tooling), a copy with
    fresh ones, initialized from `run.seed` (`miles_spec.add_mtp_modules`: the trunk's files linked, not copied),
    in RUN_DIR/model_with_draft: the draft then trains from scratch on the rollouts (slime / Megatron's MTP
    training from scratch). A resumed run finds it there (its checkpoint holds the trained draft). Any other run:
    `model_dir` as it is, read here first, so that miles-kernels' warning about MTP modules left out is logged by
    this process (the engines and trainer ranks log theirs in their own logs)."""
    fresh = run.path / FRESH_DRAFT_DIR
    if Path(model_dir).resolve() == fresh.resolve():
        return model_dir
    absent = num_absent_mtp_layers(model_dir)
    if cfg.spec.mode != "online" or not absent:
        read_model_config(model_dir)
        return model_dir
    if not fresh.is_dir():
        add_mtp_modules(model_dir, fresh, absent, seed=cfg.run.seed)
        run.log(
            f"{model_dir}: config.json declares {absent} MTP module(s) the checkpoint holds no tensor of (saved by "
            f"transformers); spec.mode=online trains {absent} fresh one(s) from scratch, initialized in {fresh} "
            "(the trunk's files linked from the checkpoint)"
        )
    return str(fresh)


def _check_estimator(cfg: RunConfig) -> None:
    if ":" in cfg.trainer.advantage_estimator:
        load_advantage_estimator(cfg.trainer.advantage_estimator)


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
    return start


async def check_on_policy(cfg: RunConfig, cluster: Cluster, version: int, log: Any) -> None:
    """Sync the trainer's weights to the engine as `version`, then refuse to start unless the engine holds the
    same bits (weight checksum) and, for true on-policy, runs the same kernels (fingerprint); SGLang engines, which
    report neither, must serve `version`."""
    await cluster.sync_weights(version, cfg.run.sync_bucket_bytes)
    if cfg.rollout.backend == "sglang":  # SGLang reports neither Miles' kernel config nor a checksum of HF tensors
        served = await cluster.engine.get_weight_version()  # every engine's, or a RuntimeError naming them
        if served != version:
            raise RuntimeError(f"weight sync check failed: the SGLang engines serve weights v{served}, not v{version}")
        log(f"weights v{version} synced via {cluster.sync_method}; the SGLang engines serve v{version} (SGLang "
            "reports no checksum of HF tensors to verify the bits by)")  # fmt: skip
        return
    described = (await cluster.engine.get_server_info())["kernel_config"]
    fingerprint = described["fingerprint"]
    if cfg.kernel.is_deterministic and fingerprint != cluster.trainer_fingerprint:
        raise RuntimeError(
            f"true on-policy refused: the engine runs kernel config {described} (fingerprint {fingerprint}), the "
            f"trainer {cluster.trainer_fingerprint}; give both the same KernelConfig (dtype, mode, tile and page "
            "sizes), the same torch version and the same kind of device"
        )
    engine_checksum, checksum = await cluster.engine.weights_checksum(), await cluster.trainer_checksum()
    if engine_checksum != checksum:
        raise RuntimeError(
            f"weight sync check failed: the engine holds {engine_checksum[:16]}, the trainer sent {checksum[:16]} "
            f"(version {version})"
        )
    log(f"weights v{version} synced via {cluster.sync_method} and verified (checksum {checksum[:12]}), kernels "
        f"{fingerprint}")  # fmt: skip


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


async def sync_weights(cfg: RunConfig, cluster: Cluster, turns: Turns, version: int, run: RunDir) -> dict[str, float]:
    """The engine takes its memory back and receives the trainer's weights as `version`."""
    began = time.perf_counter()
    await turns.resume_engine()
    synced = await send_weights(cfg, cluster, version, run)
    return synced | {"sync_time_s": time.perf_counter() - began}
