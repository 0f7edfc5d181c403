"""The basic modules of the model (model.py, latent_attention.py, sparse_moe.py, eagle3.py): an RMSNorm, a linear
layer and a SwiGLU MLP under Hugging Face's parameter names, each running miles' kernel op with the model's
`KernelConfig`."""

from __future__ import annotations

from typing import Any, Protocol

import torch
from torch import nn

from miles_kernels.config import KernelConfig, WeightQuantConfig
from miles_kernels.ops.activation import swiglu
from miles_kernels.ops.linear import linear, merge_lora
from miles_kernels.ops.norm import rms_norm
from miles_kernels.ops.quant import PARTS_OF, dequantize, fake_quantize


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float, kernel: KernelConfig | None = None) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps, self.kernel = eps, kernel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps, self.kernel)


class Linear(nn.Module):
    """A linear layer (HF `nn.Linear` parameter names) that runs miles' kernel, optionally with a LoRA adapter
    (lora.py: `lora_A` (R, K), `lora_B` (O, R), `lora_scaling`, PEFT's names) and adapters served per request, or
    with low-precision weights (quantization.py): stored quantized (`weight_quant`, the engine: the checkpoint's
    parts replace `weight`), or fake-quantized in the forward (`fake_quant`, quantization-aware training)."""

    def __init__(self, in_features: int, out_features: int, bias: bool, kernel: KernelConfig) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features))
        self.bias = nn.Parameter(torch.zeros(out_features)) if bias else None
        self.kernel = kernel
        self.lora_A: nn.Parameter | None = None
        self.lora_B: nn.Parameter | None = None
        self.lora_scaling = 0.0
        self.lora_disabled = False  # the base alone (lora.disabled_adapters: a LoRA run's KL reference)
        # The engine's merged weight (lora.fold_adapters, once per adapter update); None: merged when used.
        self.folded: torch.Tensor | None = None
        # Adapters chosen per request (the engine's multi-LoRA serving, lora_serving.py), under this layer's name.
        self.served: ServedAdapters | None = None
        self.served_name = ""
        self.weight_quant: WeightQuantConfig | None = None  # stored in this format (quantization.store_quantized)
        self.fake_quant: WeightQuantConfig | None = None  # QAT: computes with the weight as the engine stores it

    def effective_weight(self) -> torch.Tensor:
        """The weight this layer computes with: the base, or base + scaling * B @ A with an adapter (lora.py); with
        low-precision weights, the stored parts dequantized to the kernel dtype (or, in QAT, the weight
        fake-quantized the same way)."""
        if self.weight_quant is not None:
            parts = {n: p for n in PARTS_OF[self.weight_quant.format] if (p := self._parameters[n]) is not None}
            return dequantize(self.weight_quant, parts, self.kernel.torch_dtype)
        if self.fake_quant is not None:
            return fake_quantize(self.fake_quant, self.weight)
        if self.lora_A is None or self.lora_disabled:
            return self.weight
        if self.folded is not None:
            return self.folded
        assert self.lora_B is not None
        return merge_lora(self.weight, self.lora_A, self.lora_B, self.lora_scaling, self.kernel)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if (
            self.lora_A is not None
            and self.folded is None
            and not self.lora_disabled
            and not self.kernel.is_deterministic
        ):
            # Fast mode: the un-merged form, x W^T + scaling * (x A^T) B^T (no merged weight is made)
            assert self.lora_B is not None
            out = linear(x, self.weight, self.kernel, self.bias)
            out = out + self.lora_scaling * linear(linear(x, self.lora_A, self.kernel), self.lora_B, self.kernel)
        else:
            out = linear(x, self.effective_weight(), self.kernel, self.bias)
        if self.served is not None:
            out = self.served.apply(self.served_name, x, out)
        return out

    def _apply(self, fn: Any, recurse: bool = True) -> Linear:
        """Stored quantized parts follow device moves, never dtype casts (a float32 scale cast to bfloat16 would
        round)."""
        if self.weight_quant is None:
            return super()._apply(fn, recurse)  # type: ignore[no-untyped-call,no-any-return]
        # `.data`: the stored tensors themselves (torch converts a parameter in place, through `param.data = ...`)
        before = {name: p.data for name, p in self._parameters.items() if p is not None}
        out = super()._apply(fn, recurse)  # type: ignore[no-untyped-call]
        for name, old in before.items():
            new = self._parameters[name]
            if new is not None and new.dtype != old.dtype:
                self._parameters[name] = nn.Parameter(old.to(new.device), requires_grad=False)
        return out  # type: ignore[no-any-return]


class ServedAdapters(Protocol):
    """Per-request adapters of a serving engine (miles_kernels.lora_serving.AdapterSlots): adds each row's adapter
    output to a layer's `out`."""

    def apply(self, layer: str, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor: ...


class MLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int, kernel: KernelConfig) -> None:
        super().__init__()
        self.gate_proj = Linear(hidden, intermediate, False, kernel)
        self.up_proj = Linear(hidden, intermediate, False, kernel)
        self.down_proj = Linear(intermediate, hidden, False, kernel)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.down_proj(swiglu(self.gate_proj(x), self.up_proj(x)))
        return out
