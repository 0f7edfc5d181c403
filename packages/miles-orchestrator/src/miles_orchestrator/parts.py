"""`RunParts`: the components every step of a run uses — data source, rewards, filters, rollout function, prompt
encoder, held-out prompts and their rollout function, the distillation teacher — built once at start-up by
`open_parts` (which also owns the reward and environment workers and an embedded teacher: they stop when it
exits)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from miles_contracts import RolloutFn, Sample
from miles_orchestrator.config import RunConfig
from miles_orchestrator.data.sources import build_data_source, build_eval_samples
from miles_orchestrator.opd import Teacher, open_teacher
from miles_orchestrator.reward.pool import RewardPool
from miles_orchestrator.rollout.agentic import agent_rollout
from miles_orchestrator.rollout.batch import PromptEncoder
from miles_orchestrator.rollout.filters import build_filters
from miles_orchestrator.rollout.single_turn import resolve_rollout_fn
from miles_orchestrator.throughput import ThroughputMeter


@dataclass(frozen=True)
class RunParts:
    """The components a run's steps use, built once at start-up."""

    source: Any  # the data source (miles_contracts.DataSource)
    rewards: RewardPool
    filters: Any  # the dynamic-sampling filters (filters.build_filters), or None
    rollout_fn: RolloutFn
    encode: PromptEncoder
    eval_prompts: list[Sample]
    eval_fn: RolloutFn  # the rollout function of held-out evaluation
    teacher: Teacher | None = None  # on-policy distillation's teacher (the opd section), or None
    throughput: ThroughputMeter | None = None  # the policy's model FLOPs: each phase's TFLOP/s and MFU


@contextlib.contextmanager
def open_parts(cfg: RunConfig, model_dir: str, log: Any = print) -> Iterator[RunParts]:
    """The run's parts; the reward workers, the agentic environments and an embedded teacher stop on exit."""
    source, eval_prompts = build_data_source(cfg.data), build_eval_samples(cfg.data)
    encode = PromptEncoder(model_dir)
    filters = build_filters(cfg.filter)
    with (
        RewardPool.from_config(cfg.reward, cfg.kernel) as rewards,
        agent_rollout(cfg.rollout, encode.tokenizer) as agent,
        open_teacher(cfg, model_dir, encode.tokenizer, log) as teacher,
    ):
        yield RunParts(
            source=source,
            rewards=rewards,
            filters=filters,
            rollout_fn=agent or resolve_rollout_fn(cfg.rollout.rollout_fn, cfg.rollout.return_routed_experts),
            encode=encode,
            eval_prompts=eval_prompts,
            # a held-out episode plays as a training one, through the same rollout function (slime's eval
            # function defaults to its rollout function), without the routed experts only training replays
            eval_fn=agent or resolve_rollout_fn(cfg.rollout.rollout_fn),
            teacher=teacher,
            throughput=throughput_meter(cfg, model_dir, log),
        )


def throughput_meter(cfg: RunConfig, model_dir: str, log: Any = print) -> ThroughputMeter:
    """The run's FLOPs meter: the training devices are the trainer ranks; the rollout's, the engines' (the ranks'
    when colocated); MFU against the hardware profile of the device the run uses (none on a CPU, or a GPU the
    profiles do not know: then TFLOP/s only)."""
    from miles_orchestrator.memory_check import run_hardware

    try:
        hardware: str | None = run_hardware(cfg)
    except ValueError as unknown:
        log(f"no MFU in the metrics: {unknown}")
        hardware = None
    num_ranks = cfg.trainer.num_ranks
    rollout_devices = num_ranks if cfg.run.colocate else cfg.rollout.num_engines
    return ThroughputMeter.from_model_dir(model_dir, hardware, num_ranks, num_rollout_devices=rollout_devices,
                                          include_mtp=cfg.spec.drafts and cfg.spec.draft == "mtp")  # fmt: skip
