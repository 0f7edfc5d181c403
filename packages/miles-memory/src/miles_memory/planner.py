"""The memory planner: will this run config fit that hardware, per GPU, by how much, and what is the biggest lever
(docs/memory-planner.md). Torch-free: the run config is read as a plain dict, never through the orchestrator.

plan_memory(run config) -> `read_run` (run_inputs.py: the keys it reads, resolved) -> `_check_layout` -> per-phase
components (`trainer_terms` / `engine_terms`, formulas in plan_formulas.py) -> the verdict -> `find_levers` (re-plans
with each candidate change).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from miles_memory.hardware import HardwareProfile, load_hardware
from miles_memory.low_precision import check_weight_format
from miles_memory.memory_plan import Component, MemoryPlan
from miles_memory.model_shape import ModelShape, resolve_model
from miles_memory.plan_formulas import CPU_RUNTIME_BYTES, CUDA_CONTEXT_BYTES, DTYPE_BYTES, nccl_bytes
from miles_memory.plan_terms import engine_terms, trainer_terms
from miles_memory.run_inputs import LAYOUT_KEYS, RUN_KEYS, RunInputs, load_run_config, read_run

__all__ = ["LAYOUT_KEYS", "RUN_KEYS", "RunInputs", "load_run_config", "plan_memory", "read_run"]

GIB = 2**30


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
