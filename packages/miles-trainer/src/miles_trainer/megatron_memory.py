"""The Megatron backend's memory (docs/memory.md, docs/megatron.md): its tensors registered with the trainer's
`TrainerMemory` (miles-memory's offload manager, budget and OOM retry) under the FSDP2 backend's tags, so both
backends offload, partially offload, budget and classify OOMs the same way.

- `weights`: the policy's model chunks, the frozen reference copy, the separate critic's chunks and the value head;
- `mtp`: the MTP modules' own weights;
- `optimizer`: the float32 masters of a bf16 / fp16 model and every AdamW's state (the policy's, the MTP modules',
  the critic's);
- `grads`: megatron-core's DDP gradient buffers (`main_grad` of every parameter is a view into one), dropped on
  offload, zeros on onload: every step starts from `zero_grad_buffer()` anyway.

The offload manager empties each tensor's storage in place (`resize_(0)`), which is how megatron-core's own
`offload_grad_buffers` frees its buffers: the parameters, the `main_grad` views and AdamW's state stay the same
Python objects, so nothing is re-wired and onload is bit-exact.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch

from miles_memory.config import MemoryConfig
from miles_trainer.memory import TrainerMemory

Resident = Callable[[], Iterator[tuple[dict[str, Any], str]]]


def _tensors(pairs: Iterable[tuple[dict[str, Any], str]]) -> Iterator[torch.Tensor]:
    for owner, key in pairs:
        yield owner[key]


def grad_buffers(ddp_modules: Iterable[Any]) -> Iterator[torch.Tensor]:
    """The gradient buffers (dense and expert) of megatron-core DDP wrappers."""
    for ddp in ddp_modules:
        for buffer in ddp.buffers + ddp.expert_parallel_buffers:
            yield buffer.grad_data


def megatron_memory(
    config: MemoryConfig,
    device: torch.device,
    *,
    weights: Callable[[], Iterable[torch.Tensor]],
    mtp: Callable[[], Iterable[torch.Tensor]],
    resident: Resident,
    ddp_modules: Callable[[], Iterable[Any]],
    trained: Callable[[], Iterable[torch.nn.Parameter]],
    offload_dir: str | os.PathLike[str] | None = None,
) -> TrainerMemory:
    """The `TrainerMemory` of a Megatron backend: `weights` and `mtp` yield those tags' tensors, `resident` every
    (owner, key) the backend holds (what the first two tags do not claim is `optimizer`: a storage belongs to the
    first tag that yields it), `ddp_modules` the DDP wrappers whose buffers are `grads`, `trained` the float32
    tensors the optimizers step (their gradients and AdamW moments are what a step holds beside the weights)."""
    return TrainerMemory(
        config, str(device), offload_dir=offload_dir, weights=weights, mtp=mtp,
        optimizer=lambda: _tensors(resident()), grads=lambda: grad_buffers(ddp_modules()), trainable=trained,
    )  # fmt: skip
