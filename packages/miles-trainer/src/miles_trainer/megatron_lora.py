"""LoRA on the Megatron backend (docs/lora.md, docs/megatron.md "LoRA"), tensor parallelism 1: the adapters are the
engine's, one per Hugging Face projection (`model.layers.0.self_attn.q_proj.lora_A`, ...), even where megatron-core
fuses projections into one linear (`linear_qkv`: q, k, v; `linear_fc1`: gate, up; each expert's likewise).

Each adapted megatron-core linear keeps its base `weight` frozen and holds the adapters of its projections
(`ProjectionAdapters`, float32 masters of a float32 model, requires_grad); its `weight`, wherever it is read (the
Miles layers read it directly, megatron-core's Column/RowParallelLinear in their forward), is the merged weight:
`megatron_to_hf` splits the fused base into its HF projections (a permutation: the engine's base bits), each adapted
projection is merged by `miles_kernels.merge_lora` (the engine's merge, on the same values) and `_fuse` lays them out
again. So the Miles layers' q rows of `linear_qkv.weight` are bit for bit the engine's merged q_proj weight: true
on-policy holds (tested against an engine-merged model). Gradients reach the adapters through the merge; the frozen
base gets no gradient, no DDP bucket and no optimizer state.

Tensor parallelism is refused: a TP rank's shard of a fused weight interleaves its rows of each projection, so the
adapters would need splitting the way the weights are (B split with column-parallel weights, A with row-parallel
ones) and the merge done per shard.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator, Sequence
from dataclasses import replace
from typing import Any

import torch
from torch import nn

from miles_kernels import CausalLM, KernelConfig, ModelConfig, initial_adapter, merge_lora, target_names
from miles_trainer.config import LoraTrainConfig, MegatronConfig
from miles_trainer.megatron_convert import Entry, RankLayout, _fuse, megatron_to_hf, rank_entries


def check_megatron_lora(lora: LoraTrainConfig, layout: MegatronConfig, model: ModelConfig) -> None:
    """ValueError naming what LoRA on the Megatron backend does not run yet."""
    for field, size in (("tp", layout.tp), ("etp", layout.etp or 1)):
        if size > 1:
            raise ValueError(
                f"trainer.lora with trainer.backend.megatron.{field}={size} is not supported yet: the adapters would "
                "need splitting the way the weights are (B with column-parallel shards, A with row-parallel ones) "
                f"and merging per shard; use {field}=1 (pp, vpp, ep and data parallelism work with LoRA)"
            )
    if model.is_mla:
        raise ValueError(
            "trainer.lora on the Megatron backend does not cover MLA attention (DeepSeek-V3) yet: its projections "
            "are permuted for megatron-core's RoPE layout; use trainer.backend.name=fsdp2"
        )


class ProjectionAdapters(nn.Module):
    """The adapters of one megatron-core linear's HF projections (`entry.hf_names`), keyed by the projection's last
    name (`q_proj`); `merged(weight)` is the fused weight with each adapted projection merged."""

    def __init__(self, entry: Entry, adapted: dict[str, tuple[torch.Tensor, torch.Tensor]], scaling: float,
                 model: ModelConfig, kernel: KernelConfig) -> None:  # fmt: skip
        super().__init__()
        self.entry, self.scaling, self.model, self.kernel = entry, scaling, model, kernel
        self.lora_A = nn.ParameterDict({_short(n): nn.Parameter(a) for n, (a, _) in adapted.items()})
        self.lora_B = nn.ParameterDict({_short(n): nn.Parameter(b) for n, (_, b) in adapted.items()})
        self.disabled = False  # the base alone (the KL reference of a LoRA run)

    def hf_names(self) -> dict[str, str]:
        """Projection key -> its HF layer name (`model.layers.0.self_attn.q_proj`), for this rank's entry."""
        return {_short(n): n.removesuffix(".weight") for n in self.entry.hf_names if _short(n) in self.lora_A}

    def merged(self, weight: torch.Tensor) -> torch.Tensor:
        """The fused base `weight` (tp = 1: the full Megatron tensor) with each adapted projection replaced by
        `merge_lora(its base rows, A, B)`: the engine's merged weights, in megatron-core's layout."""
        parts = megatron_to_hf(self.entry, weight, self.model, 1)
        merged = []
        for name in self.entry.hf_names:
            key = _short(name)
            if key in self.lora_A:
                merged.append(merge_lora(parts[name], self.lora_A[key], self.lora_B[key], self.scaling, self.kernel))
            else:
                merged.append(parts[name])
        return _fuse(self.entry, merged, self.model, 1)


def _short(hf_name: str) -> str:
    return hf_name.removesuffix(".weight").rsplit(".", 1)[-1]


@functools.cache
def _adapted_class(base: type) -> type:
    """`base` (a megatron-core linear) whose `weight` reads as the merged weight when it holds adapters; its
    parameter (`_parameters["weight"]`: checkpoints, DDP, the optimizer) stays the frozen base."""

    class Adapted(base):  # type: ignore[misc, valid-type]
        @property
        def weight(self) -> torch.Tensor:
            base_weight: torch.Tensor = self._parameters["weight"]
            adapters = self._modules.get("lora")
            if not isinstance(adapters, ProjectionAdapters) or adapters.disabled:
                return base_weight
            return adapters.merged(base_weight)

    Adapted.__name__ = Adapted.__qualname__ = f"LoRA{base.__name__}"
    return Adapted


