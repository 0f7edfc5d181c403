"""CPU numerics tier: miles-memory's planner's LoRA terms against the tensors of real tiny
models (miles_kernels.testing) given adapters by miles_kernels.add_lora, for a dense, an MoE, a GLM-4.5 and a
DeepSeek-V3 (MLA) model and several target_modules: the adapter parameters layer by layer, the engine's adapters and
folded weights, a LoRA trainer's resident state after an AdamW step, and what the adapters add to the activations
autograd saves (counted by ActivationMeter) in deterministic and fast mode."""

from __future__ import annotations

import pytest
import torch

import miles_kernels as kernels
import miles_kernels.testing as testing
from miles_memory import (
    ActivationMeter,
    LoraSettings,
    ModelShape,
    embedded_engine_bytes,
    fsdp2_bytes,
    lora_layer_bytes,
)

KINDS = ("dense", "moe", "glm", "deepseek")
Targets = str | tuple[str, ...]
ALL = "all-linear"
# per family: all-linear, a list of names (a routed expert's by index), one regex over the full names (layer 1 only)
CASES: list[tuple[str, Targets]] = [
    *[("dense", t) for t in (ALL, ("o_proj", "up_proj"), r"model\.layers\.1\..*")],
    *[(kind, t) for kind in ("moe", "glm") for t in (ALL, ("o_proj", "up_proj"), ("experts.0.up_proj", "down_proj"))],
    *[("deepseek", t) for t in (ALL, ("kv_b_proj", "q_a_proj"), ("experts.0.up_proj", "down_proj"))],
    ("glm", r"model\.layers\.1\.mlp\..*"),
]
RANK = 4


def tiny(kind: str) -> object:
    return testing.tiny_config(kind, num_nextn_predict_layers=1)  # an MTP layer, which takes no adapter


def lora_config(targets: Targets) -> object:
    return kernels.config.LoraConfig(rank=RANK, target_modules=targets if isinstance(targets, str) else list(targets))


def adapted_model(kind: str, targets: Targets, kernel: object = None) -> tuple[object, ModelShape]:
    """A tiny random model with adapters on `targets`, and its shape as the planner reads its config.json."""
    config = tiny(kind)
    model = testing.random_model(config, kernel)
    kernels.add_lora(model, lora_config(targets))
    return model, ModelShape.from_hf(config.to_hf())


def layer_of(name: str) -> int:
    return int(name.split(".")[2])  # model.layers.{i}.…


@pytest.mark.parametrize(("kind", "targets"), CASES, ids=str)
def test_adapters_and_adapted_weights_match_add_lora(kind: str, targets: Targets) -> None:
    model, shape = adapted_model(kind, targets)
    real_adapters: dict[int, int] = {}
    for name, tensor in kernels.adapter_tensors(model).items():
        real_adapters[layer_of(name)] = real_adapters.get(layer_of(name), 0) + tensor.numel()
    planned_adapters: dict[int, int] = {}
    for t in shape.lora_tensors(RANK, targets):
        assert t.layer is not None
        planned_adapters[t.layer] = planned_adapters.get(t.layer, 0) + t.numel
    assert planned_adapters == real_adapters
    layers = kernels.adapted_layers(model)
    assert sum(t.copies for t in shape.lora_targets(targets)) == len(layers)
    assert sum(t.numel for t in shape.lora_targets(targets)) == sum(m.weight.numel() for m in layers.values())


@pytest.mark.parametrize(
    ("kind", "targets"),
    [("dense", ("experts.0.up_proj",)), ("dense", ("kv_b_proj",)), ("deepseek", ("q_proj", "v_proj")),
     ("moe", ("gate",)), ("glm", ("lm_head",)), ("dense", ("embed_tokens",)), ("dense", ("eh_proj",)),
     ("dense", r"model\.layers\.2\..*")],
    ids=str,
)  # fmt: skip
def test_targets_the_kernels_refuse_the_planner_refuses(kind: str, targets: Targets) -> None:
    """Routers, the LM head, embeddings and the MTP layer (layer 2 here) take no adapter; names another family has."""
    config = tiny(kind)
    with pytest.raises(ValueError, match="match no linear layer"):
        kernels.add_lora(testing.random_model(config), lora_config(targets))
    with pytest.raises(ValueError, match="match no linear layer"):
        ModelShape.from_hf(config.to_hf()).lora_targets(targets)


