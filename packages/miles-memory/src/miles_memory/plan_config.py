"""What the memory planner assumes about a run (torch-free).

The run config itself says what runs (model, dtype, token budget, colocation, critic, reference, MTP) and with
which parallel layout (`trainer.backend.name` and `trainer.backend.megatron.*`, `rollout.backend` and
`rollout.sglang.*`); its `memory.plan` section (`PlanSettings`) says only what the planner alone needs: the
hardware profile, the node count and a few assumptions about deployments Miles does not configure itself
(docs/memory-planner.md). `PlanConfig` is the planner's whole input layout: those settings plus the layout read
from the run's own sections (`planner.read_run`). Parallel dims follow Megatron-core's names: attention layers use
TP x CP x DP x PP = GPUs, expert layers ETP x EP x EDP x PP = GPUs ("MoE parallel folding",
megatron/core/transformer/moe/README.md).
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

__all__ = ["PlanConfig", "PlanSettings"]


class PlanSettings(BaseModel):
    """A run config's `memory.plan`: the hardware a run is planned for and the planner's own assumptions; the parallel
    layout is the run's (`trainer.backend`, `rollout.sglang`; docs/memory-planner.md)."""

    model_config = ConfigDict(extra="forbid")

    hardware: str | None = Field(
        default=None,
        description="Hardware profile to plan for: h100, h200, b200, gb300 or cpu (null: the run's device).",
    )
    nodes: int = Field(default=1, ge=1, description="Nodes of the hardware profile's GPUs per node (cpu: 1).")
    model: str | None = Field(
        default=None,
        description="Model profile (e.g. Qwen3-30B-A3B) when model.path is neither a local directory with a "
        "config.json nor a known Hugging Face id; null: from model.path.",
    )
    distributed_optimizer: bool = Field(
        default=True, description="megatron: shard fp32 master weights and Adam moments over data parallel ranks."
    )
    cpu_adam: bool = Field(
        default=False,
        description="megatron: plan megatron-core's optimizer CPU offload (fp32 masters and Adam moments in host "
        "memory), which Miles' Megatron backend does not run; the plan checks host memory per node. FSDP2's host "
        "optimizer is the run's own trainer.optimizer.offload.",
    )
    sequence_length: int | None = Field(
        default=None,
        ge=1,
        description="Tokens per trained sequence (prompt + response), for the attention term of deterministic "
        "kernels, which grows with it; null: 64 + rollout.max_new_tokens.",
    )
    rollout_gpus: int | None = Field(
        default=None,
        ge=1,
        description="Not colocated (run.colocate=false): GPUs given to the engines, the rest train; null: half.",
    )
    cuda_graph_max_bs: int = Field(
        default=256, ge=0, description="sglang: largest decode batch captured in a CUDA graph (0: no graphs)."
    )
    kv_cache_dtype: Literal["auto", "bfloat16", "float16", "float32", "fp8"] = Field(
        default="auto", description="sglang: KV cache dtype (auto: the rollout dtype)."
    )


class PlanConfig(PlanSettings):
    """The planner's input layout: `PlanSettings` plus the parallel layout, which `read_run` takes from the run's own
    sections (the key each field comes from is in `planner.LAYOUT_KEYS`); the levers re-plan with changed copies."""

    trainer_backend: Literal["fsdp2", "megatron"] = Field(
        default="fsdp2", description="The trainer backend the layout is for: fsdp2 (Miles' own) or megatron."
    )
    tp: int = Field(default=1, ge=1, description="Tensor parallel size (megatron; with sequence parallelism).")
    pp: int = Field(default=1, ge=1, description="Pipeline parallel size (megatron; 1F1B schedule).")
    ep: int = Field(default=1, ge=1, description="Expert parallel size: the routed experts are split over ep ranks.")
    etp: int = Field(default=1, ge=1, description="Expert tensor parallel size: each expert's weights split over etp.")
    cp: int = Field(default=1, ge=1, description="Context parallel size: each sequence is split over cp ranks.")
    recompute: Literal["none", "selective", "full"] | None = Field(
        default=None,
        description="Activation recompute: none, selective (core attention only), full (each layer's input kept); "
        "null: full when trainer.backend.activation_checkpointing, else none.",
    )
    optimizer_offload: Literal["none", "moments", "moments_and_master"] = Field(
        default="none",
        description="fsdp2: the policy's AdamW state in host memory (trainer.optimizer.offload): none, moments, or "
        "moments_and_master (the fp32 shards and gradients too).",
    )
    moments_dtype: Literal["float32", "bfloat16"] = Field(
        default="float32", description="fsdp2 with optimizer_offload: the host moments' dtype."
    )
    rollout_engine: Literal["embedded", "sglang"] = Field(
        default="embedded", description="The rollout engine: embedded (miles-rollout) or sglang."
    )
    rollout_tp: int = Field(default=1, ge=1, description="sglang: tensor parallel size of one engine.")
    rollout_ep: int = Field(default=1, ge=1, description="sglang: expert parallel size of one engine (<= rollout_tp).")
    mem_fraction_static: float = Field(
        default=0.8,
        gt=0,
        lt=1,
        description="sglang: fraction of GPU memory for weights + KV cache pool (SGLang's --mem-fraction-static).",
    )
