"""Low-precision rollout on the trainer's side (docs/low-precision.md): the engine stores the trunk's linear layers in
a low-precision format (`rollout.engine.weight_dtype`; miles_kernels/quantization.py), so weight sync sends them
quantized, and quantization-aware training (`trainer.qat`) makes the trainer's forward compute with the same
dequantized weights (`miles_kernels.fake_quantize`, straight-through gradients to the float32 masters): its log-probs
then equal the quantized engine's bit for bit. Without QAT the quantization is an off-policy gap between the rollout's
log-probs and the trainer's, measured and corrected by TIS / MIS (`trainer.loss.is_mode`)."""

from __future__ import annotations

from miles_kernels import CausalLM, WeightQuantizer, check_format, fake_quantize_model
from miles_kernels.config import WeightQuantConfig


def attach_quantization(
    model: CausalLM, weight_quant: WeightQuantConfig | None, qat: bool, has_lora: bool
) -> WeightQuantizer | None:
    """What weight sync quantizes for an engine storing `weight_quant` (None: kernel-dtype weights), after making
    `model`'s forward fake-quantize with it when `qat`. ValueError for a combination that cannot run."""
    if weight_quant is None or not weight_quant.is_enabled:
        if qat:
            raise ValueError("qat (quantization-aware training) needs the format the engine stores (weight_quant)")
        return None
    if has_lora:
        raise ValueError("a quantized engine (weight_quant) with LoRA adapters is not supported")
    layers = check_format(model, weight_quant)
    if qat:
        fake_quantize_model(model, weight_quant)
    return WeightQuantizer(weight_quant, layers)
