"""The memory planner's byte formulas, one function per term, each with its source (docs/memory-planner.md).

Torch-free arithmetic on a `ModelShape`. Units: bytes. N: tokens of one micro-batch on one rank; H hidden size;
V vocab; L decoder layers; b: bytes of the compute dtype.
"""

from __future__ import annotations

import math

from miles_memory.low_precision import (
    WeightQuantSettings,
    check_weight_format,
    qat_layer_bytes,
    quantized_weight_bytes,
)
from miles_memory.model_shape import LoraSettings, ModelShape, Tensor

__all__ = [
    "CUDA_CONTEXT_BYTES",
    "DTYPE_BYTES",
    "NATIVE_PANEL_WIDTH",
    "NCCL_BUFFSIZE",
    "activation_bytes",
    "cuda_graph_bytes",
    "dispatch_bytes",
    "embedded_engine_bytes",
    "engine_weight_bytes",
    "fsdp2_bytes",
    "kv_bytes_per_token",
    "layer_activation_elements",
    "layer_extra_bytes",
    "lora_activation_bytes",
    "lora_layer_bytes",
    "native_packed_bytes",
    "nccl_bytes",
    "shard_numel",
    "weight_sync_bytes",
]

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "fp8": 1}
# NCCL_BUFFSIZE default, 4 MiB per channel and peer: https://docs.nvidia.com/deeplearning/nccl/user-guide/docs/env.html
NCCL_BUFFSIZE = 4 * 2**20
# Assumption: a CUDA context with torch's kernels loaded, plus the caching allocator's slack, per process (measured
# values are 0.5-1 GiB on Hopper; the upper end is taken).
CUDA_CONTEXT_BYTES = 2**30
# Assumption: the torch runtime's own memory in a CPU process (not live tensor bytes; counted for the verdict only).
CPU_RUNTIME_BYTES = 2**29


# The GLM-4.5 / DeepSeek-V3 router's score-correction bias: a float32 buffer, frozen in RL (miles_kernels/model.py,
# `TopkRouter`), so no gradient or optimizer state; the trainer's weight tag holds parameters only.
FROZEN_BUFFER = "e_score_correction_bias"


def shard_numel(t: Tensor, world: int) -> int:
    """Elements one rank holds of `t` sharded by FSDP2 over `world` ranks: dim 0 split into ceil(dim0 / world) rows
    (FSDP2's `fully_shard` pads dim 0 to a multiple of the world size; torch/distributed/fsdp/_fully_shard/
    _fsdp_param.py)."""
    if world == 1:
        return t.numel
    rows = math.ceil(t.shape[0] / world)
    return t.copies * rows * math.prod(t.shape[1:])


def layer_activation_elements(shape: ModelShape, layer: int, tp: int = 1) -> float:
    """Elements one token keeps for backward in one decoder layer, after Korthikanti et al. 2022 ("Reducing
    Activation Recomputation in Large Transformer Models", arXiv 2205.05198, section 4.1) adapted:
    - attention through a fused (flash / SDPA-style) kernel keeps no s x s score or dropout matrix (Dao et al. 2022,
      "FlashAttention", arXiv 2205.14135): only Q, K, V, the output and (fp32) softmax statistics;
    - no dropout (RL fine-tuning runs with dropout 0);
    - a SwiGLU MLP keeps its input, gate and up outputs, silu(gate) and the product (4 intermediate-wide tensors);
    - an MoE layer keeps the router's logits and probabilities (fp32, counted as 2 elements each) and, per token,
      top-k copies of the expert input, four intermediate-wide tensors and the expert output (activated experts only);
    - both RMSNorms keep their input (the residual stream) and output.
    With tensor + sequence parallelism every term is divided by tp (Korthikanti et al., table 2)."""
    h, heads, d = shape.hidden_size, shape.num_attention_heads, shape.dim
    values = 4.0 * h  # two RMSNorms: input and output each
    if shape.is_mla:
        assert shape.kv_lora_rank is not None
        qk = shape.qk_nope_head_dim + shape.qk_rope_head_dim
        q_latent = 2 * (shape.q_lora_rank or 0)  # q_a_proj output and its norm
        kv_latent = 2 * shape.kv_lora_rank + shape.qk_rope_head_dim
        values += q_latent + kv_latent + heads * qk * 2 + heads * (shape.qk_nope_head_dim + shape.v_head_dim)
        values += 2 * heads * shape.v_head_dim + 2 * heads  # v, output, softmax statistics
    else:
        q, kv = heads * d, shape.kv_heads * d
        values += 2 * q + 2 * kv + 2 * heads  # Q, K, V, output, softmax statistics
        if shape.has_qk_norm:
            values += q + kv  # q/k before their RMSNorm
    if shape.is_moe_layer(layer):
        k, i = shape.num_experts_per_tok, shape.moe_intermediate_size
        values += 4 * shape.num_experts  # router logits and probabilities in fp32 (2 elements each at 2 bytes)
        values += k * (2 * h + 4 * i) + 4 * i * shape.n_shared_experts
    else:
        values += 4 * shape.intermediate_size
    return values / tp


