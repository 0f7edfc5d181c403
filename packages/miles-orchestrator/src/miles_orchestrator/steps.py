"""The phases of one RL step after its rollout (loop.py): the weight-version check of a batch, advantages (group
estimators or PPO's GAE), the optimizer steps, and publishing the new weights to the engines (docs/architecture.md,
"The RL data path", steps 5-7).
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

import torch

from miles_contracts import Sample
from miles_orchestrator.cluster import Cluster, CriticTargets
from miles_orchestrator.config import RunConfig
from miles_orchestrator.opd import opd_advantages
from miles_orchestrator.rollout_dump import RolloutDump
from miles_orchestrator.run_dir import RunDir
from miles_orchestrator.staleness import bound_staleness, has_off_policy_tokens, onpolicy_mismatch
from miles_orchestrator.throughput import ThroughputMeter
from miles_orchestrator.turns import Turns
from miles_trainer import (
    compute_advantages,
    estimator_kwargs,
    explained_variance,
    gae_advantages,
    outcome_token_rewards,
)


def checked_versions(
    batch: list[Sample], trained_version: int, max_staleness: int, cfg: RunConfig, run: RunDir
) -> tuple[list[Sample], dict[str, float]]:
    """The batch without the groups staler than `max_staleness` (staleness.py; logged), and its version metrics."""
    kept, metrics, dropped = bound_staleness(
        batch, trained_version, max_staleness, mask_partial=cfg.rollout.partial_tokens == "mask"
    )
    if dropped:
        run.log(f"{len(dropped)} prompt group(s) not trained: tokens more than {max_staleness} weight version(s) "
                f"older than the trained version {trained_version} (groups {dropped[:8]})")  # fmt: skip
    if not kept:
        raise RuntimeError(f"every sample of the batch is staler than {max_staleness} version(s); see run.log")
    return kept, metrics


@dataclass(frozen=True)
class PreparedBatch:
    """A batch ready for the optimizer steps: the advantages it trains with (after on-policy distillation's KL
    term), π_old where the trainer recomputed it (fast mode, or tokens of another weight version; else the rollout's
    log-probs are π_old), PPO's critic targets, and the metrics of getting there."""

    samples: list[Sample]
    advantages: list[list[float]]
    old_logprobs: list[list[float]] | None
    critic: CriticTargets | None
    is_off_policy: bool
    metrics: dict[str, float]
    recompute_s: float = 0.0


async def train_batch(
    cfg: RunConfig, cluster: Cluster, batch: list[Sample], run: RunDir, trained_version: int | None = None,
    dump: RolloutDump | None = None, step: int = 0, throughput: ThroughputMeter | None = None,
) -> dict[str, float]:  # fmt: skip
    """`prepare_batch`, then `train`; with `dump` (run.save_rollouts), the prepared batch is saved before the
    optimizer steps and the trainer's weight digests after them; with `throughput`, the training's model TFLOP/s
    (and MFU)."""
    prepared = await prepare_batch(cfg, cluster, batch, trained_version)
    dump = dump if dump is not None and dump.wants(step) else None
    saving = time.perf_counter()
    if dump is not None:
        dump.write_batch(step, batch, prepared.advantages, prepared.old_logprobs, trained_version)
    saved_s = time.perf_counter() - saving
    metrics = prepared.metrics | await train(cfg, cluster, prepared, run)
    if throughput is not None:  # one forward and backward pass over the batch, after π_old's forward if recomputed
        num_forwards = int(prepared.old_logprobs is not None)
        metrics |= throughput.train([s.num_tokens for s in batch], metrics["train_time_s"], num_forwards=num_forwards)
    if dump is not None:
        saving = time.perf_counter()
        dump.write_outcome(step, metrics, await cluster.trainer_digests())
        metrics["save_rollouts_s"] = saved_s + time.perf_counter() - saving  # the batch's file and the digests
    return metrics


