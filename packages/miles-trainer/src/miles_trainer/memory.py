"""The trainer's memory (docs/memory.md): its tensors registered with miles-memory's offload manager by tag, the
allocation budget, and the OOM handling of a step.

Tags: `weights` (the policy's trunk, the reference copy, the critic), `mtp` (the MTP modules' own weights),
`optimizer` (every AdamW's state) and `grads` (dropped, never saved: every step starts from none).

**OOM handling.** With `memory.limit_bytes`, a step's forward counts the activations it saves for backward against
what is left beside the resident tensors and the gradients to come (`miles_memory.ActivationMeter`). An overrun is
only recorded while the micro-batches run, so every rank finishes its collectives; then all ranks agree (one
all-reduce) and, if any overran, all of them drop the step's gradients and run it again with half the token budget
per micro-batch — the gradient is the same, being invariant to the micro-batch split. Below
`memory.min_tokens_per_micro_batch`, or with `memory.oom_retry` off, the OOM is fatal: `torch.OutOfMemoryError`
with a report by tag. A real allocator OOM on one rank of several cannot be retried (its peers wait in a
collective): it propagates, and the process group's short timeout (`memory.collective_timeout_s`) ends the peers.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Iterable, Iterator
from typing import TypeVar

import torch
import torch.distributed as dist

from miles_memory import (
    ActivationMeter,
    MemoryBudget,
    OffloadManager,
    OffloadPlan,
    OOMReport,
    default_store,
    format_bytes,
    out_of_memory,
)
from miles_memory.config import MemoryConfig

logger = logging.getLogger("miles_trainer")
T = TypeVar("T")
Held = TypeVar("Held", bound=torch.Tensor)


def _trainable_bytes(params: Iterable[torch.nn.Parameter]) -> int:
    """The bytes of the gradients a backward allocates for `params` (this rank's shards)."""
    total = 0
    for param in params:
        if param.requires_grad:
            local = param.to_local() if hasattr(param, "to_local") else param
            total += local.numel() * local.element_size()
    return total


def device_held(device: str, tensors: Callable[[], Iterable[Held]]) -> Callable[[], Iterator[Held]]:
    """`tensors`, less those in host memory beside a GPU: the host-memory optimizer's state, and with
    `offload=moments_and_master` the weights and gradients, are not the device's to free or count (on a CPU device
    every tensor is the device's)."""
    if torch.device(device).type == "cpu":
        return lambda: iter(tensors())

    def held() -> Iterator[Held]:
        for tensor in tensors():
            shard = tensor.to_local() if hasattr(tensor, "to_local") else tensor
            if shard.device.type != "cpu":
                yield tensor

    return held


def _describe(held: dict[str, int]) -> str:
    return ", ".join(f"{tag} {format_bytes(n)}" for tag, n in held.items() if n)


class TrainerMemory:
    """The offload manager, budget and OOM policy of one trainer rank."""

    def __init__(
        self,
        config: MemoryConfig,
        device: str,
        *,
        weights: Callable[[], Iterable[torch.Tensor]],
        mtp: Callable[[], Iterable[torch.Tensor]],
        optimizer: Callable[[], Iterable[torch.Tensor]],
        grads: Callable[[], Iterable[torch.Tensor]],
        trainable: Callable[[], Iterable[torch.nn.Parameter]],
        offload_dir: str | os.PathLike[str] | None = None,
        host_optimizer: bool = False,
    ) -> None:
        """`host_optimizer`: the optimizer's state lives in host memory (`OptimizerConfig.offload`): a step holds
        none of it on the device."""
        self.config = config
        self.host_optimizer = host_optimizer
        limit = config.limit_bytes
        self.budget = MemoryBudget(limit, config.comm_headroom_bytes) if limit is not None else None
        store = default_store(device, config.offload_to, config.offload_dir or offload_dir)
        self.manager = OffloadManager(store, budget=self.budget, name="trainer")
        self.manager.add("weights", weights)
        self.manager.add("mtp", mtp)
        self.manager.add("optimizer", optimizer)
        self.manager.add("grads", grads, keep_contents=False)
        self._trainable = trainable
        self.peak_activation_bytes = 0  # the last step's: activations saved for backward, at their most
        self.held_bytes = 0  # the last step's: resident tensors and gradients beside them
        self.num_oom_retries = 0

    def step_metrics(self) -> dict[str, float]:
        """This rank's memory in the last step (the trainer reports the largest over ranks)."""
        return {
            "mem_train_held_bytes": float(self.held_bytes),
            "mem_train_activation_peak_bytes": float(self.peak_activation_bytes),
            "mem_train_peak_bytes": float(self.held_bytes + self.peak_activation_bytes),
            "oom_retries": float(self.num_oom_retries),
        }

    def offload(self, room_for: int | None) -> OffloadPlan:
        """Everything, or with `memory.partial_offload` (and `room_for`, the bytes the next phase needs beside
        this rank) only as much as the budget requires."""
        need = None
        if self.config.partial_offload and room_for is not None and self.budget is not None:
            resident = sum(self.manager.resident_bytes().values())
            need = max(0, resident + room_for - self.budget.available_bytes)
        return self.manager.offload(need_bytes=need)

    def _held(self, resident: dict[str, int]) -> dict[str, int]:
        """What a step holds beside its activations, by tag: the `resident` tensors, the gradients, and the AdamW
        moments (two per trainable parameter) even before the first step creates them: the steady state."""
        held = dict(resident)
        trainable = _trainable_bytes(self._trainable())
        held["grads"] = trainable
        if not self.host_optimizer:
            held["optimizer"] = max(held["optimizer"], 2 * trainable)
        return held

    def check_fits(self) -> None:
        """At start-up: a fatal OOM when what a step holds beside its activations alone exceeds the budget."""
        if self.budget is not None:
            held = self._held(self.manager.resident_bytes())
            self.budget.check({}, sum(held.values()), f"the trainer's resident tensors ({_describe(held)})")

    def with_oom_retry(
        self, max_tokens: int, accumulate: Callable[[int], T], drop_grads: Callable[[], None]
    ) -> tuple[T, int]:
        """Run `accumulate(max_tokens)` (a step's forward/backward passes), halving `max_tokens` and running it
        again after an OOM that the retry can absorb (see the module docstring). Returns its result and the token
        budget it ran with (which later steps keep)."""
        while True:
            # A step starts from no gradients: drop the last step's before listing the held storages, or the meter
            # would take an activation allocated where a gradient was freed for a held storage (by its address).
            drop_grads()
            storages = self.manager.resident_storages()  # one walk of the tagged tensors per attempt
            held = self._held({tag: sum(s.nbytes() for s in group) for tag, group in storages.items()})
            self.held_bytes = sum(held.values())
            pointers = {s.data_ptr() for group in storages.values() for s in group}
            meter = ActivationMeter(self.budget, held, deferred=True, held_storages=pointers)
            try:
                with meter:
                    result = accumulate(max_tokens)
                report = meter.overrun
            except torch.OutOfMemoryError as error:  # the allocator's own (a GPU's)
                if dist.get_world_size() > 1:
                    raise  # its peers wait in a collective this rank left: not retryable
                report = getattr(error, "report", None) or OOMReport(
                    str(error), 0, self.budget.limit_bytes if self.budget else 0, self.config.comm_headroom_bytes, held
                )
            self.peak_activation_bytes = meter.peak_bytes
            if dist.get_world_size() > 1:
                if self.budget is None:  # no budget, no overrun to agree on (an allocator OOM raised above)
                    return result, max_tokens
                flag = torch.tensor([float(report is not None)])
                dist.all_reduce(flag, op=dist.ReduceOp.MAX)  # every rank decides alike, before any next collective
                if not flag.item():
                    return result, max_tokens
            elif report is None:
                return result, max_tokens
            drop_grads()
            smaller = max_tokens // 2
            if not self.config.oom_retry or smaller < self.config.min_tokens_per_micro_batch:
                raise (
                    out_of_memory(report)
                    if report is not None
                    else torch.OutOfMemoryError("out of memory on another rank: its report is in that rank's log")
                )
            self.num_oom_retries += 1
            logger.warning(
                "OOM in a step (%s): retrying it with %d tokens per micro-batch instead of %d",
                report.message() if report is not None else "on another rank",
                smaller,
                max_tokens,
            )
            max_tokens = smaller
