"""The Megatron backend's state as others read it (docs/megatron.md): checkpoints with megatron-core's
`dist_checkpointing` (model and AdamW state as sharded tensors, keyed by global tensor and offsets, so any layout
can load what any layout saved), and the full HF tensors an engine or an HF export gets (each tensor's shards
gathered over its TP / ETP group, experts over the EP group, the pipeline stages' tensors over the pipeline group).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from miles_kernels import KernelConfig
from miles_trainer.megatron_convert import RankLayout, megatron_to_hf, merge_shards, rank_entries
from miles_trainer.megatron_model import MegatronCausalLM
from miles_trainer.step import all_gather_json

# -- checkpoints -------------------------------------------------------------------------------------------------


def model_sharded_state(chunks: Sequence[MegatronCausalLM]) -> dict[str, Any]:
    """Each model chunk's sharded state dict: "model", then "model1", "model2", ... with virtual pipeline stages
    (the tensors are keyed by their global layer numbers, so any layout can load them)."""
    return {"model" + (str(i) if i else ""): chunk.gpt.sharded_state_dict() for i, chunk in enumerate(chunks)}


def sharded_state(
    chunks: Sequence[MegatronCausalLM],
    params: list[torch.nn.Parameter],
    masters: list[torch.Tensor],
    optimizer: torch.optim.Optimizer,
    model: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Model and AdamW state as megatron-core sharded tensors (a bf16 / fp16 model's float32 masters with AdamW's
    state), and "adam_step". `model`: the sharded tensors of the trained parameters instead of the chunks' whole
    state (a LoRA run's adapters, megatron_lora.adapter_sharded_state)."""
    model = model_sharded_state(chunks) if model is None else model
    optimizer_state, step = adamw_sharded_state(model, params, masters, optimizer)
    return {**model, "optimizer": optimizer_state, "adam_step": step}


def adamw_sharded_state(
    model: dict[str, Any],
    params: list[torch.nn.Parameter],
    masters: list[torch.Tensor],
    optimizer: torch.optim.Optimizer,
) -> tuple[dict[str, Any], float]:
    """AdamW's state of `params` (and a bf16 / fp16 model's float32 masters) as sharded tensors laid out like the
    parameters' own in `model` (their sharded state dict), and AdamW's step. The state is created (zeros) if no step
    has made it yet, so a save and a load see the same keys."""
    from megatron.core.dist_checkpointing.optimizer import (
        get_param_id_to_sharded_param_map,
        optim_state_to_sharding_state,
    )

    for master in masters:
        state = optimizer.state[master]
        if not state:
            state.update(step=torch.zeros((), dtype=torch.float32), exp_avg=torch.zeros_like(master),
                         exp_avg_sq=torch.zeros_like(master))  # fmt: skip
    optimizer_state = optimizer.state_dict()
    steps = {float(entry["step"]) for entry in optimizer_state["state"].values()}
    if masters is not params:  # a bf16 / fp16 model: its float32 masters are saved too
        for index, master in enumerate(masters):
            optimizer_state["state"][index]["master"] = master
    ids = get_param_id_to_sharded_param_map(model, params)
    optim_state_to_sharding_state(optimizer_state, ids, exclude_keys=("step",))
    return optimizer_state, max(steps, default=0.0)