def attach_megatron_adapters(
    gpt: nn.Module, model: ModelConfig, layout: RankLayout, lora: LoraTrainConfig, kernel: KernelConfig,
    device: torch.device,
) -> dict[str, torch.Tensor]:  # fmt: skip
    """Give this rank's model chunk `gpt` the adapters `lora` selects (the same layers and initial values as
    `miles_kernels.add_lora` on the HF model) and freeze everything else; returns the adapters' float32 initial
    values under their Megatron parameter names (the masters of a bf16 / fp16 model)."""
    with torch.device("meta"):
        hf_model = CausalLM(model, kernel)
    targets = set(target_names(hf_model, lora.adapters()))
    modules = dict(gpt.named_modules())
    dtype = next(gpt.parameters()).dtype
    initial: dict[str, torch.Tensor] = {}
    for param in gpt.parameters():
        param.requires_grad_(False)
    for entry in rank_entries(model, layout):
        chosen = [n for n in entry.hf_names if n.removesuffix(".weight") in targets]
        if not chosen:
            continue
        module_name = entry.name.removesuffix(".weight")
        module = modules[module_name]
        adapted = {}
        for name in chosen:
            hf = name.removesuffix(".weight")
            out_features, in_features = _hf_shape(entry, name, module._parameters["weight"], model)
            a, b = initial_adapter(hf, lora.rank, out_features, in_features)
            adapted[name] = (a, b)
            initial[f"{module_name}.lora.lora_A.{_short(name)}"] = a
            initial[f"{module_name}.lora.lora_B.{_short(name)}"] = b
        adapters = ProjectionAdapters(entry, {n: (a.to(dtype), b.to(dtype)) for n, (a, b) in adapted.items()},
                                      lora.scaling, model, kernel).to(device)  # fmt: skip
        allreduce = getattr(module._parameters["weight"], "allreduce", True)  # experts: reduced over expert-DP
        for param in adapters.parameters():
            param.allreduce = allreduce  # type: ignore[attr-defined]
        base: type = type(module)
        module.__class__ = _adapted_class(base)
        module.lora = adapters
    if not initial:
        layers = layout.layers(model)
        raise ValueError(
            f"trainer.lora target_modules={lora.target_modules!r} adapt no layer of the pipeline stage holding layers "
            f"{layers.start}-{layers.stop - 1}: every stage needs an adapted layer (it trains nothing else); widen "
            "target_modules or change the pipeline split"
        )
    return initial


def _hf_shape(entry: Entry, name: str, weight: torch.Tensor, model: ModelConfig) -> tuple[int, int]:
    return tuple(megatron_to_hf(entry, weight.detach(), model, 1)[name].shape)  # type: ignore[return-value]


def adapter_modules(chunk: nn.Module) -> Iterator[ProjectionAdapters]:
    """The adapters of a model chunk (a GPTModel), in module order."""
    return (m for m in chunk.modules() if isinstance(m, ProjectionAdapters))


@contextlib.contextmanager
def disabled_adapters(chunks: Sequence[Any]) -> Iterator[None]:
    """The base alone inside the block (a LoRA run's KL reference; `miles_kernels.disabled_adapters`)."""
    adapters = [m for chunk in chunks for m in adapter_modules(chunk.gpt)]
    for m in adapters:
        m.disabled = True
    try:
        yield
    finally:
        for m in adapters:
            m.disabled = False


def adapter_hf_tensors(
    chunks: Sequence[Any], layouts: Sequence[RankLayout], masters: dict[int, torch.Tensor]
) -> dict[str, torch.Tensor]:
    """This pipeline stage's adapters as {HF name (`...q_proj.lora_A`): tensor on the CPU} (`masters`: a parameter's
    float32 master by its id, for a bf16 / fp16 model), the experts of every EP rank gathered (every EP rank of the
    stage calls it; `megatron_state.gather_stages` adds the other stages)."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    out: dict[str, torch.Tensor] = {}
    for chunk, layout in zip(chunks, layouts, strict=True):
        peers = [{e.name: e for e in rank_entries(chunk.config, replace(layout, ep_rank=rank))}
                 for rank in range(layout.ep_size)]  # fmt: skip
        for adapters in adapter_modules(chunk.gpt):
            entry = adapters.entry
            for key in adapters.lora_A:
                for kind in ("lora_A", "lora_B"):
                    param = getattr(adapters, kind)[key]
                    tensor = masters.get(id(param), param).detach()
                    if ".local_experts." in entry.name and layout.ep_size > 1:
                        parts = [torch.empty_like(tensor) for _ in range(layout.ep_size)]
                        dist.all_gather(parts, tensor.contiguous(), group=ps.get_expert_model_parallel_group())
                    else:
                        parts = [tensor]
                    holders = peers if len(parts) > 1 else [{entry.name: entry}]
                    for peer, part in zip(holders, parts, strict=True):
                        name = next(n for n in peer[entry.name].hf_names if _short(n) == key)
                        out[f"{name.removesuffix('.weight')}.{kind}"] = part.cpu()
    return out


def adapter_sharded_state(chunks: Sequence[Any]) -> dict[str, Any]:
    """The adapters as megatron-core sharded tensors keyed by their HF names (whole tensors: any pp / ep / dp layout
    loads what any saved), one replica per data-parallel rank (expert-data-parallel for experts' adapters)."""
    from megatron.core import parallel_state as ps
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    dp = ps.get_data_parallel_rank(with_context_parallel=True)
    out: dict[str, Any] = {}
    for chunk in chunks:
        for adapters in adapter_modules(chunk.gpt):
            entry = adapters.entry
            is_expert = ".local_experts." in entry.name
            replica = ps.get_expert_data_parallel_rank() if is_expert else dp
            for key, name in adapters.hf_names().items():
                for kind in ("lora_A", "lora_B"):
                    param = getattr(adapters, kind)[key]
                    out[f"lora.{name}.{kind}"] = ShardedTensor.from_rank_offsets(
                        f"lora.{name}.{kind}", param, replica_id=replica
                    )
    return out
