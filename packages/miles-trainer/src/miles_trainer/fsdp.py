"""The FSDP2 training backend: the miles-kernels model sharded with `fully_shard` over `torch.distributed`
(gloo on CPU, NCCL on GPU), AdamW with warmup + cosine/constant schedule and gradient clipping.

Each rank trains on its share of the global batch. Losses are normalized by the global batch's token / sequence
counts (an all-reduce of the local counts) and each rank's loss is scaled by the world size, so FSDP2's
gradient average over ranks is the sum the global normalization needs: a step is the same whatever the
data-parallel size. The model keeps the engine's kernels (`KernelConfig`), so the
log-probs it computes before its first optimizer step equal the engine's under true on-policy.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.fsdp import fully_shard, register_fsdp_forward_method

from miles_contracts import Sample
from miles_kernels import KernelConfig, load_model
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