async def prepare_batch(
    cfg: RunConfig, cluster: Cluster, batch: list[Sample], trained_version: int | None = None
) -> PreparedBatch:
    """Advantages (group estimators, or PPO's GAE on the critic's values of this batch) and π_old: in fast mode the
    trainer recomputes it first; `trained_version` (overlapped runs) is the version of the trainer's weights, and
    when some tokens come from another one, π_old is the trainer's recomputation at this version (whatever the
    kernels) and the mismatch metric covers the tokens this version generated only (staleness.onpolicy_mismatch).
    With on-policy distillation, the advantages then take the reverse KL to the teacher (opd.py) on the student's
    log-probs (the recomputed ones where they are not the rollout's)."""
    critic, metrics = None, dict[str, float]()
    if cfg.trainer.uses_critic:
        advantages, critic, metrics = gae_targets(cfg, batch, await cluster.compute_values(batch))
    else:
        advantages = group_advantages(cfg, batch)
    began = time.perf_counter()
    off_policy = trained_version is not None and has_off_policy_tokens(batch, trained_version)
    recompute = off_policy or not cfg.is_true_on_policy
    old_logprobs = await cluster.compute_logprobs(batch) if recompute else None
    recompute_s = time.perf_counter() - began
    if off_policy:
        assert old_logprobs is not None and trained_version is not None
        metrics |= onpolicy_mismatch(batch, old_logprobs, trained_version)
    if cfg.opd.is_enabled:  # on-policy distillation: the reverse KL to the teacher enters the advantages (opd.py)
        student = old_logprobs if old_logprobs is not None else [s.rollout_logprobs or [] for s in batch]
        kl_coef = 0.0 if cfg.opd.top_k else cfg.opd.kl_coef  # top-k: the trainer's loss term (opd_topk_coef) instead
        advantages, opd_metrics = opd_advantages(advantages, batch, student, kl_coef, cfg.opd.task_reward)
        metrics |= opd_metrics
    return PreparedBatch(batch, advantages, old_logprobs, critic, off_policy, metrics, recompute_s)


def loss_masks(batch: list[Sample]) -> torch.Tensor:
    """The samples' loss masks (tool output and other untrained tokens are 0), right-padded: (N, T) float32."""
    width = max(len(s.response_tokens) for s in batch)
    rows = [mask + [0] * (width - len(mask)) for mask in (s.effective_loss_mask() for s in batch)]
    return torch.tensor(rows, dtype=torch.float32).reshape(len(batch), width)  # one tensor call, not one per sample


def group_advantages(cfg: RunConfig, batch: list[Sample]) -> list[list[float]]:
    """Per-token advantages from the configured outcome estimator, groups by prompt. Token-level estimators
    (REINFORCE++) see the loss masks: untrained tokens neither carry a return nor join the whitening."""
    rewards = torch.tensor([s.reward or 0.0 for s in batch], dtype=torch.float32)
    groups = torch.tensor([s.group_index for s in batch])
    name = cfg.trainer.advantage_estimator
    adv = compute_advantages(name, rewards, groups, loss_masks(batch), **estimator_kwargs(name, cfg.trainer.advantage))
    return [row[: len(s.response_tokens)] for row, s in zip(adv.tolist(), batch, strict=True)]


def gae_targets(
    cfg: RunConfig, batch: list[Sample], values: list[list[float]]
) -> tuple[list[list[float]], CriticTargets, dict[str, float]]:
    """PPO: GAE advantages and returns from each sample's outcome reward (on its last trained token) and the
    critic's values, and the critic's metrics over the batch's trained tokens (explained variance, value and
    return means)."""
    mask = loss_masks(batch)
    width = mask.shape[1]
    rewards = torch.tensor([s.reward or 0.0 for s in batch], dtype=torch.float64)
    values_NT = torch.tensor([row + [0.0] * (width - len(row)) for row in values], dtype=torch.float64)
    token_rewards = outcome_token_rewards(rewards, mask)
    knobs = cfg.trainer.advantage
    adv, returns = gae_advantages(
        token_rewards, values_NT, mask, gamma=knobs.gamma, lam=knobs.lam, whiten=knobs.whiten
    )
    is_valid = mask > 0
    metrics = {
        "critic_explained_variance": explained_variance(values_NT[is_valid], returns[is_valid]),
        "critic_value_mean": float(values_NT[is_valid].mean()),
        "critic_return_mean": float(returns[is_valid].mean()),
    }
    lengths = [len(s.response_tokens) for s in batch]
    per_sample = [adv[i, :n].tolist() for i, n in enumerate(lengths)]
    return per_sample, CriticTargets([returns[i, :n].tolist() for i, n in enumerate(lengths)], values), metrics


