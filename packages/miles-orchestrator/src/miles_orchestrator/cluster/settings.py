"""What a trainer rank is built from and how many threads each actor runs, resolved from the run config the same way
on every cluster."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from miles_kernels.config import KernelConfig, WeightQuantConfig
from miles_memory.config import MemoryConfig
from miles_orchestrator.config import RunConfig
from miles_spec.config import SpecConfig
from miles_trainer.config import BackendConfig, CriticConfig, LoraTrainConfig, OptimizerConfig, PolicyLossConfig


@dataclass(frozen=True)
class TrainerSettings:
    """Everything a trainer rank is built from, resolved from the run config (the same on every cluster)."""

    kernel: KernelConfig
    optimizer: OptimizerConfig
    loss: PolicyLossConfig
    backend: BackendConfig
    offload_dir: str
    critic: CriticConfig | None = None
    spec: SpecConfig | None = None  # the draft trains online (spec.mode=online)
    eagle3_draft: str | None = None  # an EAGLE-3 draft the policy carries (spec.draft=eagle3, synced with it)
    keep_reference: bool = False  # trainer.log_kl: the initial policy stays, for the kl metric
    memory: MemoryConfig = field(default_factory=MemoryConfig)  # offload target, budget, OOM handling
    routing_replay: bool = False  # trainer.routing_replay=rollout: MoE layers route as the engine recorded
    lora: LoraTrainConfig | None = None  # trainer.lora with rank > 0: adapters train on a frozen base
    weight_quant: WeightQuantConfig | None = None  # rollout.engine.weight_dtype: weight sync sends this format
    qat: bool = False  # trainer.qat: the forward fake-quantizes to weight_quant


def trainer_settings(cfg: RunConfig, run_dir: Path) -> TrainerSettings:
    """The trainer's models from the (resolved) run config: the critic for GAE, the draft for spec.mode=online, an
    EAGLE-3 draft attached to the policy whenever the embedded engine drafts with it (frozen too: weight sync and
    the on-policy checksum cover it as they cover MTP modules; SGLang engines load theirs from spec.draft_path)."""
    critic = cfg.trainer.critic if cfg.trainer.uses_critic else None
    spec = cfg.spec if cfg.spec.mode == "online" else None
    weight_quant = cfg.rollout.engine.weight_quant()
    carries_eagle3 = cfg.spec.mode == "online" or cfg.rollout.backend != "sglang"
    eagle3 = cfg.rollout.engine.speculative_draft_model_path if carries_eagle3 else None
    return TrainerSettings(cfg.kernel, cfg.trainer.optimizer, cfg.trainer.loss, cfg.trainer.backend,
                           str(run_dir / "offload"), critic, spec, eagle3, cfg.trainer.log_kl, cfg.memory,
                           cfg.trainer.routing_replay == "rollout",
                           cfg.trainer.lora if cfg.trainer.lora.is_enabled else None,
                           weight_quant if weight_quant.is_enabled else None, cfg.trainer.qat)  # fmt: skip


def num_threads(cfg: RunConfig) -> int:
    """torch threads of the engine and of the trainer (`run.num_threads`, else the machine's CPU count)."""
    return cfg.run.num_threads or os.cpu_count() or 1
