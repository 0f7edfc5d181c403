"""Low-precision rollout as the memory planner sees it (torch-free; miles_kernels/quantization.py, ops/quant.py): the
engine stores the decoder trunk's linear layers (`ModelShape.trunk_linears`) in a low-precision format
(rollout.engine.weight_dtype), so its weights and what a weight sync sends shrink; quantization-aware training
(trainer.qat) makes the trainer's forward compute with each such weight fake-quantized, a copy autograd keeps.
The engine and sync terms that use these are in plan_formulas.py.
"""

from __future__ import annotations

import math
from typing import NamedTuple

from miles_memory.model_shape import ModelShape

__all__ = [
    "WEIGHT_FORMATS",
    "WeightQuantSettings",
    "check_weight_format",
    "dequantized_bytes",
    "qat_layer_bytes",
    "quantized_weight_bytes",
]

# rollout.engine.weight_dtype (miles_kernels.config.WeightFormat): kernel stores the kernel dtype
WEIGHT_FORMATS = ("kernel", "fp8_block", "fp8_channel", "int4_group")


class WeightQuantSettings(NamedTuple):
    """A low-precision rollout engine's weights as the planner needs them (rollout.engine.weight_dtype other than
    kernel, weight_block_size, weight_group_size; miles_kernels.config.WeightQuantConfig): the decoder trunk's linear
    layers (`ModelShape.trunk_linears`) are stored in `format`, everything else in the kernel dtype."""

    format: str  # fp8_block, fp8_channel or int4_group
    block_size: tuple[int, int] = (128, 128)
    group_size: int = 128

    def describe(self) -> str:
        """The format and what a weight costs in it, in words."""
        if self.format == "fp8_block":
            rows, cols = self.block_size
            return f"fp8_block (1 B/param + fp32 scale per {rows}x{cols} block)"
        if self.format == "fp8_channel":
            return "fp8_channel (1 B/param + fp32 scale per output channel)"
        return f"int4_group (0.5 B/param + bf16 scale per {self.group_size} inputs + int64[2] shape)"

    def formula(self) -> str:
        """`quantized_weight_bytes` of an (O, K) weight as a formula."""
        if self.format == "fp8_block":
            rows, cols = self.block_size
            return f"O*K + 4*ceil(O/{rows})*ceil(K/{cols}) per linear weight (O, K)"
        if self.format == "fp8_channel":
            return "O*K + 4*O per linear weight (O, K)"
        return f"O*K/2 + 2*O*K/{self.group_size} + 16 per linear weight (O, K)"


def quantized_weight_bytes(quant: WeightQuantSettings, out_features: int, in_features: int) -> int:
    """Bytes of one (O, K) linear weight stored in `quant`'s format: its parts as miles_kernels/ops/quant.py
    (`part_layout`) lays them out, the way Hugging Face checkpoints store them:
    - fp8_block: `weight` O x K float8 (1 B) + `weight_scale_inv` ceil(O / bo) x ceil(K / bk) float32;
    - fp8_channel: `weight` O x K float8 + `weight_scale` O x 1 float32;
    - int4_group: `weight_packed` O x K/8 int32 (eight int4 values each: K/2 B a row) + `weight_scale` O x K/g
      bfloat16 + `weight_shape` int64[2] (K a multiple of g: `check_weight_format`)."""
    o, k = out_features, in_features
    if quant.format == "fp8_block":
        rows, cols = quant.block_size
        return o * k + 4 * math.ceil(o / rows) * math.ceil(k / cols)
    if quant.format == "fp8_channel":
        return o * k + 4 * o
    if quant.format == "int4_group":
        if k % quant.group_size:
            raise ValueError(f"int4_group: {k} input features are not a multiple of group_size={quant.group_size}")
        return 4 * o * (k // 8) + 2 * o * (k // quant.group_size) + 16  # packed int32, bf16 scales, int64[2] shape
    raise ValueError(f"weight format {quant.format!r} is not one of {', '.join(WEIGHT_FORMATS[1:])}")


def check_weight_format(shape: ModelShape, quant: WeightQuantSettings) -> None:
    """ValueError naming the first trunk linear layer that cannot take `quant`'s format (int4_group: its input size
    must be a multiple of the group size) and a group size every layer takes (miles_kernels.check_format's rule)."""
    if quant.format != "int4_group":
        return
    layers = shape.trunk_linears()
    for t in layers:
        if t.shape[1] % quant.group_size:
            fits = [g for g in (128, 64, 32, 16, 8) if all(w.shape[1] % g == 0 for w in layers)]
            hint = f"weight_group_size={fits[0]} fits every layer" if fits else "no group size fits every layer"
            layer = f"model.layers.{t.layer}.{t.name.removesuffix('.weight')}"
            raise ValueError(
                f"rollout.engine.weight_dtype=int4_group with rollout.engine.weight_group_size={quant.group_size}: "
                f"{layer} has {t.shape[1]} input features, not a multiple of it ({hint})"
            )


def dequantized_bytes(shape: ModelShape, act_bytes: int) -> int:
    """The most dequantized weights a low-precision engine holds at once in a forward (transient, in the kernel dtype:
    `Linear.effective_weight` dequantizes a stored weight at each call): one weight at a time in attention and dense
    MLPs, but an MoE layer dequantizes every routed expert's gate, up and down weights before it runs any
    (miles_kernels/sparse_moe.py, `SparseMoE.forward`). A kernel-dtype engine computes with its parameters: none."""
    single = max((t.numel // t.copies for t in shape.trunk_linears()), default=0)
    experts: dict[int | None, int] = {}
    for t in shape.trunk_linears():
        if t.is_expert:
            experts[t.layer] = experts.get(t.layer, 0) + t.numel
    return max([single, *experts.values()]) * act_bytes


def qat_layer_bytes(shape: ModelShape, act_bytes: int) -> dict[int, float]:
    """Bytes quantization-aware training (trainer.qat; miles_kernels.fake_quantize_model) adds to each decoder layer's
    saved activations in the trainer: every trunk linear layer computes with `fake_quantize(weight)`, a new tensor in
    the compute dtype that the matmul keeps for its backward (as LoRA's merged weights in deterministic mode), so one
    copy of each quantized weight, out x in x b, in either kernel mode; the routed experts' all, as the MoE block
    reads every expert's weight."""
    out: dict[int, float] = {}
    for t in shape.trunk_linears():
        assert t.layer is not None
        out[t.layer] = out.get(t.layer, 0.0) + t.numel * act_bytes
    return out
