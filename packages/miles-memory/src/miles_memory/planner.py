"""The memory planner: will this run config fit that hardware, per GPU, by how much, and what is the biggest lever
(docs/memory-planner.md). Torch-free: the run config is read as a plain dict, never through the orchestrator.

plan_memory(run config) -> `read_run` (the keys it reads, resolved) -> `_check_layout` -> per-phase components
(`trainer_terms` / `engine_terms`, formulas in plan_formulas.py) -> the verdict -> `find_levers` (re-plans with each
candidate change).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ConfigDict, ValidationError

from miles_memory.hardware import HardwareProfile, load_hardware
from miles_memory.low_precision import WEIGHT_FORMATS, WeightQuantSettings, check_weight_format
from miles_memory.memory_plan import Component, MemoryPlan
from miles_memory.model_shape import LoraSettings, ModelShape, resolve_model
from miles_memory.plan_config import PlanConfig, PlanSettings
from miles_memory.plan_formulas import CPU_RUNTIME_BYTES, CUDA_CONTEXT_BYTES, DTYPE_BYTES, nccl_bytes
from miles_memory.plan_terms import engine_terms, trainer_terms

__all__ = ["LAYOUT_KEYS", "RUN_KEYS", "RunInputs", "load_run_config", "plan_memory", "read_run"]

GIB = 2**30


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


def _check_layout(shape: ModelShape, run: RunInputs, hw: HardwareProfile, train_gpus: int, rollout_gpus: int) -> None:
    """ValueError naming an impossible layout and how to fix it."""
    p = run.plan
    if run.dtype not in DTYPE_BYTES:
        raise ValueError(f"kernel.dtype {run.dtype!r} is not one of float32, bfloat16, float16")
    if hw.is_cpu and p.rollout_engine == "sglang":
        raise ValueError("cpu plans the embedded engine only (SGLang runs on GPUs): set rollout.backend=embedded")
    if run.lora is not None:  # what a run config refuses with LoRA (miles_orchestrator.config.run)
        if p.trainer_backend == "megatron" and (p.tp > 1 or p.etp > 1):
            raise ValueError(
                "trainer.backend.name=megatron does not support trainer.lora (LoRA adapters) with "
                "trainer.backend.megatron.tp > 1 or etp > 1 yet (the adapters would need splitting the way the "
                "weights are): use tp = etp = 1, or fsdp2"
            )
        if p.rollout_engine == "sglang":
            raise ValueError(
                "trainer.lora with rollout.backend=sglang is not supported yet (the SGLang engines would need the "
                "adapters loaded as a LoRA at every sync): use the embedded engine"
            )
        shape.lora_targets(run.lora.target_modules)  # ValueError: targets that select nothing
    if run.qat and run.weight_quant is None:
        raise ValueError(
            "trainer.qat=true trains against the low-precision engine's weights, but rollout.engine.weight_dtype is "
            "kernel: set it to fp8_block, fp8_channel or int4_group"
        )
    if run.weight_quant is not None:  # what a run config refuses with a low-precision engine (miles_orchestrator)
        unsupported = {
            "trainer.lora (the adapters are merged into a full-precision base)": run.lora is not None,
            "trainer.backend.name=megatron (use fsdp2)": p.trainer_backend == "megatron",
            "rollout.backend=sglang (SGLang quantizes on its own: rollout.sglang.extra_args --quantization fp8)":
                p.rollout_engine == "sglang",
        }  # fmt: skip
        named = [name for name, used in unsupported.items() if used]
        if named:
            raise ValueError(
                f"rollout.engine.weight_dtype={run.weight_quant.format} does not support {', '.join(named)} yet"
            )
        check_weight_format(shape, run.weight_quant)  # int4_group: a group size every linear layer's input takes
    for name, size in (("ep", p.ep), ("rollout_ep", p.rollout_ep)):
        if size > 1 and (not shape.is_moe or shape.num_experts % size):
            raise ValueError(f"{name}={size} does not divide the model's {shape.num_experts} experts: lower {name}")
    if p.trainer_backend == "fsdp2":
        dims = {k: getattr(p, k) for k in ("tp", "pp", "ep", "etp", "cp") if getattr(p, k) > 1}
        if dims:
            raise ValueError(
                f"trainer_backend fsdp2 shards over data parallel only, but the plan sets {dims}: set them to 1, "
                "or trainer.backend.name=megatron"
            )
    else:
        if train_gpus % (p.tp * p.pp * p.cp):
            raise ValueError(
                f"tp*pp*cp = {p.tp * p.pp * p.cp} does not divide the {train_gpus} training GPUs: change tp/pp/cp or "
                "the node count"
            )
        if train_gpus % (p.etp * p.ep * p.pp):
            raise ValueError(
                f"etp*ep*pp = {p.etp * p.ep * p.pp} does not divide the {train_gpus} training GPUs (Megatron's expert "
                "layers need ETP x EP x EDP x PP = GPUs): change ep/etp or the node count"
            )
        if shape.num_attention_heads % p.tp:
            raise ValueError(f"tp={p.tp} does not divide num_attention_heads={shape.num_attention_heads}: lower tp")
        if not shape.is_mla and shape.kv_heads % p.tp:
            raise ValueError(f"tp={p.tp} does not divide num_key_value_heads={shape.kv_heads}: use tp <= that")
        if p.pp > shape.num_hidden_layers:
            raise ValueError(f"pp={p.pp} exceeds the {shape.num_hidden_layers} layers: lower pp")
    if p.rollout_engine == "sglang":
        if rollout_gpus % p.rollout_tp:
            raise ValueError(f"rollout_tp={p.rollout_tp} does not divide the {rollout_gpus} rollout GPUs")
        if p.rollout_tp % p.rollout_ep:
            raise ValueError(f"rollout_ep={p.rollout_ep} must divide rollout_tp={p.rollout_tp} (SGLang's ep_size)")
        if shape.num_attention_heads % p.rollout_tp:
            raise ValueError(
                f"rollout_tp={p.rollout_tp} does not divide num_attention_heads={shape.num_attention_heads}"
            )


def _gpus(run: RunInputs, hw: HardwareProfile) -> tuple[int, int, int]:
    """(devices, training devices, rollout devices) of the plan."""
    if hw.is_cpu:
        return 1, 1, 1
    gpus = run.plan.nodes * hw.gpus_per_node
    if run.colocate:
        return gpus, gpus, gpus
    rollout = run.plan.rollout_gpus or gpus // 2
    if not 0 < rollout < gpus:
        raise ValueError(f"run.colocate=false needs 0 < rollout_gpus < {gpus} GPUs (got {rollout}): set rollout_gpus")
    return gpus, gpus - rollout, rollout


def _plan(run: RunInputs, hw: HardwareProfile) -> MemoryPlan:
    """The plan without levers."""
    shape, source = resolve_model(run.model_path, run.plan.model)
    gpus, train_gpus, rollout_gpus = _gpus(run, hw)
    # a CPU host runs trainer.num_ranks gloo ranks: Megatron's layout splits those
    _check_layout(shape, run, hw, run.num_ranks if hw.is_cpu else train_gpus, rollout_gpus)
    p = run.plan
    notes: list[str] = []
    capacity = hw.capacity_bytes if run.limit_bytes is None else min(hw.capacity_bytes, run.limit_bytes)
    trainer = trainer_terms(shape, run, hw, train_gpus, notes)
    engine = engine_terms(shape, run, hw, capacity, rollout_gpus, notes)
    components: list[Component] = []
    ranks = run.num_ranks if hw.is_cpu else 1
    context = CPU_RUNTIME_BYTES if hw.is_cpu else CUDA_CONTEXT_BYTES
    is_nccl = not hw.is_cpu and p.trainer_backend == "fsdp2"  # megatron's groups are in its own terms
    comm = run.comm_headroom_bytes + (nccl_bytes([train_gpus], hw.nccl_channels) if is_nccl else 0)
    offloaded = run.colocate and not (hw.is_cpu and run.offload_to == "host")
    for c in trainer.train:
        components.append(c.model_copy(update={"phase": "train", "bytes": c.bytes * ranks}))
    components.append(Component(tag="runtime", phase="train", name="trainer process runtime", bytes=context * ranks))
    components.append(Component(tag="comm", phase="train", name="trainer NCCL + comm_headroom", bytes=comm * ranks))
    for c in engine.rollout:
        components.append(c.model_copy(update={"phase": "rollout"}))
    components.append(Component(tag="runtime", phase="rollout", name="engine process runtime", bytes=context))
    if run.colocate:
        # colocated: each phase also holds what the other side keeps while idle (docs/memory-planner.md, "Phases")
        components += [c.model_copy(update={"phase": "train"}) for c in engine.idle]
        components.append(Component(tag="runtime", phase="train", name="engine process runtime", bytes=context))
        idle = [] if offloaded else trainer.resident
        components += [c.model_copy(update={"phase": "rollout", "bytes": c.bytes * ranks}) for c in idle]
        components.append(
            Component(tag="runtime", phase="rollout", name="trainer process runtime", bytes=context * ranks)
        )
        components.append(
            Component(tag="comm", phase="rollout", name="trainer NCCL + comm_headroom", bytes=comm * ranks)
        )
    elif hw.is_cpu:  # one host: both sides stay resident together
        components += [c.model_copy(update={"phase": "train"}) for c in engine.resident]
        components += [c.model_copy(update={"phase": "rollout", "bytes": c.bytes * ranks}) for c in trainer.resident]
    host = 0
    if not hw.is_cpu:
        per_node = min(hw.gpus_per_node, train_gpus)
        host_terms = list(trainer.host)
        if run.colocate:
            host_terms += [
                c.model_copy(update={"name": f"offloaded while rolling out: {c.name}"}) for c in trainer.resident
            ]
        for c in host_terms:
            components.append(c.model_copy(update={"phase": "host", "bytes": c.bytes * per_node}))
            host += c.bytes * per_node
        if run.colocate:  # one embedded engine per rollout GPU
            engines = min(hw.gpus_per_node, rollout_gpus)
            for c in engine.idle_host:
                components.append(c.model_copy(update={"phase": "host", "bytes": c.bytes * engines}))
                host += c.bytes * engines
    phases = {ph: sum(c.bytes for c in components if c.phase == ph) for ph in ("train", "rollout")}
    peak_phase = max(phases, key=lambda ph: phases[ph])
    peak = phases[peak_phase]
    host_ok = hw.is_cpu or host <= hw.host_bytes_per_node
    if not host_ok:
        notes.append(
            f"host memory: {host / GIB:.0f} GiB per node needed, {hw.host_bytes_per_node / GIB:.0f} GiB there"
        )
    fits = peak <= capacity and host_ok and engine.is_ok
    supported = ["fsdp2"] if p.trainer_backend == "fsdp2" else []
    if p.trainer_backend == "megatron" and p.cpu_adam:
        notes.append(
            "cpu_adam: megatron-core's optimizer CPU offload, which Miles' Megatron backend does not run (its AdamW "
            "stays on the device); FSDP2's host optimizer is trainer.optimizer.offload"
        )
    elif p.trainer_backend == "megatron":
        supported.append("megatron (miles-trainer[megatron], trainer.backend.name=megatron; docs/megatron.md)")
    params = {"total": shape.params(mtp=False), "active": shape.active_params(), "mtp": shape.params(mtp=True)}
    if run.lora is not None:
        params["lora"] = sum(t.numel for t in shape.lora_tensors(run.lora.rank, run.lora.target_modules))
        notes.append(_lora_note(shape, run, params["lora"]))
        if p.trainer_backend == "megatron":
            notes.append(
                "LoRA on the Megatron backend is planned as full training (every weight with gradients and "
                "AdamW state, the KL reference a copy): an upper bound of its adapters-only state"
            )
    return MemoryPlan(
        model=f"{shape.model_type} from {source}",
        hardware=hw.key,
        nodes=p.nodes if not hw.is_cpu else 1,
        num_gpus=gpus,
        layout=_layout(run, gpus, train_gpus, rollout_gpus),
        params=params,
        components=components,
        phases=phases,
        peak_phase=peak_phase,
        peak_bytes=peak,
        capacity_bytes=capacity,
        host_bytes_per_node=host,
        host_capacity_bytes=hw.host_bytes_per_node if not hw.is_cpu else 0,
        fits=fits,
        margin_bytes=capacity - peak,
        kv_tokens=engine.kv_tokens,
        supported_by=supported,
        notes=notes,
    )


def _lora_note(shape: ModelShape, run: RunInputs, adapter_params: int) -> str:
    """What a LoRA run moves and saves instead of the full weights (miles_trainer/lora.py, checkpoint.py)."""
    assert run.lora is not None
    layers = sum(t.copies for t in shape.lora_targets(run.lora.target_modules))
    b, mib = DTYPE_BYTES[run.dtype], 2**20
    return (
        f"LoRA rank {run.lora.rank} on {layers} linear layers: {adapter_params} adapter params; a checkpoint "
        f"holds them with their AdamW state (about 12 B x params = {12 * adapter_params / mib:.1f} MiB), a weight "
        f"sync sends them ({b} B x params = {b * adapter_params / mib:.1f} MiB; plus MTP layers trained online): the "
        "base is neither saved nor sent"
    )


def _layout(run: RunInputs, gpus: int, train_gpus: int, rollout_gpus: int) -> dict[str, Any]:
    p = run.plan
    out: dict[str, Any] = {"trainer_backend": p.trainer_backend, "colocate": run.colocate}
    if p.trainer_backend == "megatron":
        ranks = run.num_ranks if gpus == 1 else train_gpus  # a CPU host: trainer.num_ranks gloo ranks
        dp = ranks // (p.tp * p.pp * p.cp)
        out |= {"tp": p.tp, "pp": p.pp, "cp": p.cp, "dp": dp, "ep": p.ep, "etp": p.etp}
        out["edp"] = ranks // (p.etp * p.ep * p.pp)
        out["distributed_optimizer"] = p.distributed_optimizer
    else:
        out["fsdp"] = run.num_ranks if gpus == 1 else train_gpus
        out["optimizer_offload"] = p.optimizer_offload
        if p.optimizer_offload != "none":
            out["moments_dtype"] = p.moments_dtype
    out |= {"cpu_adam": p.cpu_adam, "recompute": run.recompute, "train_gpus": train_gpus}
    out |= {"rollout_engine": p.rollout_engine, "rollout_gpus": rollout_gpus}
    if p.rollout_engine == "sglang":
        out |= {"rollout_tp": p.rollout_tp, "rollout_ep": p.rollout_ep, "mem_fraction_static": p.mem_fraction_static}
    out |= {"dtype": run.dtype, "tokens_per_micro_batch": run.tokens}
    if run.lora is not None:
        out |= {"lora_rank": run.lora.rank, "lora_base_dtype": run.lora.base_dtype}
    if run.weight_quant is not None:
        out |= {"engine_weight_dtype": run.weight_quant.format, "qat": run.qat}
    return out


def plan_memory(
    config: dict[str, Any] | str | Path,
    hardware: str | None = None,
    nodes: int | None = None,
    *,
    find_lever: bool = True,
) -> MemoryPlan:
    """Plan a run config (a dict or a YAML path) on `hardware` (default: memory.plan.hardware, else cpu) with `nodes`
    (default: memory.plan.nodes); ValueError for bad input (unknown hardware or model, impossible layout)."""
    data = load_run_config(config) if isinstance(config, (str, Path)) else config
    run = read_run(data)
    name = hardware or run.plan.hardware or "cpu"
    hw = load_hardware(name)
    update: dict[str, Any] = {"hardware": hw.key}
    if nodes is not None:
        update["nodes"] = nodes
    run = run.model_copy(update={"plan": run.plan.model_copy(update=update)})
    plan = _plan(run, hw)
    if find_lever:
        from miles_memory.levers import find_levers

        plan.levers, plan.lever = find_levers(run, hw, plan, _plan)
    return plan
