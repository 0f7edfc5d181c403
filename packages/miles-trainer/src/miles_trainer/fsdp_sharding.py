"""How the FSDP2 backend (fsdp.py) lays a model out: each decoder layer and the root sharded with `fully_shard` (mixed
precision to the kernel dtype, optionally the float32 masters in host memory), a single float32 rank left a plain
module, activation checkpointing per decoder layer, and torch's deterministic backward for the process."""

from __future__ import annotations

import functools
import warnings
from typing import cast

import torch
import torch.distributed as dist
from torch.distributed.fsdp import (
    CPUOffloadPolicy,
    MixedPrecisionPolicy,
    OffloadPolicy,
    fully_shard,
    register_fsdp_forward_method,
)
from torch.utils.checkpoint import checkpoint

from miles_kernels import CausalLM, KernelConfig, MTPLayer


def apply_activation_checkpointing(model: CausalLM) -> None:
    """Recompute each decoder layer's activations in backward instead of keeping them (applied before sharding;
    the recompute runs the same deterministic ops, so gradients are unchanged)."""
    for layer in model.model.layers:
        layer.forward = functools.partial(checkpoint, layer.forward, use_reentrant=False)  # type: ignore[method-assign]


# FSDP2 warns when a wrapped module returns a view (an in-place op on it would skip a hook); the model's outputs
# are never modified in place, so the warning is noise on every step.
warnings.filterwarnings("ignore", message="FSDP2-wrapped module .* returned a view tensor")


def use_deterministic_backward() -> None:
    """torch's deterministic algorithms, for the whole process: with several threads some CPU backward kernels
    (the embedding's gradient, which adds the rows of repeated token ids) otherwise accumulate in an order that
    changes from run to run, so one step's gradients differed in their last bits between runs of one config
    (benchmarks/README.md, "Bitwise reproducibility"). The forward ops are unaffected (the engine's and the trainer's
    bits stay equal). Uninitialized memory is not filled: that costs time and no op here reads it."""
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.utils.deterministic.fill_uninitialized_memory = False  # type: ignore[attr-defined]


def needs_fsdp(kernel: KernelConfig, offload_params: bool) -> bool:
    """One float32 rank has nothing to shard, reduce or cast: the model stays a plain module (FSDP2's hooks cost
    ~15 ms per step of the 3.2M-parameter policy on 2 cores, about an eighth of the step), unless its weights are to
    live in host memory (FSDP2's CPU offload uploads them layer by layer)."""
    return dist.get_world_size() > 1 or kernel.torch_dtype != torch.float32 or offload_params


def shard(
    model: CausalLM, kernel: KernelConfig, root: torch.nn.Module | None = None, offload_params: bool = False
) -> None:
    """Shard each decoder layer, then `root` (the module whose forward the caller runs: `model` itself, or the
    critic's `ValueModel` around it). `offload_params`: the sharded float32 weights and their gradients in host
    memory (`OptimizerConfig.offload=moments_and_master`): FSDP2's `CPUOffloadPolicy`, whose all-gather uploads
    a layer's weights when its forward runs and whose reduce-scatter downloads the gradients."""
    if not needs_fsdp(kernel, offload_params):
        return
    policy = MixedPrecisionPolicy(param_dtype=kernel.torch_dtype, reduce_dtype=torch.float32)
    offload = CPUOffloadPolicy(pin_memory=torch.cuda.is_available()) if offload_params else OffloadPolicy()
    # an MTP module's embedding and LM head are the trunk's (tied): the root's group manages them, not the module's
    tied = {cast(torch.nn.Parameter, model.model.embed_tokens.weight), model.lm_head.weight}
    for layer in model.model.layers:
        fully_shard(layer, mp_policy=policy, offload_policy=offload,
                    ignored_params=tied if isinstance(layer, MTPLayer) else None)  # fmt: skip
    if model.eagle3 is not None:  # an attached EAGLE-3 draft: its own group, gathered in its (TTT) forward
        fully_shard(model.eagle3, mp_policy=policy, offload_policy=offload)
    top = fully_shard(model if root is None else root, mp_policy=policy, offload_policy=offload)
    if model.config.is_moe and dist.get_world_size() > 1:
        # Experts that no token of this rank chose still join the gradient reduction.
        if not hasattr(top, "set_reduce_scatter_unused_params"):
            raise RuntimeError(
                f"sharding an MoE model over ranks needs FSDP2's set_reduce_scatter_unused_params, which torch "
                f"{torch.__version__} lacks (2.14 has it, 2.11 does not): install the torch of uv.lock"
            )
        top.set_reduce_scatter_unused_params(True)
    if root is None:
        for method in ("forward_hidden", "logits", "mtp_hidden", "mtp_logits", "token_embeddings"):  # root's gathered
            register_fsdp_forward_method(model, method)
