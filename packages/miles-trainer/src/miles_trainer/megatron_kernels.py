"""The Miles layer spec for megatron-core: a `GPTModel` whose layers run the rollout engine's batch-invariant
miles-kernels ops, so that its log-probs equal the engine's bit for bit (docs/true-on-policy.md, "Megatron").

megatron-core builds its decoder from a `ModuleSpec`; `miles_block_spec` takes the spec of its local modules
(`transformer_impl=local`) and swaps the classes that compute for subclasses whose `forward` runs the engine's
arithmetic (`miles_kernels.model`) on the same parameters:

- `MilesRMSNorm` (every norm, q/k norms and the final one included): miles' `rms_norm`.
- `MilesColumnParallelLinear` (an MTP module's `eh_proj`): miles' `linear` on this TP rank's output columns.
- `MilesSelfAttention`: q, k and v each by miles' `linear` on its own rows of the fused `linear_qkv` weight (the
  engine's separate q/k/v projections: the same GEMM shapes), q/k norms, RoPE from `rotary_cos_sin`, the engine's
  `packed_attention` over the micro-batch's packed sequences, `linear_proj`.
- `MilesMLP` (dense layers and shared experts): gate and up by `linear` on the halves of `linear_fc1`, `swiglu`,
  `linear_fc2`.
- `MilesMoELayer`: the router's logits by `linear` (GLM-4.5's in float32), miles' `route_softmax` /
  `route_grouped_sigmoid` (routing replay and the MoE losses through `megatron_moe.RouterRecord`), each expert's
  rows through the engine's `expert_mlp` (fixed-shape `moe_tile` GEMMs: a row's output does not depend on which
  others chose the expert), weighted, and summed over each token's top-k in rank order (`combine_ranks`), as
  `experts_forward`. With
  expert parallelism the (token, rank) pairs travel to their expert's EP rank and back (all-to-all), so a token's
  arithmetic is the same on any layout: only where its expert runs changes.

Parameters, names, shapes, TP/EP sharding attributes and sharded checkpoints stay megatron-core's (the classes are
subclasses; `megatron_convert` and `megatron_state` are unchanged), so DDP, the optimizer, checkpoints and weight
sync see the same model. The micro-batch runs in the packed layout the engine and the FSDP2 trainer use: its N
tokens as an (N, 1, H) sequence, with the packing (`AttentionBatch`) and the RoPE tables in `PackedRows`, passed as
megatron-core's `packed_seq_params` (which reaches every layer, the recompute's second forward included).

Tensor parallelism (dense models; megatron-core runs MoE layers with tp > 1 only with sequence parallelism): each
rank computes its heads and its columns of every column-parallel linear, which are bitwise the unsplit GEMM's
columns (a row's tiled GEMM computes each output column alone), and the row-parallel linears (attention output,
MLP down) combine the ranks by `megatron.tp_reduce`: `exact` gathers their input and weight shards and runs the
engine's unsplit GEMM on every rank (bit for bit, for an all-gather of those weights per forward); `all_reduce`
sums the ranks' partial products as megatron-core does (another summation order: a measured mismatch).
docs/true-on-policy.md has the table of layouts. Shapes: N tokens, H hidden, E experts, K experts per token.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist

from miles_kernels import (
    AttentionBatch,
    KernelConfig,
    ModelConfig,
    Routing,
    apply_rope,
    combine_ranks,
    expert_mlp,
    experts_forward,
    linear,
    packed_attention,
    rms_norm,
    rotary_cos_sin,
    route_grouped_sigmoid,
    route_softmax,
    swiglu,
)
from miles_trainer.config import MegatronConfig


@dataclasses.dataclass(frozen=True)
class PackedRows:
    """A micro-batch's packing as the Miles layers take it (megatron-core's `packed_seq_params` slot): the engine's
    `AttentionBatch` of its sequences and the RoPE tables of its positions."""

    batch: AttentionBatch
    cos: torch.Tensor
    sin: torch.Tensor

    @classmethod
    def of(cls, model: ModelConfig, batch: AttentionBatch, dtype: torch.dtype, device: torch.device) -> PackedRows:
        batch = batch.to(device)
        cos, sin = rotary_cos_sin(model, batch.positions_N, torch.empty((), dtype=dtype, device=device))
        return cls(batch, cos, sin)


def check_miles_layout(config: MegatronConfig, model: ModelConfig) -> None:
    """ValueError naming what the Miles layers do not run (the run config checks the layout before the model is
    read; the model's attention is checked here, when the backend builds it)."""
    problem = config.model_problem(model.model_type, model.is_mla, deterministic=True)  # the Miles layers are built
    if problem:
        raise ValueError(problem)
    problems = config.miles_layer_problems()
    if problems:
        raise ValueError(
            "megatron.layer_spec=miles (the engine's batch-invariant kernels; `auto` picks it with "
            f"kernel.mode=deterministic) does not run {'; '.join(problems)}: change the layout, or set "
            "trainer.backend.megatron.layer_spec=megatron with kernel.mode=fast (TIS / MIS correct the mismatch)"
        )


def _packed(packed_seq_params: Any) -> PackedRows:
    if not isinstance(packed_seq_params, PackedRows):
        raise TypeError("a Miles layer runs on a micro-batch's PackedRows (MegatronCausalLM lays them out)")
    return packed_seq_params


def _rows(hidden_SBH: torch.Tensor) -> torch.Tensor:
    """The (S, B, H) activations as (S * B, H) rows (B is 1 in the packed layout)."""
    return hidden_SBH.reshape(-1, hidden_SBH.shape[-1])


class MilesRMSNorm(torch.nn.RMSNorm):
    """megatron-core's torch RMSNorm (parameter `weight`) computed by miles' `rms_norm`; its weight in the model's
    dtype, as the engine's (megatron-core's torch norm keeps a float32 weight)."""

    def __init__(self, config: Any, hidden_size: int, eps: float = 1e-5, *, kernel: KernelConfig, **_: Any) -> None:
        super().__init__(normalized_shape=hidden_size, eps=eps, dtype=config.params_dtype)
        self.kernel = kernel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        assert self.eps is not None
        return rms_norm(x, self.weight, self.eps, self.kernel)


def _gate_up(fc1_weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The gate and up projections of a fused `linear_fc1` weight [gate; up] (a TP rank's: its rows of each)."""
    half = fc1_weight.shape[0] // 2
    return fc1_weight[:half], fc1_weight[half:]


def _tp_size(config: Any) -> int:
    return int(config.tensor_model_parallel_size)


def _column_input(x_NH: torch.Tensor, config: Any) -> torch.Tensor:
    """The input of column-parallel linears: the same rows on every TP rank (its gradient summed over them)."""
    if _tp_size(config) == 1:
        return x_NH
    from megatron.core.tensor_parallel import copy_to_tensor_model_parallel_region

    out: torch.Tensor = copy_to_tensor_model_parallel_region(x_NH)
    return out


def _row_linear(x_local: torch.Tensor, weight_local: torch.Tensor, config: Any, kernel: KernelConfig,
                tp_reduce: str) -> torch.Tensor:  # fmt: skip
    """A row-parallel linear (attention output, MLP down) of the TP ranks' input columns `x_local` and weight
    columns `weight_local`: `exact` gathers both and runs the engine's unsplit GEMM on every rank (its backward is
    megatron-core's); `all_reduce` sums the ranks' partial products (megatron-core's; other bits)."""
    if _tp_size(config) == 1:
        return linear(x_local, weight_local, kernel)
    from megatron.core.tensor_parallel import reduce_from_tensor_model_parallel_region

    if tp_reduce == "exact":
        out: torch.Tensor = _ExactRowParallel.apply(x_local, weight_local, kernel)
        return out
    out = reduce_from_tensor_model_parallel_region(linear(x_local, weight_local, kernel))
    return out


class _ExactRowParallel(torch.autograd.Function):
    """The exact row-parallel linear: forward, the engine's unsplit GEMM of the gathered input and weight shards (the
    same output on every TP rank); backward, each rank's own shards' gradients from the (replicated) output gradient,
    as megatron-core's RowParallelLinear computes them (nothing is gathered for the backward)."""

    @staticmethod
    def forward(ctx: Any, x_local: torch.Tensor, weight_local: torch.Tensor, kernel: KernelConfig) -> torch.Tensor:  # type: ignore[override]
        from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

        ctx.save_for_backward(x_local, weight_local)
        x_full = gather_from_tensor_model_parallel_region(x_local)
        return linear(x_full, gather_from_tensor_model_parallel_region(weight_local), kernel)

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None, None]:  # type: ignore[override]
        x_local, weight_local = ctx.saved_tensors
        grad_out = grad_out.contiguous()
        rows = grad_out.reshape(-1, grad_out.shape[-1])
        grad_x = (rows @ weight_local).view(*grad_out.shape[:-1], -1) if ctx.needs_input_grad[0] else None
        grad_weight = rows.t() @ x_local.reshape(-1, x_local.shape[-1]) if ctx.needs_input_grad[1] else None
        return grad_x, grad_weight, None


def _mlp(x_NH: torch.Tensor, module: Any, kernel: KernelConfig, tp_reduce: str) -> torch.Tensor:
    """The engine's `MLP`: down(swiglu(gate(x), up(x))) on a megatron-core MLP's weights (TP: each rank's share of
    the intermediate columns, then `_row_linear`)."""
    gate, up = _gate_up(module.linear_fc1.weight)
    x_NH = _column_input(x_NH, module.config)
    hidden = swiglu(linear(x_NH, gate, kernel), linear(x_NH, up, kernel))
    return _row_linear(hidden, module.linear_fc2.weight, module.config, kernel, tp_reduce)


@functools.cache
def _mixin_mlp(base: type) -> type:
    class Miles(base):  # type: ignore[misc, valid-type]
        __doc__ = f"megatron-core's {base.__name__} computed as the engine's MLP."

        def __init__(
            self, *args: Any, kernel: KernelConfig, model: ModelConfig, tp_reduce: str, **kwargs: Any
        ) -> None:
            super().__init__(*args, **kwargs)
            self.kernel, self.tp_reduce = kernel, tp_reduce

        def forward(self, hidden_states: torch.Tensor, *_: Any, **__: Any) -> tuple[torch.Tensor, None]:
            out = _mlp(_rows(hidden_states), self, self.kernel, self.tp_reduce)
            return out.view(hidden_states.shape), None

    Miles.__name__ = Miles.__qualname__ = f"Miles{base.__name__}"
    return Miles


@functools.cache
def _attention_class() -> type:
    from megatron.core.transformer.attention import SelfAttention

    class MilesSelfAttention(SelfAttention):  # type: ignore[misc]
        """megatron-core's self-attention (its fused `linear_qkv` [q heads; k; v] per query group, `linear_proj`,
        q/k norms) computed as the engine's `Attention` over the micro-batch's packed sequences."""

        def __init__(
            self, *args: Any, kernel: KernelConfig, model: ModelConfig, tp_reduce: str, **kwargs: Any
        ) -> None:
            super().__init__(*args, **kwargs)
            self.kernel, self.model, self.tp_reduce = kernel, model, tp_reduce
            if self.config.num_query_groups < _tp_size(self.config):
                raise ValueError(
                    f"the Miles layers split whole KV heads over the TP ranks: {self.config.num_query_groups} KV "
                    f"heads do not split over tp={_tp_size(self.config)}"
                )
            heads, groups = self.num_attention_heads_per_partition, self.num_query_groups_per_partition
            dim = self.hidden_size_per_attention_head
            self.shape = (heads, groups, dim)
            per_group = heads // groups
            block = torch.arange(groups)[:, None] * (per_group + 2) * dim
            rows = torch.arange(dim)
            q_rows = (block + torch.arange(per_group * dim)).reshape(-1)
            k_rows = (block + per_group * dim + rows).reshape(-1)
            v_rows = (block + (per_group + 1) * dim + rows).reshape(-1)
            self.qkv_rows = (q_rows, k_rows, v_rows)  # each projection's rows of the fused weight
            self.scale = dim**-0.5
            self.window = model.attention_window(self.layer_number - 1)

        def _project(self, x_NH: torch.Tensor, weight: torch.Tensor, which: int) -> torch.Tensor:
            rows = self.qkv_rows[which].to(x_NH.device)
            bias = self.linear_qkv.bias
            return linear(x_NH, weight[rows], self.kernel, None if bias is None else bias[rows])

        def forward(  # type: ignore[override]
            self, hidden_states: torch.Tensor, attention_mask: Any = None, *_: Any,
            packed_seq_params: Any = None, **__: Any,
        ) -> tuple[torch.Tensor, None]:  # fmt: skip
            packed = _packed(packed_seq_params)
            heads, groups, dim = self.shape  # this TP rank's query heads and KV heads
            x_NH = _column_input(_rows(hidden_states), self.config)
            num = x_NH.shape[0]
            weight = self.linear_qkv.weight  # read once: with LoRA it is merged when read (megatron_lora)
            q = self._project(x_NH, weight, 0).view(num, heads, dim)
            k = self._project(x_NH, weight, 1).view(num, groups, dim)
            if self.q_layernorm is not None and self.k_layernorm is not None:
                q, k = self.q_layernorm(q), self.k_layernorm(k)
            q, k = apply_rope(q, packed.cos, packed.sin), apply_rope(k, packed.cos, packed.sin)
            v = self._project(x_NH, weight, 2).view(num, groups, dim)

            def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
                return packed_attention(q, k, v, packed.batch, self.scale, self.kernel, self.window)

            if self.checkpoint_core_attention and self.training and torch.is_grad_enabled():  # recompute=selective
                from megatron.core import tensor_parallel

                out = tensor_parallel.checkpoint(attend, False, q, k, v)  # recomputed in the backward, same bits
            else:
                out = attend(q, k, v)
            projected = _row_linear(out.reshape(num, heads * dim), self.linear_proj.weight, self.config,
                                    self.kernel, self.tp_reduce)  # fmt: skip
            return projected.view(*hidden_states.shape[:-1], -1), None

    return MilesSelfAttention


@functools.cache
def _moe_class() -> type:
    from megatron.core.transformer.moe.moe_layer import MoELayer

    class MilesMoELayer(MoELayer):  # type: ignore[misc]
        """megatron-core's MoE layer (its router's `weight` / `expert_bias`, its local experts' fused `linear_fc1`
        and `linear_fc2`, its shared experts) computed as the engine's `SparseMoE` (see the module docstring)."""

        def __init__(
            self, *args: Any, kernel: KernelConfig, model: ModelConfig, tp_reduce: str, **kwargs: Any
        ) -> None:
            super().__init__(*args, **kwargs)
            self.kernel, self.model, self.tp_reduce = kernel, model, tp_reduce
            grouped = kernel.is_deterministic and kernel.linear_backend == "triton"
            if grouped and self.config.expert_model_parallel_size > 1:
                raise ValueError(
                    "the Miles MoE layer with ep > 1 runs the torch-tiled expert GEMMs; kernel.linear_backend=triton "
                    "(the engine's grouped GEMM) needs ep = 1"
                )

        def _route(self, x_NH: torch.Tensor, replay_NK: torch.Tensor | None) -> Routing:
            model, weight = self.model, self.router.weight
            if model.router == "sigmoid":  # GLM-4.5: logits in float32
                logits = linear(x_NH.to(torch.float32), weight.to(torch.float32), self.kernel)
                return route_grouped_sigmoid(
                    logits, self.router.expert_bias, model.num_experts_per_tok, model.n_group, model.topk_group,
                    model.norm_topk_prob, model.routed_scaling_factor, x_NH.dtype, replay_NK,
                )  # fmt: skip
            logits = linear(x_NH, weight.to(x_NH.dtype), self.kernel)
            return route_softmax(logits, model.num_experts_per_tok, model.norm_topk_prob, x_NH.dtype, replay_NK)

        def forward(self, hidden_states: torch.Tensor, *_: Any, **__: Any) -> tuple[torch.Tensor, None]:  # type: ignore[override]
            x_NH = _rows(hidden_states)
            observe = getattr(self.router.router_replay, "observe", None)  # megatron_moe.RouterRecord's, if any
            route: Callable[[torch.Tensor | None], Routing] = lambda replay: self._route(x_NH, replay)  # noqa: E731
            routing = route(None) if observe is None else observe(route, x_NH.shape[0])
            experts = list(self.experts.local_experts)
            gates, ups = zip(*(_gate_up(e.linear_fc1.weight) for e in experts), strict=True)
            downs = [e.linear_fc2.weight for e in experts]
            if self.config.expert_model_parallel_size == 1:
                out = experts_forward(x_NH, routing.expert_ids, routing.weights, list(gates), list(ups), downs,
                                      self.kernel)  # fmt: skip
            else:
                out = self._expert_parallel(x_NH, routing, list(gates), list(ups), downs)
            if self.shared_experts is not None:
                out = out + _mlp(x_NH, self.shared_experts, self.kernel, self.tp_reduce)
            return out.view(hidden_states.shape), None

        def _expert_parallel(
            self, x_NH: torch.Tensor, routing: Routing, gates: list[torch.Tensor], ups: list[torch.Tensor],
            downs: list[torch.Tensor],
        ) -> torch.Tensor:  # fmt: skip
            """`experts_forward` with the experts spread over the EP ranks: each (token, rank) pair's row goes to
            its expert's rank (grouped by expert, token order kept, as `experts_forward` groups them), through the
            expert there, and back; then the engine's weighting and rank-order sum."""
            from megatron.core import parallel_state as ps
            from megatron.core.tensor_parallel import all_to_all

            group = ps.get_expert_model_parallel_group()
            num_tokens, top_k = routing.expert_ids.shape
            per_rank_experts = len(gates)
            flat_ids = routing.expert_ids.reshape(-1)
            order = torch.argsort(flat_ids, stable=True)
            tokens, ranks = order // top_k, order % top_k
            sent_experts = flat_ids[order]
            send_counts = torch.bincount(sent_experts // per_rank_experts, minlength=dist.get_world_size(group))
            recv_counts = torch.empty_like(send_counts)
            dist.all_to_all_single(recv_counts, send_counts, group=group)
            send, recv = send_counts.tolist(), recv_counts.tolist()
            x_recv = all_to_all(group, x_NH[tokens], recv, send)
            experts_recv = torch.empty(sum(recv), dtype=sent_experts.dtype, device=sent_experts.device)
            dist.all_to_all_single(experts_recv, sent_experts.contiguous(), recv, send, group=group)
            local = experts_recv - ps.get_expert_model_parallel_rank() * per_rank_experts
            y_recv = x_recv.new_zeros(x_recv.shape)
            by_expert = torch.argsort(local, stable=True)
            counts = torch.bincount(local, minlength=per_rank_experts).tolist()
            start = 0
            for expert, count in enumerate(counts):
                if not count:
                    continue
                rows = by_expert[start : start + count]
                start += count
                y_e = expert_mlp(x_recv[rows], gates[expert], ups[expert], downs[expert], self.kernel)
                y_recv = y_recv.index_put((rows,), y_e)
            y = all_to_all(group, y_recv, send, recv) * routing.weights[tokens, ranks][:, None]
            return combine_ranks(x_NH.new_zeros(top_k, num_tokens, x_NH.shape[1]).index_put((ranks, tokens), y))

    return MilesMoELayer


def _swaps(kernel: KernelConfig, model: ModelConfig, tp_reduce: str) -> dict[type, tuple[type, dict[str, Any]]]:
    """megatron-core class -> (its Miles class, the spec params it takes)."""
    from megatron.core.transformer.attention import SelfAttention
    from megatron.core.transformer.mlp import MLP
    from megatron.core.transformer.moe.moe_layer import MoELayer
    from megatron.core.transformer.moe.shared_experts import SharedExpertMLP
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    params = {"kernel": kernel, "model": model, "tp_reduce": tp_reduce}
    return {
        WrappedTorchNorm: (MilesRMSNorm, {"kernel": kernel}),
        SelfAttention: (_attention_class(), params),
        MLP: (_mixin_mlp(MLP), params),
        SharedExpertMLP: (_mixin_mlp(SharedExpertMLP), params),
        MoELayer: (_moe_class(), params),
    }


def swap_modules(spec: Any, swaps: dict[type, tuple[type, dict[str, Any]]]) -> Any:
    """`spec` with every swapped class replaced (a bare class becomes a ModuleSpec with its params)."""
    from megatron.core.transformer.spec_utils import ModuleSpec

    if isinstance(spec, type):
        if spec in swaps:
            cls, params = swaps[spec]
            return ModuleSpec(module=cls, params=params)
        return spec
    if isinstance(spec, ModuleSpec):
        module, params = spec.module, dict(spec.params)
        if isinstance(module, type) and module in swaps:
            module, extra = swaps[module]
            params |= extra
        return dataclasses.replace(spec, module=module, params=params, submodules=swap_modules(spec.submodules, swaps))
    if dataclasses.is_dataclass(spec) and not isinstance(spec, type):
        return dataclasses.replace(spec, **{f.name: swap_modules(getattr(spec, f.name), swaps)
                                            for f in dataclasses.fields(spec)})  # fmt: skip
    if isinstance(spec, list):
        return [swap_modules(item, swaps) for item in spec]
    return spec


def _is_not_mlp_type_warning(record: logging.LogRecord) -> bool:
    return "Unknown MLP type" not in record.getMessage()


@contextlib.contextmanager
def building_miles_layers() -> Iterator[None]:
    """Build Miles layers without megatron-core's "Unknown MLP type" warning: its TransformerLayer recognizes its own
    MLP classes only (by identity, not subclass) and then passes the default process groups, which are the ones the
    Miles layers use."""
    logger = logging.getLogger("megatron.core.transformer.transformer_layer")
    logger.addFilter(_is_not_mlp_type_warning)
    try:
        yield
    finally:
        logger.removeFilter(_is_not_mlp_type_warning)


def miles_spec(spec: Any, kernel: KernelConfig, model: ModelConfig, config: MegatronConfig) -> Any:
    """megatron-core's local-module `spec` (a layer spec, an MTP layer spec or a block's submodules) with the Miles
    classes in place of the ones that compute."""
    return swap_modules(spec, _swaps(kernel, model, config.tp_reduce))


@functools.cache
def _column_linear_class() -> type:
    from megatron.core.tensor_parallel import ColumnParallelLinear

    class MilesColumnParallelLinear(ColumnParallelLinear):  # type: ignore[misc]
        """megatron-core's column-parallel linear (an MTP module's `eh_proj`) computed by miles' `linear` on this TP
        rank's output columns (bitwise the unsplit GEMM's columns); its output stays split (`gather_output=False`)
        and the caller gathers it, as megatron-core's MTP layer does."""

        def __init__(self, *args: Any, kernel: KernelConfig, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            if self.gather_output or self.skip_bias_add:
                raise ValueError("the Miles column-parallel linear returns its own columns, bias added")
            self.kernel = kernel

        def forward(self, input_: torch.Tensor, *_: Any, **__: Any) -> tuple[torch.Tensor, None]:  # type: ignore[override]
            x_NH = _column_input(_rows(input_), self.config)
            out = linear(x_NH, self.weight, self.kernel, self.bias)
            return out.view(*input_.shape[:-1], -1), None

    return MilesColumnParallelLinear


def miles_mtp_spec(spec: Any, kernel: KernelConfig, model: ModelConfig, config: MegatronConfig) -> Any:
    """megatron-core's local-module MTP layer spec with the Miles classes (`miles_spec`), its `eh_proj` included."""
    from megatron.core.transformer.spec_utils import ModuleSpec

    spec = miles_spec(spec, kernel, model, config)
    eh_proj = ModuleSpec(module=_column_linear_class(), params={"kernel": kernel})
    return dataclasses.replace(spec, submodules=dataclasses.replace(spec.submodules, eh_proj=eh_proj))


def miles_block_spec(
    model: ModelConfig, transformer: Any, kernel: KernelConfig, config: MegatronConfig, vp_stage: int | None
) -> Any:
    """The decoder block's spec (`TransformerBlockSubmodules`: a spec per layer, dense or MoE as `model` says, and
    the final norm) of a GPTModel running the engine's arithmetic."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

    block = get_gpt_decoder_block_spec(transformer, use_transformer_engine=False, normalization="RMSNorm",
                                       vp_stage=vp_stage)  # fmt: skip
    return miles_spec(block, kernel, model, config)
