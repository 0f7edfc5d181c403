"""LoRA on the FSDP2 trainer (docs/lora.md): adapters (miles_kernels.lora) on a frozen base, the weights a LoRA run
syncs, and its export in PEFT's format.

The base is frozen (no gradient, no optimizer state, no checkpoint bytes) and optionally held in bfloat16
(`LoraTrainConfig.base_dtype`); the adapters are float32 masters like every trained weight. In deterministic mode the
model's linear layers run the merged weight `W + scaling * B @ A` (miles_kernels.ops.linear.merge_lora), gradients
reaching A and B through the merge; the engine merges each adapter update with the same function, so the log-prob
mismatch stays 0. Weight sync sends only what trains (`TrainedWeights`: the adapters, and MTP layers trained online),
the engine keeping its base.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch

from miles_kernels import CausalLM, KernelConfig, add_lora, is_adapter_name
from miles_trainer.config import LoraTrainConfig


def check_lora(lora: LoraTrainConfig, kernel: KernelConfig) -> None:
    """ValueError for settings the trainer cannot honour."""
    if lora.base_dtype == "bfloat16" and kernel.dtype != "bfloat16":
        raise ValueError(
            f"trainer.lora.base_dtype=bfloat16 needs kernel.dtype=bfloat16 (it is {kernel.dtype}): the engine "
            "computes with the base in the kernel dtype, so a base rounded to bfloat16 only here would differ from it"
        )


def attach_adapters(model: CausalLM, lora: LoraTrainConfig, kernel: KernelConfig) -> list[str]:
    """Give `model` adapters and freeze its base: every parameter but the adapters and the MTP layers' own (which
    their auxiliary loss may train) stops taking gradients; with `base_dtype=bfloat16` the frozen base is cast (the
    round-to-nearest cast the compute applies anyway). Returns the adapted layers' names."""
    check_lora(lora, kernel)
    names = add_lora(model, lora.adapters())
    mtp = {id(p) for p in model.mtp_parameters()}
    base_dtype = getattr(torch, lora.base_dtype)
    for name, param in model.named_parameters():
        trains = is_adapter_name(name) or id(param) in mtp
        param.requires_grad_(trains)
        if not trains and param.dtype != base_dtype:
            param.data = param.data.to(base_dtype)
    return names


class TrainedWeights:
    """The export model of a LoRA run's weight sync (`miles_trainer.weight_sender.ExportModel`): the model's
    parameters that `trains` selects, under HF names, and no buffers (the engine keeps its base and router bias)."""

    def __init__(self, model: CausalLM, trains: Callable[[torch.nn.Parameter], bool]) -> None:
        self.model = model
        self.trains = trains

    @property
    def kernel(self) -> KernelConfig:
        return self.model.kernel

    def named_parameters(self) -> Iterator[tuple[str, torch.nn.Parameter]]:
        return ((name, p) for name, p in self.model.named_parameters() if self.trains(p))

    def named_buffers(self) -> Iterator[tuple[str, Any]]:
        return iter(())
