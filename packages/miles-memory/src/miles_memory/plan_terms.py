"""The planner's terms of each side, per GPU (per rank on cpu): what the trainer holds while training, while idle
and in host memory, and what the rollout engine holds while generating and while idle (docs/memory-planner.md).
Formulas: plan_formulas.py."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from miles_memory.hardware import HardwareProfile
from miles_memory.low_precision import WeightQuantSettings, dequantized_bytes
from miles_memory.memory_plan import Component
from miles_memory.model_shape import ModelShape, Tensor
from miles_memory.plan_formulas import (
    DTYPE_BYTES,
    NATIVE_PANEL_WIDTH,
    activation_bytes,
    blocked_attention_elements,
    cuda_graph_bytes,
    dispatch_bytes,
    embedded_engine_bytes,
    engine_weight_bytes,
    fsdp2_bytes,
    kv_bytes_per_token,
    layer_activation_elements,
    native_attention_elements,
    nccl_bytes,
    weight_sync_bytes,
)

if TYPE_CHECKING:
    from miles_memory.run_inputs import RunInputs

__all__ = ["EngineTerms", "TrainerTerms", "engine_terms", "trainer_terms"]

GIB = 2**30
PROMPT_TOKENS_GUESS = 64  # prompt tokens per sequence when memory.plan.sequence_length is not given


@dataclass
class TrainerTerms:
    train: list[Component] = field(default_factory=list)  # held while training
    resident: list[Component] = field(default_factory=list)  # state kept between steps (offloaded when colocated)
    host: list[Component] = field(default_factory=list)  # host memory per GPU (CPU Adam)


@dataclass
class EngineTerms:
    rollout: list[Component] = field(default_factory=list)  # held while generating
    idle: list[Component] = field(default_factory=list)  # held while the trainer works (colocated)
    idle_host: list[Component] = field(default_factory=list)  # host memory per engine while the trainer works
    resident: list[Component] = field(default_factory=list)  # weights + KV when never released
    kv_tokens: int | None = None
    is_ok: bool = True


def _c(tag: str, name: str, value: float, formula: str = "") -> Component:
    return Component(tag=tag, phase="train", name=name, bytes=int(value), formula=formula)


def trainer_terms(
    shape: ModelShape, run: RunInputs, hw: HardwareProfile, train_gpus: int, notes: list[str]
) -> TrainerTerms:
    if run.plan.trainer_backend == "megatron":  # on a CPU: num_ranks gloo ranks (the backend's CPU device mode)
        return _megatron(shape, run, run.num_ranks if hw.is_cpu else train_gpus, hw.nccl_channels, notes)
    return _fsdp2(shape, run, train_gpus, hw)


def deterministic_attention_extra(shape: ModelShape, run: RunInputs, hw: HardwareProfile) -> float:
    """Elements per token and layer Miles' deterministic attention keeps beyond a fused kernel's (0 in fast mode): on
    a CPU the native attention's (`native_attention_elements`, the default where miles_kernels' native library
    built), on a GPU the blocked attention's (`blocked_attention_elements`)."""
    if not run.is_deterministic:
        return 0.0
    length = min(run.sequence_length or PROMPT_TOKENS_GUESS + run.max_new_tokens, run.tokens)
    if hw.is_cpu:
        return native_attention_elements(shape, length, DTYPE_BYTES[run.dtype])
    return blocked_attention_elements(shape, length, run.query_tile, run.page_size, DTYPE_BYTES[run.dtype])


