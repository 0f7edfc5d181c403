"""An MoE block (`mlp` of a sparse decoder layer, HF checkpoint names): the router (`gate`), the routed experts and
GLM-4.5's shared experts. The routing rules and the expert computation are ops/moe.py's; this is their modules."""

from __future__ import annotations

from typing import Any, cast

import torch
from torch import nn

from miles_kernels.config import KernelConfig
from miles_kernels.layers import MLP, Linear
from miles_kernels.model_config import ModelConfig
from miles_kernels.ops.linear import linear
from miles_kernels.ops.moe import Routing, experts_forward, route_grouped_sigmoid, route_softmax


class TopkRouter(nn.Module):
    """GLM-4.5's router (`mlp.gate`): `weight` (E, H) and `e_score_correction_bias` (E,), a float32 buffer.

    The bias only steers which experts are chosen (ops/moe.py). It stays float32 whatever dtype the model is cast
    to (as transformers keeps it), is loaded, saved and weight-synced with the parameters under its checkpoint
    name, and is frozen during RL: it is a buffer, so no optimizer updates it (DeepSeek-V3's pre-training adjusts
    it between steps for load balance; an RL run keeps the checkpoint's).
    """

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(config.num_experts, config.hidden_size))
        self.e_score_correction_bias = nn.Buffer(torch.zeros(config.num_experts, dtype=torch.float32))

    def _apply(self, fn: Any, recurse: bool = True) -> TopkRouter:
        """Device moves apply to the bias, dtype casts do not (no rounding through a narrower dtype either)."""
        bias = self.e_score_correction_bias
        out = super()._apply(fn, recurse)  # type: ignore[no-untyped-call]
        moved = self.e_score_correction_bias
        if moved.dtype != torch.float32:
            self.e_score_correction_bias = nn.Buffer(bias.to(device=moved.device))
        return cast(TopkRouter, out)


class SparseMoE(nn.Module):
    """An MoE block: `gate` is the router (a Linear for Qwen3-MoE, a `TopkRouter` for GLM-4.5), `experts.{e}` are
    MLPs, `shared_experts` (GLM-4.5) an MLP every token goes through (HF checkpoint names)."""

    def __init__(self, config: ModelConfig, kernel: KernelConfig) -> None:
        super().__init__()
        self.config = config
        self.gate: nn.Module = (
            TopkRouter(config)
            if config.router == "sigmoid"
            else Linear(config.hidden_size, config.num_experts, False, kernel)
        )
        self.experts = nn.ModuleList(
            MLP(config.hidden_size, config.moe_intermediate_size, kernel) for _ in range(config.num_experts)
        )
        self.shared_experts = (
            MLP(config.hidden_size, config.moe_intermediate_size * config.n_shared_experts, kernel)
            if config.n_shared_experts
            else None
        )
        self.kernel = kernel
        self.last_routing: Routing | None = None  # the last forward's routing (ops/moe.py, `Routing`)

    def route(self, x_NH: torch.Tensor, replay_NK: torch.Tensor | None = None) -> Routing:
        config = self.config
        if isinstance(self.gate, TopkRouter):  # logits in float32, as GLM-4.5 computes them
            logits = linear(x_NH.to(torch.float32), self.gate.weight.to(torch.float32), self.kernel)
            return route_grouped_sigmoid(
                logits, self.gate.e_score_correction_bias, config.num_experts_per_tok, config.n_group,
                config.topk_group, config.norm_topk_prob, config.routed_scaling_factor, x_NH.dtype, replay_NK,
            )  # fmt: skip
        return route_softmax(self.gate(x_NH), config.num_experts_per_tok, config.norm_topk_prob, x_NH.dtype, replay_NK)

    def forward(self, x_NH: torch.Tensor, replay_NK: torch.Tensor | None = None) -> torch.Tensor:
        routing = self.route(x_NH, replay_NK)
        self.last_routing = routing
        experts: list[MLP] = list(self.experts)  # type: ignore[arg-type]
        out = experts_forward(
            x_NH,
            routing.expert_ids,
            routing.weights,
            [e.gate_proj.effective_weight() for e in experts],
            [e.up_proj.effective_weight() for e in experts],
            [e.down_proj.effective_weight() for e in experts],
            self.kernel,
        )
        if self.shared_experts is not None:
            out = out + self.shared_experts(x_NH)
        return out
