"""Low-precision linear weights: FP8 (block-scaled as DeepSeek-V3 ships it, or per channel) and INT4 (group-wise,
packed as compressed-tensors' `pack-quantized`), in the layouts Hugging Face checkpoints store (`WeightQuantConfig`
in config.py), for the rollout engine, which stores the decoder's linear layers quantized and computes with them
dequantized, and for quantization-aware training, whose forward runs the same dequantized weights.

True on-policy with a low-precision rollout: `quantize` is a deterministic function of a weight's values (a scale
is a block's largest magnitude over a constant: exact), and `dequantize` is elementwise (`q * scale` in float32, then
the kernel dtype). The engine computes `linear(x, dequantize(quantize(W)))` with the W the trainer sent; the QAT
trainer computes `linear(x, fake_quantize(W))`, the same function of the same W (gradients pass straight through to
W), through the same batch-invariant matmul: their log-probs are equal bit for bit.

The formats and their ops (`quantize`, `dequantize`, `fake_quantize`) are in ops/quant.py; this module is the model
level: which layers, storing them quantized, what a weight sync sends, loading quantized checkpoints.
The LM head, embeddings, norms, routers and MTP layers stay in the kernel dtype (`CausalLM.trunk_linears`).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from typing import TYPE_CHECKING

import torch
from torch import nn

from miles_kernels.config import WeightQuantConfig
from miles_kernels.layers import Linear
from miles_kernels.ops.quant import PARTS_OF, dequantize, part_layout, quantize

if TYPE_CHECKING:
    from miles_kernels.model import CausalLM


def store_quantized(layer: Linear, config: WeightQuantConfig, parts: Mapping[str, torch.Tensor] | None = None) -> None:
    """Replace the layer's weight by its stored parts (`parts`, or the quantized current weight), frozen parameters
    under the checkpoint's names: loaded, synced, released and checksummed like any weight."""
    if layer.lora_A is not None or layer.fake_quant is not None:
        raise ValueError("a layer with LoRA adapters or fake quantization cannot store quantized weights")
    parts = quantize(config, layer.weight.to(layer.kernel.torch_dtype)) if parts is None else parts
    del layer.weight
    for name, tensor in parts.items():
        layer.register_parameter(name, nn.Parameter(tensor, requires_grad=False))
    layer.weight_quant = config


def quantize_model(model: CausalLM, config: WeightQuantConfig, from_weights: bool = True) -> list[str]:
    """Store the decoder's trunk linear layers (attention, MLP, experts, MLA projections) in `config`'s format: their
    current weights quantized (the kernel dtype's values), or zeroed parts to load into (`from_weights=False`).
    Returns the layers' names."""
    layers = check_format(model, config)
    for layer in layers.values():
        parts = None
        if not from_weights:
            layout = part_layout(config, (layer.out_features, layer.in_features))
            device = layer.weight.device
            parts = {name: torch.zeros(shape, dtype=dtype, device=device) for name, (shape, dtype) in layout.items()}
            if "weight_shape" in parts:
                parts["weight_shape"] = torch.tensor([layer.out_features, layer.in_features], device=device)
        store_quantized(layer, config, parts)
    return list(layers)


def fake_quantize_model(model: CausalLM, config: WeightQuantConfig) -> list[str]:
    """Quantization-aware training: the trunk linear layers the engine stores quantized compute with
    `fake_quantize(weight)`. Returns their names."""
    layers = check_format(model, config)
    for layer in layers.values():
        if layer.lora_A is not None:
            raise ValueError("quantization-aware training with LoRA adapters is not supported")
        layer.fake_quant = config
    return list(layers)


def check_format(model: CausalLM, config: WeightQuantConfig) -> dict[str, Linear]:
    """The trunk's linear layers (`CausalLM.trunk_linears`), once every one can take `config`'s format; else a
    ValueError naming the first that cannot and a group size that every layer takes."""
    layers = model.trunk_linears()
    for name, layer in layers.items():
        try:
            part_layout(config, (layer.out_features, layer.in_features))
        except ValueError as error:
            sizes = [m.in_features for m in layers.values()]
            fits = [g for g in (128, 64, 32, 16, 8) if all(size % g == 0 for size in sizes)]
            hint = f"group_size={fits[0]} fits every layer" if fits else "no group size fits every layer"
            raise ValueError(f"{name}: {error} ({hint})") from None
    return layers


