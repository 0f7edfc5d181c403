"""The planner's lever finder: re-plan a run with each candidate change and name the one to make — the first, in
order of how small a change it is, that makes the run fit; when the run fits already (or nothing alone does), the one
that frees the most (docs/memory-planner.md, "The lever")."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from miles_memory.hardware import HardwareProfile
from miles_memory.memory_plan import Lever, MemoryPlan
from miles_memory.model_shape import resolve_model

if TYPE_CHECKING:
    from miles_memory.run_inputs import RunInputs

__all__ = ["candidates", "find_levers"]

GIB = 2**30


def candidates(run: RunInputs, hw: HardwareProfile, plan: MemoryPlan) -> list[tuple[str, RunInputs]]:
    """(description, changed run) for every change worth trying, smallest change first."""
    shape, _ = resolve_model(run.model_path, run.plan.model)
    p = run.plan
    out: list[tuple[str, RunInputs]] = []

    def plan_change(text: str, **update: Any) -> None:
        out.append((text, run.model_copy(update={"plan": p.model_copy(update=update)})))

    def run_change(text: str, **update: Any) -> None:
        out.append((text, run.model_copy(update=update)))

    is_train_peak = plan.peak_phase == "train"
    if is_train_peak or plan.host_bytes_per_node > plan.host_capacity_bytes > 0:
        if run.lora is not None and run.lora.base_dtype == "float32" and run.dtype == "bfloat16":
            # the compute rounds the base to bfloat16 anyway: the same numbers in half the bytes
            run_change("trainer.lora.base_dtype: bfloat16", lora=run.lora._replace(base_dtype="bfloat16"))
        if run.recompute != "full":
            run_change("trainer.backend.activation_checkpointing: true (recompute: full)", recompute="full")
        if run.tokens >= 512:
            run_change(
                f"trainer.backend.max_tokens_per_micro_batch {run.tokens} -> {run.tokens // 2}", tokens=run.tokens // 2
            )
        if p.trainer_backend == "megatron":
            if not p.distributed_optimizer:
                plan_change("memory.plan.distributed_optimizer: true", distributed_optimizer=True)
            if shape.is_moe and shape.num_experts % (2 * p.ep) == 0:
                plan_change(f"trainer.backend.megatron.ep {p.ep} -> {2 * p.ep}", ep=2 * p.ep)
            if shape.num_attention_heads % (2 * p.tp) == 0:
                plan_change(f"trainer.backend.megatron.tp {p.tp} -> {2 * p.tp}", tp=2 * p.tp)
            if 2 * p.pp <= shape.num_hidden_layers:
                plan_change(f"trainer.backend.megatron.pp {p.pp} -> {2 * p.pp}", pp=2 * p.pp)
        if p.trainer_backend == "fsdp2" and not hw.is_cpu:  # the host optimizer, one step further each time
            if p.optimizer_offload == "none":
                plan_change("trainer.optimizer.offload: moments (AdamW's moments in host memory)",
                            optimizer_offload="moments")  # fmt: skip
            elif p.optimizer_offload == "moments":
                plan_change("trainer.optimizer.offload: moments_and_master (the fp32 shards too)",
                            optimizer_offload="moments_and_master")  # fmt: skip
    if not is_train_peak:
        if p.rollout_engine == "sglang":
            if p.mem_fraction_static > 0.55:
                mfs = round(p.mem_fraction_static - 0.1, 2)
                plan_change(
                    f"rollout.sglang.mem_fraction_static {p.mem_fraction_static} -> {mfs}", mem_fraction_static=mfs
                )
            if shape.num_attention_heads % (2 * p.rollout_tp) == 0:
                plan_change(
                    f"rollout.sglang.tp_size {p.rollout_tp} -> {2 * p.rollout_tp}", rollout_tp=2 * p.rollout_tp
                )
        elif run.num_kv_pages >= 2:
            run_change(
                f"rollout.engine.num_kv_pages {run.num_kv_pages} -> {run.num_kv_pages // 2}",
                num_kv_pages=run.num_kv_pages // 2,
            )
        if p.rollout_engine == "embedded" and not hw.is_cpu:
            tp = min(hw.gpus_per_node, 8)
            plan_change(
                f"rollout.backend: sglang with rollout.sglang.tp_size {tp}", rollout_engine="sglang", rollout_tp=tp
            )
    if not hw.is_cpu:
        for factor in (2, 4, 8, 16):
            plan_change(f"more nodes: memory.plan.nodes {p.nodes * factor}", nodes=p.nodes * factor)
    return out


def find_levers(
    run: RunInputs,
    hw: HardwareProfile,
    plan: MemoryPlan,
    replan: Callable[[RunInputs, HardwareProfile], MemoryPlan],
) -> tuple[list[Lever], str | None]:
    """Every candidate's outcome, and the lever to name."""
    tried: list[Lever] = []
    first_fit: str | None = None
    for text, changed in candidates(run, hw, plan):
        try:
            result = replan(changed, hw)
        except ValueError:  # the change makes an impossible layout (e.g. ep not dividing the GPUs)
            continue
        if text.startswith("more nodes") and (
            first_fit is not None or any(t.change.startswith("more") for t in tried if t.fits)
        ):
            continue
        tried.append(Lever(change=text, peak_bytes=result.peak_bytes, fits=result.fits))
        if result.fits and first_fit is None:
            first_fit = text
    if not tried:
        return tried, None
    best = min(tried, key=lambda lever: lever.peak_bytes)
    freed = (plan.peak_bytes - best.peak_bytes) / GIB
    if plan.fits:
        return tried, f"{best.change} (frees {freed:.1f} GiB)" if freed > 0 else None
    if first_fit is not None:
        return tried, first_fit
    return tried, f"{best.change} (frees the most, {freed:.1f} GiB, but does not fit alone)"