def _fsdp2(shape: ModelShape, run: RunInputs, train_gpus: int, hw: HardwareProfile) -> TrainerTerms:
    world = run.num_ranks if run.plan.hardware == "cpu" else train_gpus
    online = run.spec_mode == "online"
    lora = run.lora
    b = fsdp2_bytes(
        shape,
        world,
        run.dtype,
        run.tokens,
        recompute=run.recompute,
        keep_reference=run.keep_reference,
        critic=run.critic,
        is_mtp_trained=online,
        attention_extra=deterministic_attention_extra(shape, run, hw),
        lora=lora,
        is_deterministic=run.is_deterministic,
        qat=run.qat,
        offload=run.plan.optimizer_offload,
        moments_dtype=run.plan.moments_dtype,
    )
    fp32 = "fp32 shards: 4 B x params / fsdp world (dim 0 padded)"
    if lora is None:
        state = [
            _c("weights", "policy + reference + critic fp32 params", b["weights"], fp32),
            _c("grads", "fp32 gradients (sharded)", b["grads"], fp32),
            _c("optimizer", "AdamW exp_avg + exp_avg_sq (fp32, sharded)", b["optimizer"],
               "8 B x trained params / world"),
        ]  # fmt: skip
    else:  # LoRA: a frozen base; the adapters alone train (miles_trainer/lora.py)
        base_b = DTYPE_BYTES[lora.base_dtype]
        adapters = f"LoRA adapters (rank {lora.rank})"
        trained = adapters + (" + critic" if run.critic else "")  # a critic trains whole, beside the adapters
        state = [
            _c("weights", f"frozen base ({lora.base_dtype}) + critic params", b["weights"],
               f"{base_b} B x base params / world"),
            _c("weights", f"{adapters}: fp32 masters", b["adapters"], "4 B x adapter params / world"),
            _c("grads", f"{trained}: fp32 gradients (sharded)", b["grads"], "4 B x adapter params / world"),
            _c("optimizer", f"{trained}: AdamW exp_avg + exp_avg_sq (fp32, sharded)", b["optimizer"],
               "8 B x adapter params / world"),
        ]  # fmt: skip
    state.append(_c("mtp", "MTP modules" + (" + grads + AdamW" if online else " (weights only)"), b["mtp"]))
    state = [c for c in state if c.bytes]  # what offload moved to host memory is not the device's
    out = TrainerTerms(resident=[c for c in state if c.tag != "grads"])
    if run.plan.optimizer_offload != "none":
        moments = f"{2 * DTYPE_BYTES[run.plan.moments_dtype]} B x trained params / world + 4 B per tensor"
        out.host.append(_c("optimizer", f"host AdamW: exp_avg + exp_avg_sq ({run.plan.moments_dtype}, pinned)",
                           b["host_optimizer"], moments))  # fmt: skip
        if run.plan.optimizer_offload == "moments_and_master":
            out.host += [
                _c("weights", "host fp32 policy shards (FSDP2 CPU offload)", b["host_weights"], fp32),
                _c("grads", "host fp32 policy gradients (FSDP2 CPU offload)", b["host_grads"], fp32),
            ]
        out.host = [c.model_copy(update={"phase": "host"}) for c in out.host]
    out.train = [
        *state,
        _c("weights", "FSDP2 all-gathered params (root + 2 layers)", b["gathered"], "compute dtype"),
        _c("activations", f"activations ({run.recompute} recompute, {run.tokens} tokens)", b["activations"]),
    ]
    if lora is not None:
        kept = (
            "merged weights W + s·B·A of the adapted layers (deterministic)"
            if run.is_deterministic
            else "x·A of the adapted layers, merged routed experts (fast)"
        )
        out.train.append(_c("activations", f"LoRA: {kept}", b["lora_activations"], "lora_activation_bytes"))
    if run.qat:
        out.train.append(_c("activations", "QAT: fake-quantized weights of the quantized layers", b["qat_activations"],
                            "b x out x in per trunk linear layer (qat_layer_bytes)"))  # fmt: skip
    if run.plan.hardware != "cpu" and shape.is_moe:
        out.train.append(_c("comm", "MoE dispatch buffers", dispatch_bytes(shape, run.tokens, DTYPE_BYTES[run.dtype])))
    return out


def _stage_tensors(shape: ModelShape, pp: int, stage: int) -> tuple[list[Tensor], list[int]]:
    per = math.ceil(shape.num_hidden_layers / pp)
    layers = list(range(stage * per, min(shape.num_hidden_layers, (stage + 1) * per)))
    last = stage == pp - 1
    keep: list[Tensor] = []
    for t in shape.tensors():
        if t.layer is None:
            is_first = t.name == "model.embed_tokens.weight"
            if (is_first and stage == 0) or (not is_first and last):
                keep.append(t)
        elif t.layer in layers or (last and t.layer >= shape.num_hidden_layers):
            keep.append(t)
    return keep, layers


