"""Low-precision weight formats as ops: `quantize` a weight into the parts a Hugging Face checkpoint stores,
`dequantize` them back, `fake_quantize` (quantization-aware training), and INT4 packing. The formats, and why the
engine and a QAT trainer get the same bits, are in miles_kernels/quantization.py (the model-level side: which layers,
loading, weight sync).

Formats (O out features, K in features; a zero block or group gets scale 1, which represents it exactly):
- fp8_block: `weight` (O, K) float8_e4m3fn and `weight_scale_inv` (ceil(O/bo), ceil(K/bk)) float32, W = q * s per
  (bo, bk) block; s = amax|W_block| / 448 (e4m3's largest finite value), q = W / s rounded to nearest even.
- fp8_channel: `weight` (O, K) float8_e4m3fn and `weight_scale` (O, 1) float32: one block per output row.
- int4_group: `weight_packed` (O, K/8) int32, `weight_scale` (O, K/g) bfloat16 and `weight_shape` (2,) int64;
  s = amax|W_group| / 7 rounded to bfloat16, q = clamp(round(W / s), -8, 7); packed as compressed-tensors'
  `pack_to_int32`: q + 8 as an unsigned nibble, value j of every eight at bits 4j..4j+3.
`dequantize` is elementwise: `q * s` in float32, then the requested dtype.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch
import torch.nn.functional as F

from miles_kernels.config import WeightQuantConfig

FP8_MAX = 448.0  # float8_e4m3fn's largest finite value
INT4_MIN, INT4_MAX = -8, 7
INT4_PER_INT32 = 8
# each format's stored parts, under the layer's name (`q_proj.weight_scale_inv`)
PARTS_OF = {
    "fp8_block": ("weight", "weight_scale_inv"),
    "fp8_channel": ("weight", "weight_scale"),
    "int4_group": ("weight_packed", "weight_scale", "weight_shape"),
}


def part_layout(config: WeightQuantConfig, shape: tuple[int, ...]) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """The stored parts of an (O, K) weight in `config`'s format: part name -> (shape, dtype). ValueError when the
    weight cannot take the format (int4_group: K must be a multiple of the group size)."""
    out_features, in_features = shape
    if config.format == "fp8_block":
        rows, cols = config.block_size
        scales = (math.ceil(out_features / rows), math.ceil(in_features / cols))
        return {"weight": (shape, torch.float8_e4m3fn), "weight_scale_inv": (scales, torch.float32)}
    if config.format == "fp8_channel":
        return {"weight": (shape, torch.float8_e4m3fn), "weight_scale": ((out_features, 1), torch.float32)}
    if config.format == "int4_group":
        if in_features % config.group_size:
            raise ValueError(
                f"int4_group with group_size={config.group_size}: a linear layer has {in_features} input features, "
                "not a multiple of it; choose a group size that divides every layer's input size"
            )
        return {
            "weight_packed": ((out_features, in_features // INT4_PER_INT32), torch.int32),
            "weight_scale": ((out_features, in_features // config.group_size), torch.bfloat16),
            "weight_shape": ((2,), torch.int64),
        }
    raise ValueError(f"weight format {config.format!r} stores no quantized parts")


def _per_element(scale: torch.Tensor, rows: int, cols: int, shape: tuple[int, ...]) -> torch.Tensor:
    """A (blocks, blocks) scale grid spread over the (O, K) elements its blocks cover."""
    return scale.repeat_interleave(rows, 0).repeat_interleave(cols, 1)[: shape[0], : shape[1]]


def _fp8(w: torch.Tensor, rows: int, cols: int) -> tuple[torch.Tensor, torch.Tensor]:
    out_features, in_features = w.shape
    padded = F.pad(w.abs(), (0, -in_features % cols, 0, -out_features % rows))  # zeros never raise a block's max
    amax = padded.view(padded.shape[0] // rows, rows, padded.shape[1] // cols, cols).amax(dim=(1, 3))
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    q = (w / _per_element(scale, rows, cols, w.shape)).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q, scale


def quantize(config: WeightQuantConfig, weight_OK: torch.Tensor) -> dict[str, torch.Tensor]:
    """The stored parts of `weight` in `config`'s format (see the module docstring), computed in float32 from its
    values as given (a caller wanting the engine's bits passes the weight in the kernel dtype)."""
    part_layout(config, tuple(weight_OK.shape))  # the shape check
    w = weight_OK.detach().to(torch.float32)
    if config.format == "fp8_block":
        q, scale = _fp8(w, *config.block_size)
        return {"weight": q, "weight_scale_inv": scale}
    if config.format == "fp8_channel":
        q, scale = _fp8(w, 1, w.shape[1])
        return {"weight": q, "weight_scale": scale}
    out_features, in_features = w.shape
    groups = w.view(out_features, in_features // config.group_size, config.group_size)
    amax = groups.abs().amax(dim=-1)
    scale = torch.where(amax > 0, amax / INT4_MAX, torch.ones_like(amax)).to(torch.bfloat16)
    q = torch.round(groups / scale.float()[..., None]).clamp(INT4_MIN, INT4_MAX).view(out_features, in_features)
    shape = torch.tensor([out_features, in_features], dtype=torch.int64, device=w.device)
    return {"weight_packed": pack_int4(q.to(torch.int8)), "weight_scale": scale, "weight_shape": shape}


def dequantize(config: WeightQuantConfig, parts: Mapping[str, torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
    """The (O, K) weight the stored `parts` represent, computed in float32 and cast to `dtype`."""
    if config.format == "fp8_block":
        q, scale = parts["weight"], parts["weight_scale_inv"]
        return (q.to(torch.float32) * _per_element(scale.float(), *config.block_size, tuple(q.shape))).to(dtype)
    if config.format == "fp8_channel":
        return (parts["weight"].to(torch.float32) * parts["weight_scale"].float()).to(dtype)
    packed, scale = parts["weight_packed"], parts["weight_scale"].float()
    in_features = packed.shape[1] * INT4_PER_INT32
    q = unpack_int4(packed, in_features).to(torch.float32)
    groups = q.view(q.shape[0], scale.shape[1], in_features // scale.shape[1]) * scale[..., None]
    return groups.view(q.shape).to(dtype)


def pack_int4(q_OK: torch.Tensor) -> torch.Tensor:
    """int8 values in [-8, 7] (O, K), K a multiple of 8, as compressed-tensors packs them: (O, K/8) int32."""
    nibbles = (q_OK.to(torch.int64) + 8).view(q_OK.shape[0], -1, INT4_PER_INT32)
    shifts = torch.arange(INT4_PER_INT32, device=q_OK.device, dtype=torch.int64) * 4
    words = (nibbles << shifts).sum(dim=-1)  # < 2**32: no overflow in int64
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)  # the same 32 bits, signed


def unpack_int4(packed_OW: torch.Tensor, in_features: int) -> torch.Tensor:
    """`pack_int4`'s inverse: (O, K) int8 in [-8, 7]."""
    words = packed_OW.to(torch.int64) & 0xFFFFFFFF
    shifts = torch.arange(INT4_PER_INT32, device=packed_OW.device, dtype=torch.int64) * 4
    nibbles = (words[..., None] >> shifts) & 0xF
    return (nibbles - 8).view(packed_OW.shape[0], -1)[:, :in_features].to(torch.int8)


class _FakeQuantize(torch.autograd.Function):
    """Forward: the engine's dequantized weight, exactly; backward: the straight-through estimator (the gradient
    reaches the master weight unchanged: symmetric absmax scales clip nothing)."""

    @staticmethod
    def forward(ctx: Any, weight: torch.Tensor, config: WeightQuantConfig) -> torch.Tensor:  # type: ignore[override]
        return dequantize(config, quantize(config, weight), weight.dtype)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:  # type: ignore[override]
        return grad, None


def fake_quantize(config: WeightQuantConfig, weight: torch.Tensor) -> torch.Tensor:
    """`dequantize(quantize(weight))` in the weight's dtype, with straight-through gradients: what a QAT forward
    multiplies by."""
    out: torch.Tensor = _FakeQuantize.apply(weight, config)
    return out
