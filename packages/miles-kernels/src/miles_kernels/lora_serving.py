"""Adapters served per request (SGLang's multi-LoRA: `lora_path` on a request): several adapters resident at once, a
batch mixing them, each row computing `x W^T + scaling * (x A^T) B^T` with its own request's adapter (un-merged: the
base weights are shared by every request).

`AdapterSlots` is attached to the linear layers of the model's decoder trunk (not the LM head, not the MTP draft
layers); the engine names the adapter of every row before each forward (`set_rows`). A row's adapter output goes
through the batch-invariant `linear` over the rows of that adapter only and is added to the row once, so in
deterministic mode a request's output does not depend on which other requests (or adapters) share its batch. Layers
whose weight a model reads directly rather than through its linear layer (MoE experts, MLA's kv_b_proj) cannot take a
per-row adapter: `check` refuses them.
Shapes: N rows, K in features, O out features, R rank.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from miles_kernels.config import KernelConfig, LoraConfig
from miles_kernels.layers import Linear
from miles_kernels.ops.linear import linear

if TYPE_CHECKING:
    from miles_kernels.model import CausalLM

# Layers that read their weight directly (sparse_moe.py SparseMoE, latent_attention.py): no per-row adapter there.
_DIRECT_WEIGHT = (".experts.", ".kv_b_proj")


@dataclass
class Adapter:
    """One served adapter: its config and, per layer name, (A (R, K), B (O, R)) in the model's dtype."""

    config: LoraConfig
    layers: dict[str, tuple[torch.Tensor, torch.Tensor]]


class AdapterSlots:
    """The adapters a model serves per request, by name, and the current batch's row -> adapter assignment."""

    def __init__(self, model: CausalLM, kernel: KernelConfig) -> None:
        self.kernel = kernel
        # The decoder trunk's layers only: the LM head and the MTP (draft) layers never take a served adapter, as
        # SGLang's draft runs unadapted.
        trunk = tuple(f"model.layers.{i}." for i in range(model.config.num_hidden_layers))
        self.layers = {n: m for n, m in model.named_modules() if isinstance(m, Linear) and n.startswith(trunk)}
        self.adapters: dict[str, Adapter] = {}
        self._groups: list[tuple[Adapter, torch.Tensor]] = []  # the batch's rows of each adapter
        for name, layer in self.layers.items():
            layer.served, layer.served_name = self, name

    def check(self, tensors: dict[str, torch.Tensor]) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """Adapter tensors (model names: `...q_proj.lora_A` / `.lora_B`) as {layer: (A, B)}; ValueError naming a
        tensor that fits no layer (unknown layer, a layer that cannot take a served adapter, a wrong shape, A without
        B)."""
        pairs: dict[str, dict[str, torch.Tensor]] = {}
        for name, tensor in tensors.items():
            layer, _, kind = name.rpartition(".")
            if kind not in ("lora_A", "lora_B") or layer not in self.layers:
                raise ValueError(
                    f"adapter tensor {name!r} matches no linear layer of the served model's decoder layers (served "
                    "adapters go on the trunk's attention and MLP layers; the LM head, embeddings and MTP layers take "
                    "none)"
                )
            if any(part in layer for part in _DIRECT_WEIGHT) or layer.endswith("mlp.gate"):
                raise ValueError(
                    f"adapter tensor {name!r}: {layer} cannot take a per-request adapter here (MoE experts, routers "
                    "and MLA's kv_b_proj read their weights directly); serve adapters on attention and dense MLP "
                    "layers, or merge this one into the weights"
                )
            pairs.setdefault(layer, {})[kind] = tensor
        out = {}
        for layer, pair in pairs.items():
            if set(pair) != {"lora_A", "lora_B"}:
                raise ValueError(f"adapter layer {layer} has {sorted(pair)} only: it needs lora_A and lora_B")
            a, b = pair["lora_A"], pair["lora_B"]
            out_features, in_features = self.layers[layer].weight.shape
            if (
                a.dim() != 2
                or b.dim() != 2
                or a.shape[1] != in_features
                or b.shape[0] != out_features
                or (a.shape[0] != b.shape[1])
            ):
                raise ValueError(
                    f"adapter layer {layer}: lora_A {tuple(a.shape)} / lora_B {tuple(b.shape)} do not fit a "
                    f"{in_features} -> {out_features} layer (A: rank x {in_features}, B: {out_features} x rank)"
                )
            weight = self.layers[layer].weight
            out[layer] = (a.to(weight.device, weight.dtype), b.to(weight.device, weight.dtype))
        if not out:
            raise ValueError("the adapter holds no tensors")
        return out

    def load(self, name: str, config: LoraConfig, tensors: dict[str, torch.Tensor]) -> None:
        """Make adapter `name` servable (replacing one of that name); ValueError as `check`."""
        self.adapters[name] = Adapter(config, self.check(tensors))

    def unload(self, name: str) -> None:
        self.adapters.pop(name, None)

    def set_rows(self, row_adapters: Sequence[str | None]) -> None:
        """Name the adapter of each row of the next forward (None: the base model); every name must be loaded."""
        by_name: dict[str, list[int]] = {}
        for row, name in enumerate(row_adapters):
            if name is not None:
                by_name.setdefault(name, []).append(row)
        device = next(iter(self.layers.values())).weight.device  # once per forward, not once per layer
        self._groups = [
            (self.adapters[name], torch.tensor(rows, device=device)) for name, rows in sorted(by_name.items())
        ]

    def clear_rows(self) -> None:
        self._groups = []

    def apply(self, layer: str, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """`out` plus each row's adapter output for `layer` (rows of adapters without this layer: unchanged)."""
        if not self._groups:
            return out
        x_NK, out_NO = x.reshape(-1, x.shape[-1]), out.reshape(-1, out.shape[-1])
        for adapter, rows in self._groups:
            weights = adapter.layers.get(layer)
            if weights is None:
                continue
            a_RK, b_OR = weights
            delta = adapter.config.scaling * linear(linear(x_NK[rows], a_RK, self.kernel), b_OR, self.kernel)
            out_NO = out_NO.index_add(0, rows, delta.to(out_NO.dtype))
        return out_NO.reshape(out.shape)