def _megatron(shape: ModelShape, run: RunInputs, gpus: int, channels: int, notes: list[str]) -> TrainerTerms:
    """Megatron-core mixed precision (docs: 'Distributed Optimizer', bytes per parameter: bf16 params + fp32 grads =
    18 B, or 6 + 12/d with the distributed optimizer; fp32 params = 16 B or 8 + 8/d): dense weights over TP, experts
    over EP x ETP, layers over PP (the worst stage planned), the optimizer over DP x CP (experts: over EDP)."""
    p = run.plan
    dp = gpus // (p.tp * p.pp * p.cp) * p.cp
    edp = gpus // (p.etp * p.ep * p.pp)
    pb = 4 if run.dtype == "float32" else 2
    opt_b = 8 + (0 if pb == 4 else 4)  # Adam moments + fp32 master when params are 16-bit
    online = run.spec_mode == "online"
    act_b = DTYPE_BYTES[run.dtype]
    tokens = run.tokens / p.cp
    best: TrainerTerms | None = None
    best_bytes = -1
    for stage in sorted({0, p.pp - 1}):
        tensors, layers = _stage_tensors(shape, p.pp, stage)

        def split(ts: list[Tensor]) -> float:
            return sum(t.numel / (p.ep * p.etp) if t.is_expert else t.numel / p.tp for t in ts)

        def opt(ts: list[Tensor]) -> float:
            dense = sum(t.numel for t in ts if not t.is_expert) / p.tp
            expert = sum(t.numel for t in ts if t.is_expert) / (p.ep * p.etp)
            if p.distributed_optimizer:
                return opt_b * (dense / dp + expert / edp)
            return opt_b * (dense + expert)

        is_mtp = [t.layer is not None and t.layer >= shape.num_hidden_layers for t in tensors]
        trunk = [t for t, m in zip(tensors, is_mtp, strict=True) if not m]
        mtp = [t for t, m in zip(tensors, is_mtp, strict=True) if m]
        weights = pb * split(trunk)
        terms = TrainerTerms()
        state = [
            _c("weights", f"{'bf16' if pb == 2 else 'fp32'} params (dense / tp, experts / ep*etp)", weights),
            _c("grads", "fp32 main grads", 4 * split(trunk)),
            _c(
                "optimizer",
                "fp32 master + Adam moments" + (" / dp (distributed)" if p.distributed_optimizer else ""),
                opt(trunk),
            ),
            _c(
                "mtp",
                "MTP modules" + (" + grads + optimizer" if online else " (weights only)"),
                pb * split(mtp) + ((4 * split(mtp) + opt(mtp)) if online else 0),
            ),
        ]
        if run.keep_reference:
            state.append(_c("weights", "frozen reference", pb * split(tensors)))
        if run.critic == "separate":
            state += [
                _c("weights", "critic params", pb * split(trunk)),
                _c("grads", "critic grads", 4 * split(trunk)),
                _c("optimizer", "critic optimizer", opt(trunk)),
            ]
        terms.resident = [c for c in state if c.tag != "grads"]
        if p.cpu_adam:
            terms.host = [
                c.model_copy(update={"phase": "host", "name": "CPU Adam: " + c.name})
                for c in state
                if c.tag == "optimizer"
            ]
            state = [c for c in state if c.tag != "optimizer"]
            terms.resident = [c for c in terms.resident if c.tag != "optimizer"]
        last = stage == p.pp - 1
        # 1F1B: the first stage holds pp micro-batches of its layers in flight (Korthikanti et al. section 4.2.3)
        in_flight = layers * (min(p.pp, max(1, p.pp - stage)))
        if online and last:
            in_flight += list(shape.mtp_layers())
        acts = activation_bytes(shape, tokens, act_b, run.recompute, in_flight, p.tp, has_logits=last)
        if run.critic == "separate":
            acts += activation_bytes(shape, tokens, act_b, run.recompute, in_flight, p.tp, has_logits=False)
        groups = [p.tp, p.pp, dp, p.ep, p.etp, edp]
        a2a_peers = p.ep - 1 if channels else 0
        terms.train = [
            *state,
            _c(
                "activations",
                f"activations ({run.recompute} recompute, {tokens:.0f} tokens / cp, stage {stage})",
                acts,
            ),
            _c("comm", "MoE dispatch buffers", dispatch_bytes(shape, tokens / p.tp, act_b)),
            # gloo (channels 0 on a CPU) keeps no buffers of its own
            _c("comm", "NCCL buffers of tp/pp/dp/ep/etp/edp groups", nccl_bytes(groups, channels, a2a_peers)),
        ]
        total = sum(c.bytes for c in terms.train)
        if total > best_bytes:
            best, best_bytes = terms, total
    assert best is not None
    if p.pp > 1:
        notes.append(
            "pp > 1: the worst of the first stage (embedding, pp micro-batches in flight) and the last "
            "(LM head, logits, MTP) is planned"
        )
    if run.recompute == "selective":
        notes.append("selective recompute recomputes core attention, which a fused attention kernel already does")
    return best


