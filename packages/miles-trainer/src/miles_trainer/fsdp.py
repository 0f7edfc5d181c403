"""The FSDP2 training backend: the miles-kernels model sharded with `fully_shard` over `torch.distributed`
(gloo on CPU, NCCL on GPU), AdamW with warmup + cosine/constant schedule and gradient clipping.

Each rank trains on its share of the global batch. Losses are normalized by the global batch's token / sequence
counts (an all-reduce of the local counts) and each rank's loss is scaled by the world size, so FSDP2's
gradient average over ranks is the sum the global normalization needs: a step is the same whatever the
data-parallel size. The model keeps the engine's kernels (`KernelConfig`), so the
log-probs it computes before its first optimizer step equal the engine's under true on-policy.
"""

from __future__ import annotations

import json
import math
import os
import shutil
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_state_dict,
)
from torch.distributed.fsdp import fully_shard, register_fsdp_forward_method

from miles_contracts import Sample
from miles_kernels import CausalLM, KernelConfig, load_model, load_state, save_model
from miles_trainer.packing import plan_micro_batches
from miles_trainer.step import PolicyLossConfig, accumulate_policy_gradients, count_trained


@dataclass(frozen=True)
class OptimizerConfig:
    """AdamW and its schedule."""

    lr: float = 1e-5
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    warmup_steps: int = 0
    total_steps: int = 1000
    schedule: str = "constant"  # "constant" or "cosine" (after warmup)
    min_lr_ratio: float = 0.0
    max_grad_norm: float = 1.0

    def lr_factor(self, step: int) -> float:
        """Multiplier of `lr` at optimizer step `step` (0-based)."""
        if self.schedule not in ("constant", "cosine"):
            raise ValueError(f"schedule {self.schedule!r}: use 'constant' or 'cosine'")
        if step < self.warmup_steps:
            return (step + 1) / self.warmup_steps
        if self.schedule == "constant":
            return 1.0
        progress = min(1.0, (step - self.warmup_steps) / max(1, self.total_steps - self.warmup_steps))
        return self.min_lr_ratio + (1 - self.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


class FSDP2Backend:
    """A `CausalLM` sharded over the default process group, with its optimizer."""

    def __init__(
        self,
        model_dir: str,
        kernel: KernelConfig,
        optimizer: OptimizerConfig | None = None,
        loss: PolicyLossConfig | None = None,
        max_tokens_per_micro_batch: int = 4096,
        device: str = "cpu",
    ) -> None:
        if not dist.is_initialized():
            raise RuntimeError("FSDP2Backend needs torch.distributed initialized (torchrun, or init_process_group)")
        self.kernel = kernel
        self.optimizer_config = optimizer or OptimizerConfig()
        self.loss_config = loss or PolicyLossConfig()
        self.max_tokens = max_tokens_per_micro_batch
        self.model = load_model(model_dir, kernel, device).train()
        for layer in self.model.model.layers:
            fully_shard(layer)
        fully_shard(self.model)
        if self.model.config.is_moe:  # experts that no token of this rank chose still join the gradient reduction
            self.model.set_reduce_scatter_unused_params(True)  # type: ignore[operator]
        register_fsdp_forward_method(self.model, "forward_hidden")
        register_fsdp_forward_method(self.model, "logits")
        config = self.optimizer_config
        self.optimizer = torch.optim.AdamW(
            self.model.parameters(), lr=config.lr, betas=config.betas, eps=config.eps,
            weight_decay=config.weight_decay,
        )  # fmt: skip
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, config.lr_factor)
        self.step_count = 0

    def train_step(self, samples: Sequence[Sample], advantages: Sequence[float]) -> dict[str, float]:
        """One optimizer step on this rank's samples (every rank calls it with its share of the batch)."""
        if not samples:
            raise ValueError("every rank needs at least one sample per step")
        local = torch.tensor(count_trained(samples), dtype=torch.int64)
        dist.all_reduce(local)
        global_tokens, global_seqs = (int(v) for v in local.tolist())
        # Sharded forward/backward passes are collectives: every rank runs as many as the busiest rank.
        passes = torch.tensor([len(plan_micro_batches([s.num_tokens for s in samples], self.max_tokens))])
        dist.all_reduce(passes, op=dist.ReduceOp.MAX)
        self.optimizer.zero_grad(set_to_none=True)
        metrics = accumulate_policy_gradients(
            self.model, samples, advantages, self.kernel, self.loss_config, self.max_tokens,
            global_num_tokens=global_tokens, global_num_seqs=global_seqs,
            loss_scale=dist.get_world_size(),  # FSDP2 averages gradients over ranks; the global loss wants a sum
            num_micro_batches=int(passes.item()),
        )  # fmt: skip
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.optimizer_config.max_grad_norm)
        self.optimizer.step()
        self.scheduler.step()
        self.step_count += 1
        loss = torch.tensor([metrics["loss"]], dtype=torch.float64)
        dist.all_reduce(loss)  # each rank's loss is its share of the global loss
        return {
            "loss": float(loss),
            "grad_norm": float(_full(grad_norm)),
            "lr": float(self.scheduler.get_last_lr()[0]),
        }

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Unsharded parameters on CPU under HF checkpoint names (tied embeddings once), identical on every rank."""
        options = StateDictOptions(full_state_dict=True, cpu_offload=True, broadcast_from_rank0=False)
        state: dict[str, Any] = get_model_state_dict(self.model, options=options)
        if self.model.config.tie_word_embeddings:
            state.pop("lm_head.weight", None)
        return state


def _full(value: torch.Tensor) -> torch.Tensor:
    return value.full_tensor() if hasattr(value, "full_tensor") else value


TRAINER_STATE = "trainer_state.json"


def save_checkpoint(
    backend: FSDP2Backend, directory: str | os.PathLike[str], extra: dict[str, Any] | None = None
) -> Path:
    """Sharded checkpoint (torch.distributed.checkpoint: model + optimizer) plus the step and scheduler state.

    Atomic: everything is written to `<dir>.tmp` and renamed into place by rank 0 after every rank finished, so
    a crash mid-save leaves the previous checkpoint intact. Every rank calls it.
    """
    final = Path(directory)
    staging = final.with_name(final.name + ".tmp")
    if dist.get_rank() == 0 and staging.exists():
        shutil.rmtree(staging)
    dist.barrier()
    model_state, optim_state = get_state_dict(backend.model, backend.optimizer)
    dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=str(staging))  # type: ignore[attr-defined]
    if dist.get_rank() == 0:
        state = {"step": backend.step_count, "scheduler": backend.scheduler.state_dict(), "extra": extra or {}}
        (staging / TRAINER_STATE).write_text(json.dumps(state))
    dist.barrier()
    if dist.get_rank() == 0:
        if final.exists():
            shutil.rmtree(final)
        staging.rename(final)
    dist.barrier()
    return final


def load_checkpoint(backend: FSDP2Backend, directory: str | os.PathLike[str]) -> dict[str, Any]:
    """Restore model, optimizer, scheduler and step from `save_checkpoint`; returns the saved `extra` dict."""
    path = Path(directory)
    if not (path / TRAINER_STATE).is_file():
        raise FileNotFoundError(f"{path} is not a complete miles-trainer checkpoint (no {TRAINER_STATE})")
    model_state, optim_state = get_state_dict(backend.model, backend.optimizer)
    state_dict: dict[str, Any] = {"model": model_state, "optim": optim_state}
    dcp.load(state_dict, checkpoint_id=str(path))  # type: ignore[attr-defined]
    set_state_dict(
        backend.model, backend.optimizer, model_state_dict=state_dict["model"], optim_state_dict=state_dict["optim"]
    )
    state = json.loads((path / TRAINER_STATE).read_text())
    backend.scheduler.load_state_dict(state["scheduler"])
    backend.step_count = int(state["step"])
    extra: dict[str, Any] = state["extra"]
    return extra


def export_hf(backend: FSDP2Backend, directory: str | os.PathLike[str], tokenizer: Any = None) -> Path | None:
    """Gather the full weights and write a Hugging Face directory (rank 0 writes; every rank calls it)."""
    state = backend.full_state_dict()
    out = None
    if dist.get_rank() == 0:
        with torch.device("meta"):
            model = CausalLM(backend.model.config, backend.kernel)
        model = model.to_empty(device="cpu").to(backend.kernel.torch_dtype)
        model.tie_weights()
        load_state(model, state)  # HF names; a missing or mismatched tensor is an error
        out = save_model(model, directory, tokenizer=tokenizer)
    dist.barrier()
    return out
