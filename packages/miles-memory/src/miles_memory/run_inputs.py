"""What the memory planner reads from a run config (docs/memory-planner.md, "What it reads"): `RunInputs`, the run
keys each input comes from with the run config's default (`RUN_KEYS`, `LAYOUT_KEYS`), and `read_run`, which resolves
them from a run config dict (the orchestrator's resolved config, or a YAML file's: `load_run_config`). Torch-free, and
never through the orchestrator: the config is a plain dict."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ConfigDict, ValidationError

from miles_memory.low_precision import WEIGHT_FORMATS, WeightQuantSettings
from miles_memory.model_shape import LoraSettings
from miles_memory.plan_config import PlanConfig, PlanSettings

__all__ = ["LAYOUT_KEYS", "RUN_KEYS", "RunInputs", "load_run_config", "read_run"]


class RunInputs(BaseModel):
    """What the planner reads from a run config, resolved (docs/memory-planner.md, "What it reads")."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    model_path: str | None = None
    dtype: str = "float32"
    tokens: int = 4096
    recompute: str = "none"
    num_ranks: int = 1
    keep_reference: bool = False
    critic: str | None = None
    spec_mode: str = "off"
    num_kv_pages: int = 1024
    page_size: int = 16
    max_running_requests: int = 64
    max_prefill_tokens: int = 2048
    max_new_tokens: int = 16
    is_deterministic: bool = True
    query_tile: int = 4
    sequence_length: int | None = None
    colocate: bool = True
    offload_to: str = "auto"
    limit_bytes: int | None = None
    comm_headroom_bytes: int = 0
    lora: LoraSettings | None = None  # trainer.lora with rank > 0
    weight_quant: WeightQuantSettings | None = None  # rollout.engine.weight_dtype other than kernel
    qat: bool = False  # trainer.qat: the trainer's forward fake-quantizes to weight_quant
    plan: PlanConfig = PlanConfig()


# Where each planner input comes from in a run config, with the run config's default (the orchestrator's tests hold
# every key and default to RunConfig's). A run reads its own resolved config through this table, a YAML file through
# the same table; no other key of a run config is read.
RUN_KEYS: dict[str, tuple[str, Any]] = {
    "model_path": ("model.path", None),
    "dtype": ("kernel.dtype", "float32"),
    "tokens": ("trainer.backend.max_tokens_per_micro_batch", 4096),
    "activation_checkpointing": ("trainer.backend.activation_checkpointing", False),
    "num_ranks": ("trainer.num_ranks", 1),
    "kl_coef": ("trainer.loss.kl_coef", 0.0),
    "log_kl": ("trainer.log_kl", False),
    "advantage_estimator": ("trainer.advantage_estimator", "grpo"),
    "critic_kind": ("trainer.critic.kind", "separate"),
    "spec_mode": ("spec.mode", "off"),
    "num_kv_pages": ("rollout.engine.num_kv_pages", 1024),
    "page_size": ("kernel.page_size", 16),
    "max_running_requests": ("rollout.engine.max_running_requests", 64),
    "max_prefill_tokens": ("rollout.engine.max_prefill_tokens", 2048),
    "weight_dtype": ("rollout.engine.weight_dtype", "kernel"),
    "weight_block_size": ("rollout.engine.weight_block_size", [128, 128]),  # a list, as YAML and JSON write it
    "weight_group_size": ("rollout.engine.weight_group_size", 128),
    "max_new_tokens": ("rollout.max_new_tokens", 16),
    "kernel_mode": ("kernel.mode", "deterministic"),
    "query_tile": ("kernel.attention_query_tile", 4),
    "colocate": ("run.colocate", True),
    "offload_to": ("memory.offload_to", "auto"),
    "limit_bytes": ("memory.limit_bytes", None),
    "comm_headroom_bytes": ("memory.comm_headroom_bytes", 0),
    "lora_rank": ("trainer.lora.rank", 0),
    "lora_target_modules": ("trainer.lora.target_modules", "all-linear"),
    "lora_base_dtype": ("trainer.lora.base_dtype", "float32"),
    "qat": ("trainer.qat", False),
    "optimizer_offload": ("trainer.optimizer.offload", "none"),
    "moments_dtype": ("trainer.optimizer.moments_dtype", "float32"),
    # the parallel layout: the run's own settings (megatron's read when trainer.backend.name is megatron)
    "trainer_backend": ("trainer.backend.name", "fsdp2"),
    "tp": ("trainer.backend.megatron.tp", 1),
    "pp": ("trainer.backend.megatron.pp", 1),
    "ep": ("trainer.backend.megatron.ep", 1),
    "etp": ("trainer.backend.megatron.etp", None),
    "cp": ("trainer.backend.megatron.cp", 1),
    "megatron_recompute": ("trainer.backend.megatron.recompute", "none"),
    "rollout_engine": ("rollout.backend", "embedded"),
    "rollout_tp": ("rollout.sglang.tp_size", 1),
    "rollout_ep": ("rollout.sglang.ep_size", 1),
    "mem_fraction_static": ("rollout.sglang.mem_fraction_static", None),
}
# `PlanConfig`'s layout fields and the run keys they are read from (a run config's memory.plan no longer holds them)
LAYOUT_KEYS = {
    "trainer_backend": "trainer.backend.name", "tp": "trainer.backend.megatron.tp",
    "pp": "trainer.backend.megatron.pp", "ep": "trainer.backend.megatron.ep", "etp": "trainer.backend.megatron.etp",
    "cp": "trainer.backend.megatron.cp", "recompute": "trainer.backend.megatron.recompute",
    "optimizer_offload": "trainer.optimizer.offload", "moments_dtype": "trainer.optimizer.moments_dtype",
    "rollout_engine": "rollout.backend", "rollout_tp": "rollout.sglang.tp_size",
    "rollout_ep": "rollout.sglang.ep_size", "mem_fraction_static": "rollout.sglang.mem_fraction_static",
}  # fmt: skip