def blocked_attention_elements(
    shape: ModelShape, sequence_length: int, query_tile: int, page_size: int, act_bytes: int = 4
) -> float:
    """Elements per token and layer that Miles' deterministic attention keeps beyond a fused kernel's Q, K, V,
    output and softmax statistics (miles_kernels/ops/attention.py, `_BlockedAttention`): its hand-written backward
    keeps the float32 query tiles (in place of Q) and the float32 output tiles (besides the output the next layer
    keeps), both padded to whole tiles of `query_tile` tokens, and the K/V pages (in place of K and V) padded to whole
    pages; the backward recomputes the scores chunk by chunk (a bounded, transient buffer). In float32 elements
    (`act_bytes`: the activation dtype's size, for the terms kept in it).
    MLA (miles_kernels/latent_attention.py, `LatentAttention`) runs the absorbed form: one KV head whose keys and
    values are the latent (W = kv_lora_rank + qk_rope_head_dim; one page store, in the activation dtype), queries of
    width W per head; besides the float32 tiles it keeps the attention's output (heads x W, the value projection's
    input), and none of the expanded form's K, kv_b_proj output and V that `layer_activation_elements` counts
    (subtracted)."""
    heads, kv_heads, d = shape.num_attention_heads, shape.kv_heads, shape.dim
    tiled = -(-sequence_length // query_tile) * query_tile
    paged = -(-sequence_length // page_size) * page_size
    if shape.is_mla:
        assert shape.kv_lora_rank is not None
        width = shape.kv_lora_rank + shape.qk_rope_head_dim
        qk = shape.qk_nope_head_dim + shape.qk_rope_head_dim
        in_act = paged * width / sequence_length + heads * width
        in_act -= heads * qk + heads * (shape.qk_nope_head_dim + shape.v_head_dim) + heads * shape.v_head_dim
        return 2 * tiled * heads * width / sequence_length + in_act * act_bytes / 4
    elements = (2 * tiled - sequence_length) * heads * d + 2 * (paged - sequence_length) * kv_heads * d
    return elements / sequence_length


def native_attention_elements(shape: ModelShape, sequence_length: int, act_bytes: int = 4) -> float:
    """Elements per token and layer that the native CPU attention (miles_kernels/native, `_NativeAttention`: the
    default on a CPU where the library built) keeps beyond a fused kernel's Q, K, V, output and softmax statistics:
    its float32 output where the activations are not float32 (in float32 the output the next layer keeps is that
    tensor) and each token's sequence id (int64); it reads K and V in place (no page store, so no padding to whole
    pages). MLA's absorbed form keeps the latent once (keys are values), the absorbed queries (heads x W) and the
    output (heads x W) in the activation dtype, and none of the expanded form's K, kv_b_proj output and V
    (subtracted). In float32 elements."""
    heads, d = shape.num_attention_heads, shape.dim
    float32_out = 0.0 if act_bytes == 4 else 1.0
    seq_ids = 2.0  # one int64 per token
    if shape.is_mla:
        assert shape.kv_lora_rank is not None
        width = shape.kv_lora_rank + shape.qk_rope_head_dim
        qk = shape.qk_nope_head_dim + shape.qk_rope_head_dim
        in_act = width + 2 * heads * width
        in_act -= heads * qk + heads * (shape.qk_nope_head_dim + shape.v_head_dim) + heads * shape.v_head_dim
        return in_act * act_bytes / 4 + float32_out * heads * width + seq_ids
    return float32_out * heads * d + seq_ids


def activation_bytes(
    shape: ModelShape,
    tokens: float,
    act_bytes: int,
    recompute: str,
    layers: list[int],
    tp: int = 1,
    has_logits: bool = True,
    attention_extra: float = 0.0,
) -> int:
    """Activations kept for backward of one micro-batch of `tokens` tokens over `layers` (the layers whose
    activations are alive at once on this rank: every layer of the model under 1F1B pipelining, whose first stage
    holds pp micro-batches of L / pp layers; Korthikanti et al. section 4.2.3).
    recompute: none / selective (recomputes core attention, which a fused kernel already does: same as none) /
    full (each layer keeps its input, N x H, and one layer's full activations live during its recompute).
    Logits: N x V in the compute dtype, widened to fp32, and log_softmax's fp32 output (miles_kernels
    CausalLM.logits / token_logprobs), split over tp by a vocab-parallel head. `attention_extra`: elements per token
    and layer an unfused attention keeps besides (`blocked_attention_elements`; kept in float32)."""
    if not layers:
        return 0
    extra = attention_extra * 4 / act_bytes  # counted in act_bytes units below
    per_layer = [layer_activation_elements(shape, layer, tp) + extra for layer in layers]
    elements = len(layers) * shape.hidden_size / tp + max(per_layer) if recompute == "full" else sum(per_layer)
    out = elements * tokens * act_bytes
    if has_logits:
        out += tokens * shape.vocab_size / tp * (act_bytes + 8)
    return int(out)


def lora_layer_bytes(
    shape: ModelShape, lora: LoraSettings, tokens: float, act_bytes: int, is_deterministic: bool
) -> dict[int, float]:
    """Bytes LoRA adds to each decoder layer's saved activations in the trainer (miles_kernels.layers.Linear):
    deterministic mode runs every adapted layer with its merged weight W + s·B·A (miles_kernels.ops.linear.merge_lora,
    made in the compute dtype), which autograd keeps for the backward: one copy of each adapted weight, out x in x b.
    Fast mode runs the un-merged form x W^T + s (x A^T) B^T, which keeps x A^T (N x r x b) per adapted layer, except
    for the routed experts, whose weights the MoE block reads directly (`effective_weight`): merged in both modes."""
    out: dict[int, float] = {}
    for t in shape.lora_targets(lora.target_modules):
        assert t.layer is not None
        elements = t.numel if is_deterministic or t.is_expert else t.copies * tokens * lora.rank
        out[t.layer] = out.get(t.layer, 0.0) + elements * act_bytes
    return out


def lora_activation_bytes(
    shape: ModelShape,
    lora: LoraSettings,
    tokens: float,
    act_bytes: int,
    recompute: str,
    layers: list[int],
    *,
    is_deterministic: bool = True,
    attention_extra: float = 0.0,
) -> int:
    """What LoRA adds to `activation_bytes` of the same micro-batch over `layers` (`lora_layer_bytes` per layer,
    `layer_extra_bytes`)."""
    extra = lora_layer_bytes(shape, lora, tokens, act_bytes, is_deterministic)
    return layer_extra_bytes(shape, extra, tokens, act_bytes, recompute, layers, attention_extra=attention_extra)


def layer_extra_bytes(
    shape: ModelShape,
    extra: dict[int, float],
    tokens: float,
    act_bytes: int,
    recompute: str,
    layers: list[int],
    *,
    attention_extra: float = 0.0,
) -> int:
    """What `extra` bytes kept by each layer (`lora_layer_bytes`, `qat_layer_bytes`) add to `activation_bytes` of the
    same micro-batch over `layers`: without recompute every layer keeps its own, so their sum; with full recompute
    only the layer being recomputed holds them (the checkpointed forward keeps none), so the peak of (that layer's
    activations + its extra bytes) over the layers, less the peak of the activations alone that `activation_bytes`
    counts."""
    if recompute != "full":
        return int(sum(extra.get(layer, 0.0) for layer in layers))
    per_layer = [(layer_activation_elements(shape, layer) + attention_extra * 4 / act_bytes) * tokens * act_bytes
                 for layer in layers]  # fmt: skip
    with_extra = [value + extra.get(layer, 0.0) for value, layer in zip(per_layer, layers, strict=True)]
    return int(max(with_extra, default=0.0) - max(per_layer, default=0.0))


def dispatch_bytes(shape: ModelShape, tokens: float, act_bytes: int) -> int:
    """MoE all-to-all token buffers of one layer in flight: each token goes to top-k experts and comes back
    (dispatch and combine: 2 x N x k x H x b; Megatron-core's MoEAlltoAllTokenDispatcher permutes tokens into one
    buffer per direction, megatron/core/transformer/moe/token_dispatcher.py)."""
    if not shape.is_moe:
        return 0
    return int(2 * tokens * shape.num_experts_per_tok * shape.hidden_size * act_bytes)


def kv_bytes_per_token(shape: ModelShape, kv_bytes: int, tp: int = 1, num_layers: int | None = None) -> int:
    """KV-cache bytes of one token on one GPU over every layer. Standard attention: 2 x KV heads x head dim per layer,
    KV heads split over tp (replicated when tp > KV heads); MLA: the compressed latent kv_lora_rank +
    qk_rope_head_dim per layer, replicated on every TP rank (DeepSeek-V2, arXiv 2405.04434, section 2.1.2; SGLang's
    MLATokenToKVPool)."""
    layers = shape.num_hidden_layers if num_layers is None else num_layers
    if shape.is_mla:
        return shape.kv_elements_per_token_layer() * layers * kv_bytes
    heads = math.ceil(shape.kv_heads / tp)
    return 2 * heads * shape.dim * layers * kv_bytes


def nccl_bytes(group_sizes: list[int], channels: int, a2a_peers: int = 0) -> int:
    """NCCL's own buffers: per communicator of size > 1, one NCCL_BUFFSIZE buffer per channel to each ring neighbour
    (2 peers), plus point-to-point buffers to each all-to-all peer (NCCL env docs, NCCL_BUFFSIZE; the channel count
    is an assumption per hardware profile)."""
    rings = sum(2 * channels * NCCL_BUFFSIZE for size in group_sizes if size > 1)
    return rings + a2a_peers * NCCL_BUFFSIZE


def cuda_graph_bytes(shape: ModelShape, max_bs: int, act_bytes: int, tp: int) -> int:
    """Assumption: SGLang's CUDA graphs share one memory pool sized by the largest captured batch: its per-layer
    activations (reused layer to layer) and fp32 logits, plus ~1 GiB of graph and workspace overhead (SGLang logs
    'Capture cuda graph end ... mem usage' of about 1-3 GB on Hopper)."""
    if max_bs == 0:
        return 0
    per_token = layer_activation_elements(shape, shape.num_hidden_layers - 1, tp) * act_bytes
    return int(max_bs * (per_token + 4 * shape.vocab_size / tp) + 2**30)


def fsdp2_bytes(
    shape: ModelShape,
    world: int,
    dtype: str,
    tokens: int,
    *,
    recompute: str = "none",
    keep_reference: bool = False,
    critic: str | None = None,
    is_mtp_trained: bool = False,
    attention_extra: float = 0.0,
    lora: LoraSettings | None = None,
    is_deterministic: bool = True,
    qat: bool = False,
    offload: str = "none",
    moments_dtype: str = "float32",
) -> dict[str, int]:
    """One rank of Miles' FSDP2 backend (miles_trainer/fsdp.py) after an optimizer step, by key:
    - weights: float32 master parameters (`load_model(..., dtype=torch.float32)`), dim-0 sharded over `world`; the
      routers' frozen float32 `e_score_correction_bias` buffers (a few bytes a layer) are not parameters: left out;
      (FSDP2 `fully_shard` per decoder layer, then the root); the frozen reference copy (fp32, sharded) when
      kl_coef > 0; the separate critic's backbone (fp32, sharded) and its value head;
    - grads: fp32, sharded like the parameters, for every trained parameter (idle MTP modules have none; a separate
      critic's unused LM head has none);
    - optimizer: torch AdamW (fused): exp_avg and exp_avg_sq fp32 per trained element, plus a float32 `step` tensor
      per parameter tensor;
    - mtp: the MTP modules' own weights (fp32 shards), and their grads and AdamW state when spec.mode is online;
    - gathered: transient unsharded parameters in the compute dtype while a forward / backward runs (FSDP2 keeps the
      root's embedding / norm / head gathered and prefetches the next layer: root + 2 layers); none for one float32
      rank, which stays a plain module (`miles_trainer.fsdp_sharding.needs_fsdp`);
    - activations: `activation_bytes` for `tokens` (an estimate, not exact), with `attention_extra` elements per
      token and layer for deterministic kernels (`blocked_attention_elements`).
    With `lora` (trainer.lora, miles_trainer/lora.py `attach_adapters`) the trunk is a frozen base: weights hold it
    in `lora.base_dtype` (b_base x params / world), with no grads or optimizer state; the MTP modules keep float32
    (their own loss may train them); there is no reference copy (the KL reference is the base: the policy with its
    adapters off, `miles_kernels.disabled_adapters`); the critic is as above;
    - adapters: the LoRA adapters (`ModelShape.lora_tensors`), float32 masters sharded like every parameter; grads
      and optimizer are theirs (and gathered counts them in the compute dtype with their layer);
    - lora_activations: what the adapters add to the activations (`lora_activation_bytes`: the merged weight of each
      adapted layer in deterministic mode, x A^T in fast mode).
    With `qat` (trainer.qat, quantization-aware training; miles_trainer/qat.py):
    - qat_activations: what the fake-quantized weights add to the activations (`qat_layer_bytes`: one copy of each
      trunk linear weight in the compute dtype, kept for the backward).
    With `offload` (trainer.optimizer.offload, the policy's AdamW state in host memory; miles_trainer/host_adam.py):
    - host_optimizer: the policy's AdamW moments, `moments_dtype` (4 or 2 B per trained element, two moments) plus the
      float32 `step` per tensor, in host memory instead of `optimizer` (the critic's and the MTP draft's optimizers
      have their own settings: planned on the device);
    - host_weights, host_grads (`moments_and_master`): the policy's float32 shards (trunk, adapters, MTP modules) and
      its gradients, in host memory instead of `weights` / `adapters` / `mtp` / `grads` (FSDP2's CPUOffloadPolicy,
      which shards even one float32 rank: `gathered` counts its uploads).
    The keys do not overlap (their sum is the rank's step peak; the host_ keys' sum is its host memory); the trainer's
    own tags hold weights + adapters (`weights`) and activations + lora_activations + qat_activations (its activation
    peak). The two LoRA keys are present only with `lora`, qat_activations only with `qat`, the host_ keys only with
    `offload`."""
    b = DTYPE_BYTES[dtype]
    tensors = [t for t in shape.tensors() if not t.name.endswith(FROZEN_BUFFER)]
    trunk = [t for t in tensors if t.layer is None or t.layer < shape.num_hidden_layers]
    mtp = [t for t in tensors if t.layer is not None and t.layer >= shape.num_hidden_layers]
    adapters = shape.lora_tensors(lora.rank, lora.target_modules) if lora is not None else []
    trained = adapters if lora is not None else trunk
    base_b = DTYPE_BYTES[lora.base_dtype] if lora is not None else 4

    def shard(ts: list[Tensor]) -> int:
        return sum(shard_numel(t, world) for t in ts)

    def adam(ts: list[Tensor], moment_bytes: int = 8) -> int:  # the two moments a trained element, a step a tensor
        return moment_bytes * shard(ts) + 4 * sum(t.copies for t in ts)

    policy_optimizer = adam(trained, 2 * DTYPE_BYTES[moments_dtype])
    out = {"weights": base_b * shard(trunk), "grads": 4 * shard(trained), "optimizer": 0}
    if lora is not None:
        out["adapters"] = 4 * shard(adapters)
    out["mtp"] = 4 * shard(mtp) + ((4 * shard(mtp) + adam(mtp)) if is_mtp_trained else 0)
    if offload == "none":
        out["optimizer"] = policy_optimizer
    else:
        host = {"host_optimizer": policy_optimizer}
        if offload == "moments_and_master":  # every shard of the policy model, and its gradients
            host["host_weights"] = out["weights"] + out.pop("adapters", 0) + 4 * shard(mtp)
            host["host_grads"] = out["grads"] + (4 * shard(mtp) if is_mtp_trained else 0)
            out["weights"], out["grads"] = 0, 0  # the MTP modules' AdamW (spec.optimizer's) stays on the device
            out["mtp"] = adam(mtp) if is_mtp_trained else 0
            if lora is not None:
                out["adapters"] = 0
    if keep_reference and lora is None:  # a LoRA run's reference is its base (the policy with adapters off)
        out["weights"] += 4 * shard(tensors)
    if critic == "separate":
        used = [t for t in trunk if t.name != "lm_head.weight"]
        head = [Tensor("value_head.score.weight", (1, shape.hidden_size), 1, None, False)]
        bias = [Tensor("value_head.score.bias", (1,), 1, None, False)]
        out["weights"] += 4 * (shard(tensors) + shard(head + bias))
        out["grads"] += 4 * shard(used + head + bias)
        out["optimizer"] += adam(used + head + bias)
    elif critic == "value_head":
        out["weights"] += 4 * (shape.hidden_size + 1)
        out["grads"] += 4 * (shape.hidden_size + 1)
        out["optimizer"] += 8 * (shape.hidden_size + 1) + 8
    needs_fsdp = world > 1 or dtype != "float32" or offload == "moments_and_master"
    gathered = 0
    if needs_fsdp:
        root = sum(t.numel for t in tensors if t.layer is None)
        units = [*tensors, *adapters]
        largest = max(sum(t.numel for t in units if t.layer == i) for i in range(shape.num_hidden_layers))
        gathered = (root + 2 * largest) * b
    out["gathered"] = gathered
    layers = list(range(shape.num_hidden_layers)) + (list(shape.mtp_layers()) if is_mtp_trained else [])
    out["activations"] = activation_bytes(shape, tokens, b, recompute, layers, attention_extra=attention_extra)
    if lora is not None:
        out["lora_activations"] = lora_activation_bytes(
            shape, lora, tokens, b, recompute, layers, is_deterministic=is_deterministic,
            attention_extra=attention_extra,
        )  # fmt: skip
    if qat:
        out["qat_activations"] = layer_extra_bytes(
            shape, qat_layer_bytes(shape, b), tokens, b, recompute, layers, attention_extra=attention_extra
        )
    if critic == "separate":
        out["activations"] += activation_bytes(
            shape, tokens, b, recompute, layers, has_logits=False, attention_extra=attention_extra
        )
    return out if offload == "none" else out | host


def engine_weight_bytes(shape: ModelShape, dtype: str, quant: WeightQuantSettings | None = None) -> int:
    """The rollout engine's weights: every parameter in the kernel dtype (`load_model(dir, kernel)`, MTP modules
    included, tied tensors once; the routers' float32 score-correction biases are buffers, left out), except, with
    `quant`, the decoder trunk's linear weights (`ModelShape.trunk_linears`: attention / MLA projections, dense and
    shared MLPs, every routed expert), stored in its format (`quantized_weight_bytes`; their biases, the embedding,
    LM head, norms, routers and MTP layers stay in the kernel dtype: miles_kernels/quantization.py)."""
    b = DTYPE_BYTES[dtype]
    out = sum(t.numel for t in shape.tensors() if not t.name.endswith(FROZEN_BUFFER)) * b
    if quant is None:
        return out
    check_weight_format(shape, quant)
    for t in shape.trunk_linears():
        out += t.copies * quantized_weight_bytes(quant, *t.shape) - t.numel * b
    return out


def weight_sync_bytes(shape: ModelShape, dtype: str, quant: WeightQuantSettings | None = None) -> int:
    """Bytes a full weight sync sends (miles_trainer/weight_sender.py, `export_layout`): the engine's weights as it
    stores them (`engine_weight_bytes`), plus the routers' float32 score-correction biases, which are synced as they
    are. The same bytes make its buckets and the /dev/shm weights file of a same-node engine."""
    biases = sum(t.numel for t in shape.tensors() if t.name.endswith(FROZEN_BUFFER))
    return engine_weight_bytes(shape, dtype, quant) + 4 * biases


# Columns per panel of the native CPU GEMM's packed weights on AVX-512 (16 on AVX2, 8 generic: each divides it, so
# this width bounds theirs from above)
NATIVE_PANEL_WIDTH = 32


def native_packed_bytes(
    shape: ModelShape,
    dtype: str,
    *,
    has_draft: bool = False,
    weight_quant: WeightQuantSettings | None = None,
    panel_width: int = NATIVE_PANEL_WIDTH,
) -> int:
    """The float32 copies of its weights that the embedded engine's native CPU linear keeps packed
    (miles_kernels.hold_packed_weights): 4 B x in x (out rounded up to whole panels of `panel_width` columns) for
    each weight it multiplies: the trunk's linear layers (`trunk_linears`; not with `weight_quant`: those run
    dequantized copies made per call), every router that is a linear layer or, in float32, GLM-4.5 / DeepSeek-V3's
    (run in float32), the LM head (the embedding when tied) and, with `has_draft`, MTP module 0's layers.
    MLA's kv_b_proj counts whole: the absorbed attention packs its value rows, and its key rows per call."""

    def packed(t: Tensor) -> int:
        out_features, in_features = t.shape
        return t.copies * 4 * in_features * -(-out_features // panel_width) * panel_width

    routers = shape.model_type == "qwen3_moe" or dtype == "float32"
    last_layer = shape.num_hidden_layers + (1 if has_draft and shape.num_nextn_predict_layers else 0)
    trunk = {(t.name, t.layer) for t in shape.trunk_linears()} if weight_quant is not None else set()
    weights = [
        t for t in shape.tensors()
        if t.layer is not None and t.layer < last_layer and len(t.shape) == 2 and (t.name, t.layer) not in trunk
        and (routers or t.name != "mlp.gate.weight")
    ]  # fmt: skip
    head = Tensor("lm_head.weight", (shape.vocab_size, shape.hidden_size), 1, None, False)
    return sum(packed(t) for t in [*weights, head])


def embedded_engine_bytes(
    shape: ModelShape,
    dtype: str,
    num_kv_pages: int,
    page_size: int,
    *,
    has_draft: bool = False,
    lora: LoraSettings | None = None,
    weight_quant: WeightQuantSettings | None = None,
    packed_width: int | None = None,
) -> dict[str, int]:
    """Miles' embedded rollout engine (miles_rollout/scheduler.py, miles_kernels/kv_cache.py), by key:
    - weights: `engine_weight_bytes`: every parameter in the kernel dtype (MTP modules included, tied tensors once),
      the trunk's linear weights in `weight_quant`'s format when given (rollout.engine.weight_dtype); with
      `packed_width` (a CPU engine on the native linear: panel width 32 on AVX-512) also `native_packed_bytes`,
      held from the first forward on and released with the weights;
    - lora (only with `lora`): a LoRA policy's adapters (`add_lora`: lora_A and lora_B in the kernel dtype) and the
      merged weight W + s·B·A of each adapted layer that `fold_adapters` keeps beside the base (kernel dtype); the
      engine's own `weights` tag holds weights + lora;
    - kv_cache: `KVStore.allocate`: per layer (plus MTP module 0's layer when it drafts) K and V of shape
      (num_kv_pages, KV heads, page_size, head dim) in the kernel dtype; under MLA one latent store of shape
      (num_kv_pages, 1, page_size, kv_lora_rank + qk_rope_head_dim), K and V at once."""
    b = DTYPE_BYTES[dtype]
    layers = shape.num_hidden_layers + (1 if has_draft else 0)
    kv = layers * num_kv_pages * page_size * kv_bytes_per_token(shape, b, num_layers=1)
    weights = engine_weight_bytes(shape, dtype, weight_quant)
    if packed_width is not None:
        weights += native_packed_bytes(shape, dtype, has_draft=has_draft, weight_quant=weight_quant,
                                       panel_width=packed_width)  # fmt: skip
    out = {"weights": weights, "kv_cache": kv}
    if lora is not None:
        adapters = sum(t.numel for t in shape.lora_tensors(lora.rank, lora.target_modules))
        out["lora"] = (adapters + sum(t.numel for t in shape.lora_targets(lora.target_modules))) * b
    return out