def _sync_note(shape: ModelShape, dtype: str, quant: WeightQuantSettings, weights: int) -> str:
    """What a low-precision engine saves, and what a weight sync then sends (miles_trainer/weight_sender.py)."""
    mib = 2**20
    full = engine_weight_bytes(shape, dtype)
    return (
        f"rollout.engine.weight_dtype={quant.format}: the engine holds {weights / mib:,.1f} MiB of weights "
        f"({full / mib:,.1f} MiB in {dtype}); a weight sync sends them in that format, "
        f"{weight_sync_bytes(shape, dtype, quant) / mib:,.1f} MiB (its buckets, or a same-node engine's /dev/shm "
        "weights file); the trainer keeps float32 masters"
    )


def engine_terms(
    shape: ModelShape, run: RunInputs, hw: HardwareProfile, capacity: int, rollout_gpus: int, notes: list[str]
) -> EngineTerms:
    p = run.plan
    b = DTYPE_BYTES[run.dtype]
    has_draft = run.spec_mode in ("frozen", "online") and shape.num_nextn_predict_layers > 0
    out = EngineTerms()
    prefill = run.max_prefill_tokens
    act_elements = layer_activation_elements(shape, shape.num_hidden_layers - 1)
    if p.rollout_engine == "embedded":
        quant = run.weight_quant
        # on a CPU the native linear keeps float32 packed copies of the weights it multiplies (an upper bound where
        # fast mode runs MKL's GEMM instead: Intel CPUs)
        packed_width = NATIVE_PANEL_WIDTH if hw.is_cpu else None
        e = embedded_engine_bytes(shape, run.dtype, run.num_kv_pages, run.page_size, has_draft=has_draft,
                                  lora=run.lora, weight_quant=quant, packed_width=packed_width)  # fmt: skip
        name, formula = f"engine weights ({run.dtype})", ""
        if quant is not None:  # low-precision rollout: the trunk's linear layers in the engine's format
            name = f"engine weights: linear layers {quant.describe()} + the rest in {run.dtype}"
            formula = f"{quant.formula()}; {b} B x other params"
            notes.append(_sync_note(shape, run.dtype, quant, e["weights"]))
        if packed_width is not None:
            name += " + the native linear's packed float32 copies"
            formula = "; ".join(f for f in (formula, "native_packed_bytes") if f)
        held = [Component(tag="weights", phase="rollout", name=name, bytes=e["weights"], formula=formula)]
        if run.lora is not None:
            held.append(Component(
                tag="weights", phase="rollout", bytes=e["lora"], formula="b x (adapter params + adapted weights)",
                name=f"engine LoRA adapters + merged (folded) weights of the adapted layers ({run.dtype})",
            ))  # fmt: skip
        kv = Component(
            tag="kv_cache",
            phase="rollout",
            name=f"KV cache: {run.num_kv_pages} pages x {run.page_size} "
            f"tokens{' (+ draft layer)' if has_draft else ''}",
            bytes=e["kv_cache"],
        )
        acts = prefill * act_elements * b + run.max_running_requests * shape.vocab_size * 8
        out.rollout = [
            *held,
            kv,
            Component(tag="activations", phase="rollout", name="engine step (estimate)", bytes=int(acts)),
        ]
        if quant is not None:
            out.rollout.append(Component(
                tag="activations", phase="rollout", bytes=dequantized_bytes(shape, b), formula="dequantized_bytes",
                name=f"engine: weights dequantized to {run.dtype} in flight (an MoE layer's routed experts at once)",
            ))  # fmt: skip
        out.resident = [c.model_copy(update={"phase": "train"}) for c in [*held, kv]]
        if run.lora is not None:
            # weight syncs send only the adapters, so a released engine keeps its weights in host memory (its
            # HostStore; miles_rollout/engine.py): the same device on cpu, host memory per node on a GPU
            kept = [c.model_copy(update={"phase": "train", "name": f"{c.name}, kept in host memory"}) for c in held]
            if hw.is_cpu:
                out.idle = kept
            else:
                out.idle_host = [c.model_copy(update={"phase": "host"}) for c in kept]
        out.kv_tokens = run.num_kv_pages * run.page_size
        if not hw.is_cpu:
            notes.append("embedded engine on a GPU: one engine per GPU holding the whole model; sglang shards it")
        return out
    # SGLang: weights + KV pool fill mem_fraction_static of the GPU (SGLang server_args: mem_fraction_static)
    tp = p.rollout_tp
    kv_b = b if p.kv_cache_dtype == "auto" else DTYPE_BYTES[p.kv_cache_dtype]
    weight_bytes = sum(t.numel for t in shape.tensors()) * b / tp
    pool = int(p.mem_fraction_static * capacity - weight_bytes)
    layers = shape.num_hidden_layers + (1 if has_draft else 0)
    per_token = kv_bytes_per_token(shape, kv_b, tp, layers)
    out.kv_tokens = max(pool, 0) // per_token
    graphs = cuda_graph_bytes(shape, p.cuda_graph_max_bs, b, tp)
    acts = prefill * act_elements * b / tp
    comm = nccl_bytes([tp, p.rollout_ep], hw.nccl_channels, p.rollout_ep - 1)
    out.rollout = [
        Component(tag="weights", phase="rollout", name=f"sglang weights / rollout_tp {tp}", bytes=int(weight_bytes)),
        Component(
            tag="kv_cache",
            phase="rollout",
            name=f"sglang KV pool: {out.kv_tokens} tokens",
            bytes=max(pool, 0),
            formula="mem_fraction_static x capacity - weights",
        ),
        Component(tag="runtime", phase="rollout", name="CUDA graphs (estimate)", bytes=graphs),
        Component(tag="activations", phase="rollout", name="prefill chunk (estimate)", bytes=int(acts)),
        Component(tag="comm", phase="rollout", name="sglang NCCL buffers", bytes=comm),
    ]
    out.idle = [c.model_copy(update={"phase": "train"}) for c in out.rollout if c.tag in ("runtime", "comm")]
    if pool <= 0:
        out.is_ok = False
        notes.append(
            f"sglang: the weights ({weight_bytes / GIB:.1f} GiB) leave no KV pool within mem_fraction_static "
            f"{p.mem_fraction_static}: raise rollout.sglang.tp_size or mem_fraction_static"
        )
    elif out.kv_tokens < run.max_running_requests * run.max_new_tokens:
        notes.append(
            f"sglang: the KV pool holds {out.kv_tokens} tokens, fewer than max_running_requests x "
            f"max_new_tokens = {run.max_running_requests * run.max_new_tokens}: requests will queue"
        )
    if p.cuda_graph_max_bs:
        notes.append("sglang: CUDA graph memory is an estimate (cuda_graph_max_bs activations + 1 GiB)")
    return out