def load_sharded_state(
    chunks: Sequence[MegatronCausalLM],
    params: list[torch.nn.Parameter],
    masters: list[torch.Tensor],
    optimizer: torch.optim.Optimizer,
    path: Path,
    saved: dict[str, Any],
    extra: dict[str, Any] | None = None,
    model: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Load what `sharded_state` saved at `path` into the model chunks, their masters and AdamW (`saved`: the
    `trainer_state.json` record, with AdamW's step and learning rates); `extra`: more sharded state to load in the
    same read (the MTP modules'); `model`: `sharded_state`'s. Returns what was loaded."""
    from megatron.core import dist_checkpointing

    template = sharded_state(chunks, params, masters, optimizer, model)
    template.pop("adam_step")
    loaded: dict[str, Any] = dist_checkpointing.load(template | (extra or {}), str(path))
    if model is None:
        for i, chunk in enumerate(chunks):
            chunk.gpt.load_state_dict(loaded["model" + (str(i) if i else "")], strict=False)
    else:
        with torch.no_grad():
            for key, sharded in model.items():
                sharded.data.copy_(loaded[key])
    load_adamw_state(loaded["optimizer"], params, masters, optimizer, saved.get("adam_step", 0.0),
                     saved.get("adam_lrs", []))  # fmt: skip
    return loaded


def load_adamw_state(
    optimizer_state: dict[str, Any],
    params: list[torch.nn.Parameter],
    masters: list[torch.Tensor],
    optimizer: torch.optim.Optimizer,
    adam_step: float,
    lrs: list[float],
) -> None:
    """Load AdamW's state as `adamw_sharded_state` saved it (loaded back): its `adam_step`, a bf16 / fp16 model's
    masters (the parameters take their casts) and the learning rates `lrs` of its groups."""
    step = torch.tensor(float(adam_step))
    for index, entry in optimizer_state["state"].items():
        entry["step"] = step.clone()
        master = entry.pop("master", None)
        if master is not None:
            with torch.no_grad():
                masters[index].copy_(master)
                params[index].copy_(master)
    optimizer_state["param_groups"] = optimizer.state_dict()["param_groups"]
    for group, lr in zip(optimizer_state["param_groups"], lrs, strict=False):
        group["lr"] = lr  # the scheduler's state restores its counters, not the rate of the next step
    optimizer.load_state_dict(optimizer_state)


# -- full HF tensors ---------------------------------------------------------------------------------------------


def full_hf_state(
    chunks: Sequence[MegatronCausalLM],
    layouts: Sequence[RankLayout],
    params: list[torch.nn.Parameter],
    masters: list[torch.Tensor],
    device: torch.device,
) -> dict[str, torch.Tensor]:
    """Full float32 tensors on the CPU under HF checkpoint names (a tied embedding once), identical on every rank;
    a bf16 / fp16 model's are its float32 masters. Every rank calls it."""
    by_param = {id(param): master for param, master in zip(params, masters, strict=True)}
    out: dict[str, torch.Tensor] = {}
    for chunk, layout in zip(chunks, layouts, strict=True):
        state = {name: by_param.get(id(param), param) for name, param in chunk.gpt.named_parameters()}
        state |= dict(chunk.gpt.named_buffers())
        if chunk.mtp is not None:  # the MTP modules beside the last stage's GPTModel (megatron_mtp.py)
            state |= chunk.mtp.hf_source()
        out |= _chunk_hf_tensors(chunk, state, layout)
    return gather_stages(out, device)


def _gathered(tensor: torch.Tensor, group: str) -> list[torch.Tensor]:
    """`tensor`'s shards from every rank of its group ("tp", "etp"; "none": just it)."""
    from megatron.core import parallel_state as ps

    process_group = {"tp": ps.get_tensor_model_parallel_group, "etp": ps.get_expert_tensor_parallel_group}
    if group == "none" or dist.get_world_size(process_group[group]()) == 1:
        return [tensor]
    out = [torch.empty_like(tensor) for _ in range(dist.get_world_size(process_group[group]()))]
    dist.all_gather(out, tensor.contiguous(), group=process_group[group]())
    return out


def _chunk_hf_tensors(
    chunk: MegatronCausalLM, state: dict[str, torch.Tensor], layout: RankLayout
) -> dict[str, torch.Tensor]:
    """One model chunk's tensors (`state`, under its Megatron names) as full HF tensors on the CPU."""
    from megatron.core import parallel_state as ps

    config = chunk.config
    ep_group, ep_size = ps.get_expert_model_parallel_group(), layout.ep_size
    ep_peers = [{e.name: e for e in rank_entries(config, replace(layout, ep_rank=rank))} for rank in range(ep_size)]
    out: dict[str, torch.Tensor] = {}
    for entry in rank_entries(config, layout):
        full = merge_shards(entry, _gathered(state[entry.name].detach(), entry.group))
        size = layout.rank_in(entry.group)[1]
        if ".local_experts." in entry.name and ep_size > 1:  # each EP rank holds other experts under this name
            parts = [torch.empty_like(full) for _ in range(ep_size)]
            dist.all_gather(parts, full.contiguous(), group=ep_group)
            for peer, part in zip(ep_peers, parts, strict=True):
                out |= {n: t.cpu() for n, t in megatron_to_hf(peer[entry.name], part, config, size).items()}
        else:
            out |= {n: t.cpu() for n, t in megatron_to_hf(entry, full, config, size).items()}
    return out


def gather_stages(local: dict[str, torch.Tensor], device: torch.device) -> dict[str, torch.Tensor]:
    """Every pipeline stage's HF tensors on every stage, broadcast from their stage (a tied model's embedding,
    which the first and the last stage both hold, is the first stage's)."""
    from megatron.core import parallel_state as ps

    group = ps.get_pipeline_model_parallel_group()
    if dist.get_world_size(group) == 1:
        return local
    listing = [[name, list(t.shape), str(t.dtype).removeprefix("torch.")] for name, t in local.items()]
    out: dict[str, torch.Tensor] = {}
    for stage, tensors in enumerate(all_gather_json(listing, group)):
        mine = stage == dist.get_rank(group)
        for name, shape, dtype in tensors:
            tensor = (local[name] if mine else torch.empty(shape, dtype=getattr(torch, dtype))).to(device)
            dist.broadcast(tensor, src=dist.get_global_rank(group, stage), group=group)
            out.setdefault(name, tensor.cpu())
    return out


class ExportedWeights:
    """Full HF tensors in the shape `weight_sender` reads from a model (its `ExportModel`): parameters (cast to the
    kernel dtype) and the buffers an HF checkpoint holds (GLM-4.5's router bias), in float32: every tensor is sent
    in `dtype_of` its name."""

    BUFFERS = ("e_score_correction_bias",)

    def __init__(self, tensors: dict[str, torch.Tensor], kernel: KernelConfig) -> None:
        self.tensors = tensors
        self.kernel = kernel

    def dtype_of(self, name: str) -> torch.dtype:
        return torch.float32 if name.endswith(self.BUFFERS) else self.kernel.torch_dtype

    def named_parameters(self) -> Iterator[tuple[str, torch.nn.Parameter]]:
        for name, tensor in self.tensors.items():
            if not name.endswith(self.BUFFERS):
                yield name, torch.nn.Parameter(tensor, requires_grad=False)

    def named_buffers(self) -> Iterator[tuple[str, torch.Tensor]]:
        for name, tensor in self.tensors.items():
            if name.endswith(self.BUFFERS):
                yield name, tensor.to(self.dtype_of(name))
