"""CPU numerics: LoRA adapters on the model (miles_kernels.lora). The merged forward equals a plain model whose weights
were merged independently (torch's `W + s * B @ A`) within float32 tolerance and the engine's folded weights bit for
bit; fast mode's un-merged form agrees within tolerance; gradients reach only the adapters; PEFT's matching rules
choose the layers; PEFT's file format round-trips and its unsupported settings are refused; a model with adapters
loads a base checkpoint or a set of adapters as a complete set."""

from __future__ import annotations

import json

import pytest
import torch

from miles_kernels import (
    adapter_tensors,
    add_lora,
    build_packed_batch,
    checkpoint_tensors,
    fold_adapters,
    load_state,
    read_peft_adapter,
    save_peft_adapter,
    target_names,
)
from miles_kernels.config import KernelConfig, LoraConfig
from miles_kernels.testing import packed_logits, random_model, tiny_config

KERNEL = KernelConfig(page_size=8, attention_query_tile=4, linear_tile=4, moe_tile=4)
FAMILIES = ["dense", "moe", "glm", "deepseek"]


def adapted(kind: str, config: LoraConfig, kernel: KernelConfig = KERNEL, seed: int = 0):
    model = random_model(tiny_config(kind), kernel, seed=3)
    names = add_lora(model, config)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in adapter_tensors(model).items():
            if name.endswith("lora_B"):  # B starts at zero: give it values so the adapter does something
                param.copy_(0.05 * torch.randn(param.shape, generator=generator))
    return model, names


SEQS = [torch.tensor([5, 17, 3, 99, 250, 7, 31]), torch.tensor([1, 2, 3, 4, 5])]


@pytest.mark.parametrize("kind", FAMILIES)
def test_merged_forward_matches_an_independent_merge_and_the_folded_engine(kind: str) -> None:
    config = LoraConfig(rank=4, alpha=8, use_rslora=kind == "moe")
    model, names = adapted(kind, config)
    merged = packed_logits(model, SEQS)
    reference = random_model(tiny_config(kind), KERNEL, seed=3)
    layers = dict(model.named_modules())
    weights = dict(reference.named_parameters())
    with torch.no_grad():
        for name in names:
            layer = layers[name]
            weights[f"{name}.weight"].copy_(layer.weight + config.scaling * (layer.lora_B @ layer.lora_A))
    for ours, theirs in zip(merged, packed_logits(reference, SEQS), strict=True):
        torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-5)
    assert fold_adapters(model) == len(names)
    assert all(torch.equal(a, b) for a, b in zip(merged, packed_logits(model, SEQS), strict=True))


@pytest.mark.parametrize("kind", FAMILIES)
def test_fast_mode_runs_the_unmerged_form_within_tolerance(kind: str) -> None:
    deterministic, _ = adapted(kind, LoraConfig(rank=4, alpha=8))
    fast_kernel = KERNEL.model_copy(update={"mode": "fast"})
    fast, _ = adapted(kind, LoraConfig(rank=4, alpha=8), fast_kernel)
    for ours, theirs in zip(packed_logits(deterministic, SEQS), packed_logits(fast, SEQS), strict=True):
        torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-5)


def test_gradients_reach_only_the_adapters() -> None:
    model, _ = adapted("dense", LoraConfig(rank=4))
    for name, param in model.named_parameters():
        param.requires_grad_(name.endswith((".lora_A", ".lora_B")))
    batch = build_packed_batch([len(SEQS[0])], KERNEL.page_size, KERNEL.attention_query_tile, SEQS[0].device)
    model.logits(model.forward_hidden(SEQS[0], batch)).logsumexp(-1).sum().backward()
    for name, param in model.named_parameters():
        is_adapter = name.endswith((".lora_A", ".lora_B"))
        assert (param.grad is not None) == is_adapter, name
        if is_adapter:
            assert param.grad.abs().sum() > 0, name


def test_target_modules_follow_peft_matching() -> None:
    dense = random_model(tiny_config("dense"), KERNEL)
    every = target_names(dense, LoraConfig(rank=2))
    assert len(every) == 7 * dense.config.num_hidden_layers and not any("lm_head" in n for n in every)
    assert target_names(dense, LoraConfig(rank=2, target_modules=["q_proj", "mlp.down_proj"])) == [
        n for n in every if n.endswith(("q_proj", "down_proj"))
    ]
    assert target_names(dense, LoraConfig(rank=2, target_modules=r"model\.layers\.0\..*_proj")) == [
        n for n in every if n.startswith("model.layers.0.")
    ]
    with pytest.raises(ValueError, match=r"\['w_q'\] match no linear layer.*q_proj"):
        target_names(dense, LoraConfig(rank=2, target_modules=["w_q"]))
    moe = random_model(tiny_config("glm", num_nextn_predict_layers=1), KERNEL)
    names = target_names(moe, LoraConfig(rank=2))
    assert any(".experts.0.gate_proj" in n for n in names) and any("shared_experts" in n for n in names)
    assert not any(n.endswith("mlp.gate") for n in names)  # routers stay frozen
    trunk = moe.config.num_hidden_layers
    assert not any(n.startswith(f"model.layers.{trunk}.") for n in names)  # the MTP layer takes none
    mla = random_model(tiny_config("deepseek"), KERNEL)
    kinds = {n.rsplit(".", 1)[-1] for n in target_names(mla, LoraConfig(rank=2))}
    assert {"q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj"} <= kinds


def test_peft_files_round_trip_and_unsupported_settings_are_refused(tmp_path) -> None:
    config = LoraConfig(rank=4, alpha=16, use_rslora=True, target_modules=["q_proj", "v_proj"])
    model, _ = adapted("dense", config)
    tensors = {n: t.detach() for n, t in adapter_tensors(model).items()}
    out = save_peft_adapter(tmp_path / "adapter", config, tensors, base_model="base")
    read_config, read = read_peft_adapter(out)
    assert read_config.rank == 4 and read_config.alpha == 16 and read_config.use_rslora
    assert read_config.scaling == config.scaling
    assert read.keys() == tensors.keys() and all(torch.equal(read[n], t) for n, t in tensors.items())
    raw = json.loads((out / "adapter_config.json").read_text())
    for key, value in {"use_dora": True, "bias": "all", "rank_pattern": {"q_proj": 8}}.items():
        (out / "adapter_config.json").write_text(json.dumps({**raw, key: value}))
        with pytest.raises(ValueError, match=f"{key}=.* is not supported"):
            read_peft_adapter(out)
    with pytest.raises(ValueError, match="not a PEFT adapter directory"):
        read_peft_adapter(tmp_path)


def test_a_model_with_adapters_takes_a_base_checkpoint_or_a_set_of_adapters() -> None:
    model, _ = adapted("dense", LoraConfig(rank=2))
    state = {n: t.clone() for n, t in checkpoint_tensors(model).items()}
    base = {n: t for n, t in state.items() if not n.endswith(("lora_A", "lora_B"))}
    adapters = {n: t for n, t in state.items() if n.endswith(("lora_A", "lora_B"))}
    load_state(model, base)
    load_state(model, adapters)
    load_state(model, state)
    with pytest.raises(ValueError, match="missing 1 tensor"):
        load_state(model, dict(list(adapters.items())[1:]))
    with pytest.raises(ValueError, match="missing 1 tensor"):
        load_state(model, dict(list(base.items())[1:]))
