"""CPU numerics: LoRA adapters served per request (`AdapterSlots`). Sequences of two adapters and of the base model
packed into one forward each equal that sequence run alone, bit for bit in deterministic mode, and the model whose
weights merge the adapter (W + scaling * B @ A, PEFT's formula, computed here in plain torch) within fp32 rounding;
the layers that cannot take a per-row adapter (experts, routers, MLA's kv_b_proj, the LM head, MTP layers) are
refused by name."""

from __future__ import annotations

from typing import Literal

import pytest
import torch

from miles_kernels import AdapterSlots, CausalLM, KernelConfig
from miles_kernels.config import LoraConfig
from miles_kernels.testing import random_adapter, random_model, tiny_config
from miles_kernels.testing.paged_runner import packed_logits

TARGETS = ["q_proj", "v_proj", "o_proj", "down_proj"]


Adapter = tuple[LoraConfig, dict[str, torch.Tensor]]


def make_adapter(model: CausalLM, seed: int, targets: list[str] | str = TARGETS, rank: int = 4) -> Adapter:
    """A random adapter on `targets` (B nonzero, so it changes the output), under the model's tensor names."""
    config = LoraConfig(rank=rank, alpha=8.0, target_modules=targets)
    return config, random_adapter(model, config, seed)


def merged(model: CausalLM, config: LoraConfig, tensors: dict[str, torch.Tensor]) -> CausalLM:
    """`model` with the adapter merged into its weights in plain torch: W + scaling * B @ A."""
    modules = dict(model.named_modules())
    with torch.no_grad():
        for name in {n.rsplit(".", 1)[0] for n in tensors}:
            a, b = tensors[f"{name}.lora_A"], tensors[f"{name}.lora_B"]
            modules[name].weight.add_(config.scaling * (b.double() @ a.double()).float())
    return model


def sequences() -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(3)
    return [torch.randint(0, 256, (n,), generator=generator) for n in (11, 5, 17)]


def served_logits(
    slots: AdapterSlots, model: CausalLM, seqs: list[torch.Tensor], adapters: list[str | None]
) -> list[torch.Tensor]:
    slots.set_rows([a for seq, a in zip(seqs, adapters, strict=True) for _ in range(len(seq))])
    try:
        return packed_logits(model, seqs)
    finally:
        slots.clear_rows()


@pytest.mark.parametrize("mode", ["deterministic", "fast"])
def test_each_row_gets_its_own_adapter(mode: Literal["deterministic", "fast"]) -> None:
    kernel = KernelConfig(mode=mode)
    config = tiny_config("dense")
    model = random_model(config, kernel)
    slots = AdapterSlots(model, kernel)
    adapter_a, adapter_b = make_adapter(model, 1), make_adapter(model, 2, ["k_proj", "gate_proj", "up_proj"], rank=2)
    slots.load("a", *adapter_a)
    slots.load("b", *adapter_b)
    seqs, names = sequences(), ["a", "b", None]
    together = served_logits(slots, model, seqs, names)
    base = packed_logits(random_model(config, kernel), seqs)
    references = [packed_logits(merged(random_model(config, kernel), *a), seqs) for a in (adapter_a, adapter_b)]
    for i, name in enumerate(names):
        want = base[i] if name is None else references[names.index(name)][i]
        torch.testing.assert_close(together[i], want, atol=2e-5, rtol=1e-4)
        if mode == "deterministic":  # batch-invariant: the other rows and their adapters change nothing
            assert torch.equal(together[i], served_logits(slots, model, [seqs[i]], [name])[0])
            assert name is not None or torch.equal(together[i], base[i])
    assert (together[0] - base[0]).abs().max() > 1e-2  # the adapter changes the output: the test sees it


def test_unload_and_clear_leave_the_base_model() -> None:
    kernel = KernelConfig(mode="deterministic")
    model = random_model(tiny_config("dense"), kernel)
    slots = AdapterSlots(model, kernel)
    slots.load("a", *make_adapter(model, 1))
    seqs = sequences()[:1]
    base = packed_logits(model, seqs)[0]  # no rows set: the base model
    assert not torch.equal(served_logits(slots, model, seqs, ["a"])[0], base)
    slots.unload("a")
    assert "a" not in slots.adapters and torch.equal(packed_logits(model, seqs)[0], base)


def test_lm_head_and_mtp_layers_carry_no_adapter() -> None:
    kernel = KernelConfig()
    model = random_model(tiny_config("dense", num_nextn_predict_layers=1), kernel)
    slots = AdapterSlots(model, kernel)
    assert model.lm_head.served is None
    assert all(m.served is None for m in model.mtp_layers[0].modules() if hasattr(m, "served"))
    assert slots.layers and all(name.startswith(("model.layers.0.", "model.layers.1.")) for name in slots.layers)
    a = torch.zeros(2, model.config.hidden_size)
    for layer in ("lm_head", "model.layers.2.eh_proj"):
        with pytest.raises(ValueError, match=r"matches no linear layer .* MTP layers take none"):
            slots.check({f"{layer}.lora_A": a, f"{layer}.lora_B": torch.zeros(8, 2)})


@pytest.mark.parametrize(
    ("kind", "layer"),
    [("moe", "model.layers.0.mlp.experts.0.up_proj"), ("moe", "model.layers.0.mlp.gate"),
     ("deepseek", "model.layers.0.self_attn.kv_b_proj")],
)  # fmt: skip
def test_layers_read_directly_are_refused(kind: Literal["moe", "deepseek"], layer: str) -> None:
    kernel = KernelConfig()
    model = random_model(tiny_config(kind), kernel)
    slots = AdapterSlots(model, kernel)
    out_features, in_features = dict(model.named_modules())[layer].weight.shape
    tensors = {f"{layer}.lora_A": torch.zeros(2, in_features), f"{layer}.lora_B": torch.zeros(out_features, 2)}
    with pytest.raises(ValueError, match="cannot take a per-request adapter"):
        slots.load("x", LoraConfig(rank=2), tensors)
    attention = make_adapter(model, 1, ["q_proj", "o_proj"] if kind == "moe" else ["o_proj"])
    slots.load("attention", *attention)  # the attention layers of the same model take one


def test_bad_tensors_are_named() -> None:
    kernel = KernelConfig()
    model = random_model(tiny_config("dense"), kernel)
    slots = AdapterSlots(model, kernel)
    layer = "model.layers.0.self_attn.q_proj"
    with pytest.raises(ValueError, match="only: it needs lora_A and lora_B"):
        slots.check({f"{layer}.lora_A": torch.zeros(2, 64)})
    with pytest.raises(ValueError, match="do not fit a 64 -> 64 layer"):
        slots.check({f"{layer}.lora_A": torch.zeros(2, 32), f"{layer}.lora_B": torch.zeros(64, 2)})
    with pytest.raises(ValueError, match="holds no tensors"):
        slots.check({})