def _get(config: dict[str, Any], name: str) -> Any:
    """Input `name` of `RUN_KEYS` from a run config dict: its key's value, or the default when absent or null."""
    dotted, default = RUN_KEYS[name]
    node: Any = config
    for key in dotted.split("."):
        if not isinstance(node, dict) or node.get(key) is None:
            return default
        node = node[key]
    return node


def _plan_settings(config: dict[str, Any]) -> PlanSettings:
    settings = _plan_section(config)
    moved = [key for key in settings if key in LAYOUT_KEYS]
    if moved:
        now = ", ".join(f"memory.plan.{key} is now {LAYOUT_KEYS[key]}" for key in moved)
        raise ValueError(
            f"{now}: the layout is the run's own setting, which the planner reads (docs/memory-planner.md)"
        )
    try:
        return PlanSettings.model_validate(settings)
    except ValidationError as error:
        problems = "; ".join(f"memory.plan.{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in error.errors())
        raise ValueError(problems) from None


def _plan_section(config: dict[str, Any]) -> dict[str, Any]:
    section = config.get("memory") or {}
    plan = section.get("plan") if isinstance(section, dict) else None
    if plan is not None and not isinstance(plan, dict):
        raise ValueError("memory.plan must be a mapping of planner settings")
    return dict(plan or {})


def _read_lora(config: dict[str, Any], dtype: str) -> LoraSettings | None:
    """trainer.lora as the planner needs it (None: rank 0, no LoRA); ValueError for what the trainer refuses."""
    rank, targets, base_dtype = (_get(config, key) for key in ("lora_rank", "lora_target_modules", "lora_base_dtype"))
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank <= 4096:
        raise ValueError(f"trainer.lora.rank must be an integer from 0 (no LoRA) to 4096, not {rank!r}")
    if base_dtype not in ("float32", "bfloat16"):
        raise ValueError(f"trainer.lora.base_dtype must be float32 or bfloat16, not {base_dtype!r}")
    if rank == 0:
        return None
    if isinstance(targets, (list, tuple)) and all(isinstance(t, str) for t in targets):
        targets = tuple(targets)
    elif not isinstance(targets, str):
        raise ValueError(
            f"trainer.lora.target_modules must be a list of module names, 'all-linear' or one regex, not {targets!r}"
        )
    if base_dtype == "bfloat16" and dtype != "bfloat16":
        raise ValueError(
            f"trainer.lora.base_dtype=bfloat16 needs kernel.dtype=bfloat16 (it is {dtype}): the trainer refuses it, "
            "since the engine computes with the base in the kernel dtype; set kernel.dtype=bfloat16 or "
            "trainer.lora.base_dtype=float32"
        )
    return LoraSettings(rank, targets, base_dtype)


def _read_weight_quant(config: dict[str, Any]) -> WeightQuantSettings | None:
    """rollout.engine.weight_dtype and its block / group size as the planner needs them (None: kernel, the kernel
    dtype); ValueError for what the engine's config refuses."""
    fmt, block, group = (_get(config, key) for key in ("weight_dtype", "weight_block_size", "weight_group_size"))
    if fmt not in WEIGHT_FORMATS:
        raise ValueError(f"rollout.engine.weight_dtype must be one of {', '.join(WEIGHT_FORMATS)}, not {fmt!r}")
    is_block = isinstance(block, (list, tuple)) and len(block) == 2
    if not is_block or not all(isinstance(n, int) and not isinstance(n, bool) and n >= 1 for n in block):
        raise ValueError(f"rollout.engine.weight_block_size must be two positive integers ([128, 128]), not {block!r}")
    if isinstance(group, bool) or not isinstance(group, int) or not 8 <= group <= 4096 or group % 8:
        raise ValueError(
            f"rollout.engine.weight_group_size must be a multiple of 8 from 8 to 4096 (eight int4 values per int32), "
            f"not {group!r}"
        )
    return None if fmt == "kernel" else WeightQuantSettings(fmt, (block[0], block[1]), group)


def read_run(config: dict[str, Any]) -> RunInputs:
    """The planner's inputs from a run config dict (a run's own resolved config, or a YAML file: `RUN_KEYS`'s
    defaults where a key is absent), with the layout the run trains and rolls out with."""
    settings = _plan_settings(config)
    megatron = _get(config, "trainer_backend") == "megatron"
    checkpointing = bool(_get(config, "activation_checkpointing"))
    recompute = _get(config, "megatron_recompute") if megatron else "none"
    if recompute == "none":
        recompute = "full" if checkpointing else "none"
    sglang = _get(config, "rollout_engine") == "sglang"
    layout = {
        "trainer_backend": "megatron" if megatron else "fsdp2",
        **{dim: int(_get(config, dim) or 1) if megatron else 1 for dim in ("tp", "pp", "ep", "etp", "cp")},
        "recompute": recompute,
        "rollout_engine": "sglang" if sglang else "embedded",
        "rollout_tp": int(_get(config, "rollout_tp")) if sglang else 1,
        "rollout_ep": int(_get(config, "rollout_ep")) if sglang else 1,
    }
    if sglang and _get(config, "mem_fraction_static") is not None:
        layout["mem_fraction_static"] = float(_get(config, "mem_fraction_static"))
    offload, moments = _get(config, "optimizer_offload"), _get(config, "moments_dtype")
    if offload != "none" and megatron:
        raise ValueError(
            f"trainer.optimizer.offload={offload} runs on the FSDP2 backend only (trainer.backend.name=megatron "
            "refuses it); for megatron-core's optimizer CPU offload plan memory.plan.cpu_adam: true"
        )
    if settings.cpu_adam and not megatron:
        raise ValueError(
            "memory.plan.cpu_adam plans megatron-core's optimizer offload; the FSDP2 backend's is the run's own "
            "trainer.optimizer.offload (moments or moments_and_master)"
        )
    layout |= {"optimizer_offload": offload, "moments_dtype": moments}
    plan = PlanConfig.model_validate({**settings.model_dump(exclude_unset=True), **layout})
    spec_mode = _get(config, "spec_mode")
    is_gae = _get(config, "advantage_estimator") == "gae"
    return RunInputs(
        model_path=_get(config, "model_path"),
        dtype=_get(config, "dtype"),
        tokens=int(_get(config, "tokens")),
        recompute=recompute,
        num_ranks=int(_get(config, "num_ranks")),
        keep_reference=float(_get(config, "kl_coef")) > 0 or bool(_get(config, "log_kl")),
        critic=_get(config, "critic_kind") if is_gae else None,
        spec_mode="off" if spec_mode is False else str(spec_mode),
        num_kv_pages=int(_get(config, "num_kv_pages")),
        page_size=int(_get(config, "page_size")),
        max_running_requests=int(_get(config, "max_running_requests")),
        max_prefill_tokens=int(_get(config, "max_prefill_tokens")),
        max_new_tokens=int(_get(config, "max_new_tokens")),
        is_deterministic=_get(config, "kernel_mode") == "deterministic",
        query_tile=int(_get(config, "query_tile")),
        sequence_length=plan.sequence_length,
        colocate=bool(_get(config, "colocate")),
        offload_to=str(_get(config, "offload_to")),
        limit_bytes=_get(config, "limit_bytes"),
        comm_headroom_bytes=int(_get(config, "comm_headroom_bytes")),
        lora=_read_lora(config, _get(config, "dtype")),
        weight_quant=_read_weight_quant(config),
        qat=bool(_get(config, "qat")),
        plan=plan,
    )


def load_run_config(path: str | Path) -> dict[str, Any]:
    """A run config YAML file as a dict; ValueError when it is missing or not a mapping."""
    file = Path(path)
    if not file.is_file():
        raise ValueError(f"run config {str(file)!r} does not exist")
    data = yaml.safe_load(file.read_text()) or {}
    if not isinstance(data, dict):
        raise ValueError(f"run config {str(file)!r} is not a YAML mapping of sections")
    return data