async def train(cfg: RunConfig, cluster: Cluster, prepared: PreparedBatch, run: RunDir) -> dict[str, float]:
    """`trainer.steps_per_rollout` optimizer steps on a prepared batch; with its critic targets, each step trains
    PPO's critic on its part of the batch too. `train_time_s` includes π_old's recomputation."""
    began = time.perf_counter()
    metrics: dict[str, float] = {}
    batch, advantages = prepared.samples, prepared.advantages
    size = len(batch) // cfg.trainer.steps_per_rollout
    with run.progress("train", cfg.trainer.steps_per_rollout) as advance:
        for k in range(cfg.trainer.steps_per_rollout):
            part = slice(k * size, (k + 1) * size)
            old = None if prepared.old_logprobs is None else prepared.old_logprobs[part]
            targets = None if prepared.critic is None else prepared.critic.part(part)
            step_metrics = batch_keys(
                await cluster.train(batch[part], advantages[part], old, measure=k == 0 and not prepared.is_off_policy,
                                    critic=targets)
            )  # fmt: skip
            # the mismatch is defined under the rollout weights: keep the first step's measurement
            metrics |= {key: v for key, v in step_metrics.items() if k == 0 or "logprob_abs_diff" not in key}
            advance()
    return metrics | {"train_time_s": time.perf_counter() - began + prepared.recompute_s}


def batch_keys(train_metrics: dict[str, float]) -> dict[str, float]:
    """The trainer's reward statistics are over the batch it trained on (after filtering): `batch_reward_*`, so
    they never overwrite the rollout's `reward_mean` (every generated sample)."""
    return {f"batch_{key}" if key.startswith("reward_") else key: v for key, v in train_metrics.items()}


async def publish_weights(
    cfg: RunConfig, cluster: Cluster, run: RunDir, version: int, turns: Turns, generating: asyncio.Lock
) -> dict[str, float]:
    """The trainer's weights to every engine as `version`, after each optimizer step. sync: once the engine has its
    memory back (colocated). one_step_off: once the rollout in flight (holding `generating`) finished, so no
    generation spans a sync. async: at once, the generations in flight paused (`rollout.pause_mode`) and continued
    after. `sync_time_s` is the transfer's time (in sync runs with the engine's resume before it); overlapped runs
    add the wait before it (`sync_wait_s`)."""
    mode = cfg.run.mode
    if mode == "sync":
        began = time.perf_counter()
        await turns.resume_engine()
        return await _send_weights(cfg, cluster, run, version, began)
    if mode == "one_step_off":
        began = time.perf_counter()
        async with generating:
            waited = time.perf_counter() - began
            return await _send_weights(cfg, cluster, run, version) | {"sync_wait_s": waited}
    num_paused = await cluster.engine.pause_generation(cfg.rollout.pause_mode)
    try:
        synced = await _send_weights(cfg, cluster, run, version)
    finally:
        await cluster.engine.continue_generation()
    paused = num_paused if isinstance(num_paused, int) else int(num_paused.get("num_paused_requests", 0))
    return synced | {"num_paused_requests": float(paused), "sync_wait_s": 0.0}


async def _send_weights(
    cfg: RunConfig, cluster: Cluster, run: RunDir, version: int, began: float | None = None
) -> dict[str, float]:
    """`cluster.sync_weights` with progress; `sync_time_s` from `began` (default: now)."""
    began = time.perf_counter() if began is None else began
    with run.progress("weight sync", 1) as advance:
        sync = await cluster.sync_weights(version, cfg.run.sync_bucket_bytes)
        advance()
    return {"sync_time_s": time.perf_counter() - began, "sync_bytes": float(sync["num_bytes"]),
            "weight_version": float(version)}  # fmt: skip