def quantized_layers(model: nn.Module) -> dict[str, Linear]:
    """The model's linear layers stored quantized, by name."""
    return {n: m for n, m in model.named_modules() if isinstance(m, Linear) and m.weight_quant is not None}


class WeightQuantizer:
    """The sending side of a quantized weight sync: the weight of each named layer goes out as its stored parts in
    `config`'s format, quantized from the tensor being sent (already in the engine's kernel dtype), so the engine
    receives a half (FP8 of bf16) or about a quarter (INT4) of the bytes and loads them as they are."""

    def __init__(self, config: WeightQuantConfig, layer_names: Iterable[str]) -> None:
        self.config = config
        self.weights = {f"{name}.weight": name for name in layer_names}

    def layout(
        self, name: str, shape: tuple[int, ...], dtype: torch.dtype
    ) -> list[tuple[str, tuple[int, ...], torch.dtype]]:
        """What `parts(name, tensor)` sends for a tensor of this shape and dtype: (name, shape, dtype) each."""
        layer = self.weights.get(name)
        if layer is None:
            return [(name, shape, dtype)]
        return [(f"{layer}.{part}", s, d) for part, (s, d) in part_layout(self.config, shape).items()]

    def parts(self, name: str, tensor: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
        """(name, tensor) as sent: a quantized layer's weight as its parts, anything else unchanged."""
        layer = self.weights.get(name)
        if layer is None:
            return [(name, tensor)]
        return [(f"{layer}.{part}", value) for part, value in quantize(self.config, tensor).items()]


def normalized_items(
    model: CausalLM, items: Iterable[tuple[str, torch.Tensor]], source: WeightQuantConfig | None = None
) -> Iterator[tuple[str, torch.Tensor]]:
    """Checkpoint or weight-update tensors under names the model holds: a full-precision weight of a layer the model
    stores quantized is quantized (after the cast to the kernel dtype, as a sender would); the stored parts of a
    `source`-quantized checkpoint go in as they are where the layer stores that format, else dequantized into the
    layer's weight. ValueError when a layer's parts are incomplete."""
    stored = quantized_layers(model)
    dtype = model.kernel.torch_dtype
    pending: dict[str, dict[str, torch.Tensor]] = {}
    needed = set(PARTS_OF[source.format]) if source is not None and source.is_enabled else set()
    for name, tensor in items:
        layer_name, _, part = name.rpartition(".")
        layer = stored.get(layer_name)
        is_full = part == "weight" and tensor.dtype != torch.float8_e4m3fn
        if is_full and layer is not None:
            assert layer.weight_quant is not None
            yield from ((f"{layer_name}.{p}", v) for p, v in quantize(layer.weight_quant, tensor.to(dtype)).items())
            continue
        if part not in needed or is_full:
            yield name, tensor
            continue
        parts = pending.setdefault(layer_name, {})
        parts[part] = tensor
        if set(parts) != needed:
            continue
        del pending[layer_name]
        assert source is not None
        if layer is not None and layer.weight_quant == source:
            yield from ((f"{layer_name}.{p}", v) for p, v in parts.items())
        elif layer is not None:
            assert layer.weight_quant is not None
            full = dequantize(source, parts, torch.float32).to(dtype)
            yield from ((f"{layer_name}.{p}", v) for p, v in quantize(layer.weight_quant, full).items())
        else:
            yield f"{layer_name}.weight", dequantize(source, parts, torch.float32)
    if pending:
        layer_name, parts = next(iter(pending.items()))
        raise ValueError(
            f"{source.format if source else ''} layer {layer_name!r} has parts {sorted(parts)} but not "
            f"{sorted(needed - set(parts))}: a quantized checkpoint stores every part of a layer"
        )
