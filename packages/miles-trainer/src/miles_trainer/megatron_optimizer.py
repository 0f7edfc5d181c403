"""The Megatron backend's optimizer step (docs/megatron.md, "Gradients"): torch's fused AdamW over float32 masters of
a rank's parameter shards, clipped by the global gradient norm. The policy's parameters have one
(`megatron_backend.py`), the online MTP draft's modules their own (`megatron_mtp.py`), PPO's critic its own
(`megatron_critic.py`).

The gradients are Megatron DDP's `main_grad` buffers (reduced in float32). The norm counts every tensor's shard once:
TP-replicated tensors on TP rank 0 only, a tied model's output layer (the last stage's copy of the embedding) not at
all; dense tensors are summed over the model-parallel ranks, experts over the expert-model-parallel ranks. Every rank
takes part (the sums span the pipeline stages), with or without parameters of its own.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist

from miles_trainer.config import OptimizerConfig


def adamw(
    masters: Sequence[torch.Tensor], config: OptimizerConfig
) -> tuple[torch.optim.AdamW, torch.optim.lr_scheduler.LambdaLR]:
    """Fused AdamW over `masters` with `config`'s settings, and its warm-up / cosine schedule."""
    optimizer = torch.optim.AdamW(
        list(masters), lr=config.lr, betas=config.betas, eps=config.eps, weight_decay=config.weight_decay, fused=True
    )
    return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, config.lr_factor)


def global_grad_norm(params: Sequence[Any]) -> torch.Tensor:
    """The global L2 norm of `params`' gradients (megatron-core parameters' `main_grad`) over every rank (see the
    module docstring); every rank calls it."""
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import param_is_not_tensor_parallel_duplicate

    dense = torch.zeros((), dtype=torch.float64)
    expert = torch.zeros((), dtype=torch.float64)
    for param in params:
        grad = param.main_grad
        if not param_is_not_tensor_parallel_duplicate(param) and getattr(param, "allreduce", True):
            continue
        if getattr(param, "shared", False):
            continue
        square = grad.detach().double().pow(2).sum().cpu()
        if getattr(param, "allreduce", True):
            dense += square
        else:
            expert += square
    dist.all_reduce(dense, group=ps.get_model_parallel_group())
    dist.all_reduce(expert, group=ps.get_expert_tensor_model_pipeline_parallel_group())
    return (dense + expert).sqrt()


def adamw_step(
    params: Sequence[Any],
    masters: Sequence[torch.Tensor],
    optimizer: torch.optim.Optimizer | None,
    max_grad_norm: float,
    skip_update: bool = False,
) -> torch.Tensor:
    """Clip the gradients by their global norm to `max_grad_norm` and step `optimizer` over the float32 masters
    (unless `skip_update`); a bf16 / fp16 model's parameters take the masters' round-to-nearest casts, the weights the
    engine will get. Returns the norm before clipping. `optimizer` None: this rank holds none of the parameters (it
    still takes part in the norm)."""
    for param, master in zip(params, masters, strict=True):
        master.grad = param.main_grad  # float32 (the DDP buffers reduce in float32)
    grad_norm = global_grad_norm(params)
    scale = min(1.0, max_grad_norm / (float(grad_norm) + 1e-6))
    if scale < 1.0:
        for master in masters:
            assert master.grad is not None
            master.grad.mul_(scale)
    if optimizer is not None and not skip_update:
        optimizer.step()
        if masters is not params:
            with torch.no_grad():
                for param, master in zip(params, masters, strict=True):
                    param.copy_(master)
    return grad_norm


def trained_params(
    built: Sequence[tuple[Any, dict[str, torch.Tensor]]], dtype: torch.dtype, device: torch.device
) -> tuple[list[Any], list[torch.Tensor]]:
    """The trained parameters of model chunks (`built`: each a `MegatronCausalLM` and the converted float32 tensors it
    was loaded from) and the float32 masters AdamW steps: the parameters themselves for a float32 model (the same
    list); for a bf16 / fp16 model the checkpoint's float32 values (its parameters are their round-to-nearest casts,
    as the engine's weights are)."""
    params: list[Any] = []
    masters: list[torch.Tensor] = []
    for chunk, loaded in built:
        named = [(name, p) for name, p in chunk.gpt.named_parameters() if p.requires_grad]
        params += [p for _, p in named]
        if dtype != torch.float32:
            masters += [loaded[name].to(device, torch.float32) for name, _ in named]
    return params, (params if dtype == torch.float32 else masters)


def state_tensors(optimizer: torch.optim.Optimizer | None) -> Iterator[tuple[dict[str, Any], str]]:
    """(state, key) of every tensor of an optimizer's state but the scalar step counters (AdamW's moments)."""
    for state in optimizer.state.values() if optimizer is not None else []:
        for key, value in state.items():
            if isinstance(value, torch.Tensor) and value.dim() > 0:
                yield state, key
