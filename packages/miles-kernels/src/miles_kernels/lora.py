"""LoRA adapters on the model's linear layers: `W' = W + scaling * B @ A` (A: rank x in, B: out x rank), PEFT's
names and semantics (`LoraConfig` in config.py), for the trainer (adapters that train on a frozen base) and the engine
(the RL policy's adapters merged into its base; adapters served per request, `ServedLoras`).

True on-policy with adapters: `merge_lora` computes the merged weight with the batch-invariant `linear` (a fixed
order of operations for given shapes), so the trainer, whose deterministic forward runs the merged weight every step
(gradients reach A and B through the merge), and the engine, which merges every adapter it receives with the same
function on the same values, run identical matmuls on identical weights: the log-prob mismatch stays exactly 0. Fast
mode may run the un-merged form `x W^T + scaling * (x A^T) B^T` instead (`Linear.forward`).

Where a model reads a weight directly rather than calling its linear layer (MoE experts, MLA's absorbed kv_b_proj)
it reads `Linear.effective_weight()`, so adapters reach those too (merged, in both modes).
Shapes: N rows, K in features, O out features, R rank.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from miles_kernels.config import LoraConfig
from miles_kernels.layers import Linear
from miles_kernels.ops.linear import merge_lora

if TYPE_CHECKING:
    from miles_kernels.model import CausalLM

ADAPTER_SUFFIXES = (".lora_A", ".lora_B")


def _matches(name: str, target: str) -> bool:
    """PEFT's rule for a `target_modules` list entry: the layer's name, or its last dotted parts."""
    return name == target or name.endswith("." + target)


def target_names(model: CausalLM, config: LoraConfig) -> list[str]:
    """The names of the linear layers `config.target_modules` selects (PEFT's matching: a list entry equal to the
    name or to its last dotted parts; 'all-linear'; or one regex over the full name), among the decoder's trunk
    layers. ValueError when it selects nothing, or names a layer that cannot take an adapter.

    PEFT's `all-linear` leaves the output layer out; routers stay frozen too (an adapter would move the routing that
    routing replay and the MoE load balance depend on), as do MTP layers (their own loss trains them whole)."""
    candidates = model.trunk_linears()
    targets = config.target_modules
    if targets == "all-linear":
        chosen = list(candidates)
    elif isinstance(targets, str):
        chosen = [name for name in candidates if re.fullmatch(targets, name)]
    else:
        chosen = [name for name in candidates if any(_matches(name, t) for t in targets)]
        unknown = [t for t in targets if not any(_matches(name, t) for name in candidates)]
        if unknown:
            kinds = sorted({name.rsplit(".", 1)[-1] for name in candidates})
            raise ValueError(
                f"lora target_modules {unknown} match no linear layer of the {model.config.architecture} decoder "
                f"(its layers end in {kinds}; the LM head, embeddings, routers and MTP layers take no adapter)"
            )
    if not chosen:
        raise ValueError(f"lora target_modules {targets!r} match no linear layer of the decoder")
    return chosen


def add_lora(model: CausalLM, config: LoraConfig) -> list[str]:
    """Give the selected linear layers adapters (A: PEFT's Kaiming-uniform init, drawn from a generator seeded by the
    layer's name, so every rank and every run draws the same; B: zeros, so the adapted model starts as the base).
    Adapters take the layer's dtype and device. Returns the adapted layers' names."""
    if not config.is_enabled:
        raise ValueError("lora rank is 0: there are no adapters to add")
    names = target_names(model, config)
    modules = dict(model.named_modules())
    for name in names:
        layer = modules[name]
        assert isinstance(layer, Linear)
        a, b = initial_adapter(name, config.rank, *layer.weight.shape)
        layer.lora_A = nn.Parameter(a.to(layer.weight.dtype).to(layer.weight.device))
        layer.lora_B = nn.Parameter(b.to(layer.weight.dtype).to(layer.weight.device))
        layer.lora_scaling = config.scaling
    return names


def initial_adapter(name: str, rank: int, out_features: int, in_features: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The float32 (A, B) a layer named `name` starts with (`add_lora`; the Megatron trainer's per-projection
    adapters too): A by PEFT's Kaiming-uniform init from a generator seeded by the name, B zeros."""
    generator = torch.Generator().manual_seed(zlib.crc32(name.encode()))
    a = torch.empty(rank, in_features)
    nn.init.kaiming_uniform_(a, a=math.sqrt(5), generator=generator)  # PEFT's default init of lora_A
    return a, torch.zeros(out_features, rank)


def adapted_layers(model: nn.Module) -> dict[str, Linear]:
    """The model's linear layers that hold adapters, by name."""
    return {n: m for n, m in model.named_modules() if isinstance(m, Linear) and m.lora_A is not None}


def is_adapter_name(name: str) -> bool:
    """True for an adapter tensor's name (`...q_proj.lora_A`)."""
    return name.endswith(ADAPTER_SUFFIXES)


def adapter_tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    """The adapters' tensors under the model's names (`model.layers.0.self_attn.q_proj.lora_A`)."""
    return {name: p for name, p in model.named_parameters() if is_adapter_name(name)}


@contextlib.contextmanager
def disabled_adapters(model: nn.Module) -> Iterator[None]:
    """Run the base model alone inside the block (PEFT's `disable_adapter`): a LoRA run's KL reference is its base,
    so it needs no copy of its own."""
    layers = list(adapted_layers(model).values())
    for layer in layers:
        layer.lora_disabled = True
    try:
        yield
    finally:
        for layer in layers:
            layer.lora_disabled = False


@torch.no_grad()
def fold_adapters(model: nn.Module) -> int:
    """Merge every layer's adapter into a weight it runs from now on (the engine, after each adapter update: one merge
    per update, not per step); the base weight itself stays as loaded. Returns how many layers were merged."""
    layers = adapted_layers(model)
    for layer in layers.values():
        assert layer.lora_A is not None and layer.lora_B is not None
        layer.folded = merge_lora(layer.weight, layer.lora_A, layer.lora_B, layer.lora_scaling, layer.kernel)
    return len(layers)


def folded_weights(model: nn.Module) -> list[torch.Tensor]:
    """The merged weights `fold_adapters` made (memory the engine releases with its weights)."""
    return [m.folded for m in adapted_layers(model).values() if m.folded is not None]


# ---------------------------------------------------------------------------------------------- PEFT's format

PEFT_CONFIG = "adapter_config.json"
PEFT_WEIGHTS = "adapter_model.safetensors"
_PEFT_PREFIX = "base_model.model."


def peft_adapter_config(config: LoraConfig, layers: list[str], base_model: str = "") -> dict[str, Any]:
    """PEFT's `adapter_config.json` for adapters on `layers`: `target_modules` lists the layers' last names (what
    PEFT matches), so PEFT adapts the same layers whatever `config.target_modules` said."""
    return {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base_model,
        "r": config.rank, "lora_alpha": config.alpha, "use_rslora": config.use_rslora,
        "target_modules": sorted({name.rsplit(".", 1)[-1] for name in layers}),
        "lora_dropout": 0.0, "bias": "none", "fan_in_fan_out": False, "use_dora": False,
        "init_lora_weights": True, "modules_to_save": None, "layers_to_transform": None,
        "rank_pattern": {}, "alpha_pattern": {},
    }  # fmt: skip


def peft_tensor_name(name: str) -> str:
    """PEFT's file name of an adapter tensor: `model.layers.0.self_attn.q_proj.lora_A` ->
    `base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight`."""
    return f"{_PEFT_PREFIX}{name}.weight"


def save_peft_adapter(
    directory: str | os.PathLike[str], config: LoraConfig, tensors: dict[str, torch.Tensor], base_model: str = ""
) -> Path:
    """Write adapters (model names, `adapter_tensors`) as a PEFT adapter directory (`adapter_config.json` +
    `adapter_model.safetensors`) that `peft.PeftModel.from_pretrained` loads onto the Hugging Face base model."""
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    layers = sorted({name.rsplit(".", 1)[0] for name in tensors})
    save_file({peft_tensor_name(n): t.detach().to("cpu").contiguous() for n, t in tensors.items()},
              str(out / PEFT_WEIGHTS), metadata={"format": "pt"})  # fmt: skip
    (out / PEFT_CONFIG).write_text(json.dumps(peft_adapter_config(config, layers, base_model), indent=2))
    return out


# PEFT settings an adapter here cannot honour, with the value it must have
_PEFT_FIXED = {
    "peft_type": "LORA", "bias": "none", "use_dora": False, "fan_in_fan_out": False, "modules_to_save": None,
    "layers_to_transform": None, "rank_pattern": {}, "alpha_pattern": {},
}  # fmt: skip


def read_peft_adapter(directory: str | os.PathLike[str]) -> tuple[LoraConfig, dict[str, torch.Tensor]]:
    """Read a PEFT LoRA adapter directory: its config and its tensors under the model's names (`...q_proj.lora_A`).
    ValueError naming what is wrong: no such files, a PEFT setting not supported here (DoRA, biases, per-layer
    ranks, ...), or tensor names that are not PEFT LoRA names."""
    path = Path(directory)
    if not (path / PEFT_CONFIG).is_file() or not (path / PEFT_WEIGHTS).is_file():
        raise ValueError(f"{directory} is not a PEFT adapter directory: it needs {PEFT_CONFIG} and {PEFT_WEIGHTS}")
    try:
        raw = json.loads((path / PEFT_CONFIG).read_text())
    except json.JSONDecodeError as error:
        raise ValueError(f"{path / PEFT_CONFIG} is not JSON: {error}") from error
    for key, value in _PEFT_FIXED.items():
        got = raw.get(key, value)
        if got != value and (value or got):  # None, {} and [] all mean "none"
            raise ValueError(f"{PEFT_CONFIG}: {key}={got!r} is not supported here (it must be {value!r})")
    try:
        config = LoraConfig(
            rank=raw.get("r", 8), alpha=raw.get("lora_alpha", 8), use_rslora=bool(raw.get("use_rslora", False)),
            target_modules=raw.get("target_modules") or "all-linear",
        )  # fmt: skip
    except ValueError as error:
        raise ValueError(f"{PEFT_CONFIG}: {error}") from error
    tensors = {}
    for name, tensor in load_file(str(path / PEFT_WEIGHTS)).items():
        if not (name.startswith(_PEFT_PREFIX) and name.endswith((".lora_A.weight", ".lora_B.weight"))):
            raise ValueError(
                f"{PEFT_WEIGHTS}: {name!r} is not a PEFT LoRA tensor (base_model.model.<layer>.lora_A.weight)"
            )
        tensors[name[len(_PEFT_PREFIX) : -len(".weight")]] = tensor
    if not tensors:
        raise ValueError(f"{PEFT_WEIGHTS} holds no tensors")
    return config, tensors
