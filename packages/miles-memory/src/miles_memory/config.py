"""The typed config of miles-memory (torch-free, docs/architecture.md "Config"): `MemoryConfig`, a run config's
`memory` section, read by the trainer, the engine and the orchestrator; its `plan` part (`PlanSettings`, the
hardware the memory planner plans for) lives in `plan_config.py`.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from miles_memory.plan_config import PlanConfig, PlanSettings

__all__ = ["MEMORY_TAGS", "MemoryConfig", "PlanConfig", "PlanSettings"]

# What the offload manager moves, by tag: the trainer's parameters, gradients and optimizer state, the engine's
# KV cache, and the MTP draft modules (weights and optimizer state of the parameters an auxiliary loss trains).
MEMORY_TAGS = ("weights", "grads", "optimizer", "kv_cache", "mtp")


class MemoryConfig(BaseModel):
    """Offload, the allocation budget, OOM handling and communication headroom (docs/memory.md)."""

    model_config = ConfigDict(extra="forbid")

    offload_to: Literal["auto", "host", "disk"] = Field(
        default="auto", description="Where offloaded bytes wait: auto (host memory on GPU, disk on CPU), host, disk."
    )
    offload_dir: str | None = Field(
        default=None, description="Directory of disk offload files (null: the run's offload/ folder, or the temp dir)."
    )
    limit_bytes: int | None = Field(
        default=None, ge=1, description="Allocation budget per trainer rank / engine (null: the device's own memory)."
    )
    comm_headroom_bytes: int = Field(
        default=0, ge=0, description="Bytes of limit_bytes kept free for collectives' buffers (NCCL / gloo)."
    )
    partial_offload: bool = Field(
        default=False,
        description="Offload only what the next phase needs room for, largest tensors first (needs limit_bytes).",
    )
    oom_retry: bool = Field(
        default=True, description="Retry a step that hit a transient OOM with half the micro-batch token budget."
    )
    min_tokens_per_micro_batch: int = Field(
        default=64,
        ge=1,
        description="Smallest token budget an OOM retry may halve down to; below it the OOM is fatal.",
    )
    collective_timeout_s: float = Field(
        default=120.0, gt=0, description="Timeout of the trainer's process groups: a lost rank surfaces this fast."
    )
    plan: PlanSettings = Field(
        default_factory=PlanSettings,
        description="What the memory planner assumes beyond the run's own settings: the hardware, the node count.",
    )

    @model_validator(mode="after")
    def _check(self) -> MemoryConfig:
        if self.partial_offload and self.limit_bytes is None:
            raise ValueError("memory.partial_offload needs memory.limit_bytes (the budget it makes room within)")
        if self.limit_bytes is not None and self.comm_headroom_bytes >= self.limit_bytes:
            raise ValueError(
                f"memory.comm_headroom_bytes ({self.comm_headroom_bytes}) leaves nothing of memory.limit_bytes "
                f"({self.limit_bytes}); lower the headroom or raise the limit"
            )
        return self