@pytest.mark.parametrize("kind", KINDS)
def test_the_engines_adapters_and_folded_weights(kind: str) -> None:
    """What an engine holds for a LoRA policy (miles_rollout/engine.py): the adapters, and after `fold_adapters` a
    merged weight of each adapted layer, all in the kernel dtype."""
    kernel = kernels.KernelConfig(dtype="bfloat16")
    model, shape = adapted_model(kind, ALL, kernel)
    assert kernels.fold_adapters(model) > 0
    held = sum(p.numel() * p.element_size() for p in model.parameters())
    held += sum(t.numel() * t.element_size() for t in kernels.folded_weights(model))
    planned = embedded_engine_bytes(shape, "bfloat16", 4, 16, lora=LoraSettings(RANK))
    assert planned["weights"] + planned["lora"] == held


@pytest.mark.parametrize("base_dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("kind", KINDS)
def test_a_lora_trainers_resident_state_after_a_step(kind: str, base_dtype: str) -> None:
    """One rank's parameters, gradients and AdamW state as the trainer holds them (miles_trainer/lora.py: the base
    frozen and cast to base_dtype, the adapters float32 and the only parameters in the fused AdamW) after a step,
    against fsdp2_bytes' weights + adapters, grads and optimizer."""
    targets = ("q_b_proj", "kv_a_proj_with_mqa", "down_proj") if kind == "deepseek" else ("q_proj", "down_proj")
    model, shape = adapted_model(kind, targets)
    mtp = f"model.layers.{shape.num_hidden_layers}."
    trunk = [(n, p) for n, p in model.named_parameters() if not n.startswith(mtp)]
    adapters = [p for n, p in trunk if kernels.is_adapter_name(n)]
    for name, param in trunk:
        if not kernels.is_adapter_name(name):
            param.requires_grad_(False)
            param.data = param.data.to(getattr(torch, base_dtype))
    optimizer = torch.optim.AdamW(adapters, lr=1e-3, fused=True)
    for param in adapters:
        param.grad = torch.ones_like(param)
    optimizer.step()
    planned = fsdp2_bytes(shape, 1, "bfloat16", 64, lora=LoraSettings(RANK, targets, base_dtype))
    assert planned["weights"] + planned["adapters"] == sum(p.numel() * p.element_size() for _, p in trunk)
    assert planned["grads"] == sum(p.grad.numel() * p.grad.element_size() for _, p in trunk if p.grad is not None)
    state = [v for s in optimizer.state.values() for v in s.values()]
    assert planned["optimizer"] == sum(v.numel() * v.element_size() for v in state)


TOKENS = 128  # 8 sequences of 16


def saved_bytes(model: object, kernel: object) -> int:
    """Peak bytes autograd saves in a forward of 8 packed 16-token sequences (every routed expert gets tokens: the
    planner assumes balanced routing, and an expert no token chose keeps no merged weight)."""
    batch = kernels.build_packed_batch([16] * 8, kernel.page_size, kernel.attention_query_tile)
    ids = torch.randint(0, 256, (TOKENS,), generator=torch.Generator().manual_seed(0))
    meter = ActivationMeter()
    with meter:
        hidden = model.forward_hidden(ids, batch)
    hidden.sum().backward()
    for index, moe in model.moe_layers().items():
        chosen = moe.last_routing.expert_ids.unique().numel()
        assert chosen == model.config.num_experts, f"layer {index}: {chosen} experts chosen; change the tokens"
    return meter.peak_bytes


@pytest.mark.parametrize("mode", ["deterministic", "fast"])
@pytest.mark.parametrize(
    ("kind", "targets"),
    # merged and un-merged layers of each family: attention and the experts' up_proj (MoE), the shared expert's and
    # dense layer's down_proj beside one expert's up_proj (GLM), MLA's projections with the experts (DeepSeek-V3)
    [("dense", ALL), ("moe", ("o_proj", "up_proj")), ("glm", ("experts.0.up_proj", "down_proj")), ("deepseek", ALL)],
    ids=str,
)
def test_what_adapters_add_to_the_saved_activations(kind: str, targets: Targets, mode: str) -> None:
    """The forward's saved bytes with adapters less those without, every parameter trainable in both (so the base's
    own saves are the same; a frozen base saves somewhat less, which the planner does not subtract): exactly
    lora_layer_bytes, the merged weight of each adapted layer in deterministic mode, x A^T (N x r) in fast mode (the
    routed experts merged in both)."""
    kernel = kernels.KernelConfig(mode=mode)
    base = testing.random_model(tiny(kind), kernel).train()
    model, shape = adapted_model(kind, targets, kernel)
    model.train().requires_grad_(True)
    added = saved_bytes(model, kernel) - saved_bytes(base, kernel)
    planned = lora_layer_bytes(shape, LoraSettings(RANK, targets), TOKENS, 4, mode == "deterministic")
    assert added == sum(planned.values())
