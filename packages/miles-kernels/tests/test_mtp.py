"""MTP (multi-token prediction) modules, DeepSeek-V3 / GLM-4.5 form: the forward equals the formula (with a
`transformers` Qwen3 / Qwen3-MoE / GLM-4.5 layer as the independent reference for the decoder layer: transformers
does not run MTP modules, so GLM-4.5's are checked against the written formula only), checkpoints round-trip with the
MTP copies of the embedding and LM head, a model without MTP still loads, the trunk is untouched, and the MTP
forward is batch-invariant like the trunk. A checkpoint written by transformers (which keeps
`num_nextn_predict_layers` in config.json and writes no MTP tensor) loads as its trunk, with transformers' own
forward as the reference, and says so once; one that holds part of an MTP module is refused."""

from __future__ import annotations

import json
import logging

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, Glm4MoeConfig, Glm4MoeForCausalLM

from miles_kernels import (
    KernelConfig,
    build_packed_batch,
    load_model,
    num_absent_mtp_layers,
    read_model_config,
    save_model,
)
from miles_kernels.testing import (
    packed_logits,
    random_model,
    save_random_model,
    save_transformers_model,
    tiny_config,
)

KERNEL = KernelConfig(page_size=8, attention_query_tile=4, linear_tile=4, moe_tile=4)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def hf_layer_model(model, module: int, directory):
    """A one-layer `transformers` model whose layer is MTP module `module`'s decoder layer and whose final norm
    is its shared_head.norm (written by miles' `save_model`, read by `from_pretrained`): run on inputs_embeds = e,
    its last hidden state is shared_head.norm(decoder_layer(e))."""
    from dataclasses import replace

    from miles_kernels import CausalLM

    # GLM-4.5's and DeepSeek-V3's MTP layer is an MoE layer (its index is past first_k_dense_replace): so is the
    # reference's layer
    dense_first = {"first_k_dense_replace": 0} if model.config.model_type in ("glm4_moe", "deepseek_v3") else {}
    one = CausalLM(replace(model.config, num_hidden_layers=1, num_nextn_predict_layers=0, **dense_first), KERNEL)
    prefix = f"model.layers.{model.config.num_hidden_layers + module}."
    source = model.state_dict()
    state = {name: source[name.replace("model.layers.0.", prefix)] for name in one.state_dict()
             if name.startswith("model.layers.0.")}  # fmt: skip
    state |= {"model.norm.weight": source[prefix + "shared_head.norm.weight"],
              "model.embed_tokens.weight": source["model.embed_tokens.weight"],
              "lm_head.weight": source["lm_head.weight"]}  # fmt: skip
    one.load_state_dict(state)
    save_model(one, directory)
    return AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()


@pytest.mark.parametrize("kind", ["dense", "moe", "glm", "deepseek"])
def test_mtp_forward_is_the_formula(tmp_path, kind: str) -> None:
    config = tiny_config(kind, num_nextn_predict_layers=2, tie_word_embeddings=kind == "dense")
    model = random_model(config, KERNEL, seed=5)
    generator = torch.Generator().manual_seed(5)
    seqs = [torch.randint(0, config.vocab_size, (n,), generator=generator) for n in (7, 13)]
    batch = build_packed_batch([len(s) for s in seqs], KERNEL.page_size, KERNEL.attention_query_tile)
    ids = torch.cat(seqs)
    next_ids = torch.cat([torch.roll(s, -1) for s in seqs])  # the token after each row (the last one: any id)
    with torch.no_grad():
        hidden = model.forward_hidden(ids, batch)
        for module in range(2):
            out = model.mtp_hidden(hidden, next_ids, batch, module)
            mtp = model.mtp_layers[module]
            eps = config.rms_norm_eps
            e = torch.cat([rms_norm(model.model.embed_tokens.weight[next_ids], mtp.enorm.weight, eps),
                           rms_norm(hidden, mtp.hnorm.weight, eps)], dim=-1) @ mtp.eh_proj.weight.T  # fmt: skip
            hf = hf_layer_model(model, module, tmp_path / f"layer{module}")
            for rows in torch.split(torch.arange(len(ids)), [len(s) for s in seqs]):
                want = hf.model(inputs_embeds=e[rows][None]).last_hidden_state[0]
                torch.testing.assert_close(out[rows], want, rtol=0, atol=1e-5)
            # module i + 1 reads module i's output: the chain
            hidden = out
    assert model.logits(out).shape == (len(ids), config.vocab_size)
    with pytest.raises(ValueError, match="MTP module 2 does not exist"):
        model.mtp_hidden(hidden, next_ids, batch, 2)


def test_the_trunk_is_untouched_by_mtp_modules() -> None:
    """The same seed gives the same trunk bits with or without MTP modules, and the same logits."""
    plain = random_model(tiny_config("dense"), KERNEL, seed=6)
    with_mtp = random_model(tiny_config("dense", num_nextn_predict_layers=1), KERNEL, seed=6)
    for name, tensor in plain.state_dict().items():
        assert torch.equal(with_mtp.state_dict()[name], tensor), name
    ids = torch.arange(1, 12)
    batch = build_packed_batch([11], KERNEL.page_size, KERNEL.attention_query_tile)
    with torch.no_grad():
        assert torch.equal(plain.forward_hidden(ids, batch), with_mtp.forward_hidden(ids, batch))
    assert with_mtp.trunk_layers == list(with_mtp.model.layers)[:2] and len(with_mtp.mtp_layers) == 1


@pytest.mark.parametrize("tied", [True, False])
def test_checkpoints_round_trip_with_the_mtp_copies(tmp_path, tied: bool) -> None:
    config = tiny_config("dense", num_nextn_predict_layers=1, tie_word_embeddings=tied)
    model = random_model(config, KERNEL, seed=7)
    save_model(model, tmp_path / "a")
    saved = load_file(tmp_path / "a" / "model.safetensors")
    trunk = config.num_hidden_layers
    # the DeepSeek-V3 / GLM-4.5 layout: the MTP module's copies of the embedding and the LM head under its name
    assert torch.equal(saved[f"model.layers.{trunk}.embed_tokens.weight"], saved["model.embed_tokens.weight"])
    head = saved["model.embed_tokens.weight"] if tied else saved["lm_head.weight"]
    assert torch.equal(saved[f"model.layers.{trunk}.shared_head.head.weight"], head)
    for name in (
        "enorm.weight",
        "hnorm.weight",
        "eh_proj.weight",
        "shared_head.norm.weight",
        "self_attn.q_proj.weight",
    ):
        assert f"model.layers.{trunk}.{name}" in saved, name
    loaded = load_model(tmp_path / "a", KERNEL)
    for name, tensor in model.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], tensor), name
    save_model(loaded, tmp_path / "b")
    again = load_file(tmp_path / "b" / "model.safetensors")
    assert again.keys() == saved.keys() and all(torch.equal(again[k], v) for k, v in saved.items())
    # a checkpoint without the copies loads (they are the trunk's tensors); a copy that differs is refused
    save_file({k: v for k, v in saved.items() if "embed_tokens" not in k or k.startswith("model.embed")},
              str(tmp_path / "a" / "model.safetensors"))  # fmt: skip
    assert torch.equal(load_model(tmp_path / "a", KERNEL).model.embed_tokens.weight, model.model.embed_tokens.weight)
    changed = dict(saved)
    changed[f"model.layers.{trunk}.shared_head.head.weight"] = head + 1.0
    save_file(changed, str(tmp_path / "a" / "model.safetensors"))
    with pytest.raises(ValueError, match=r"shared_head\.head\.weight' differs from"):
        load_model(tmp_path / "a", KERNEL)


def test_mtp_forward_is_batch_invariant() -> None:
    """Deterministic kernels: a sequence's MTP rows have the same bits alone and packed with others."""
    config = tiny_config("moe", num_nextn_predict_layers=1)
    model = random_model(config, KERNEL, seed=8)
    generator = torch.Generator().manual_seed(8)
    seqs = [torch.randint(0, config.vocab_size, (n,), generator=generator) for n in (9, 4, 17)]

    def mtp_rows(batch_seqs: list[torch.Tensor]) -> list[torch.Tensor]:
        batch = build_packed_batch([len(s) for s in batch_seqs], KERNEL.page_size, KERNEL.attention_query_tile)
        next_ids = torch.cat([torch.roll(s, -1) for s in batch_seqs])
        with torch.no_grad():
            hidden = model.forward_hidden(torch.cat(batch_seqs), batch)
            return list(torch.split(model.mtp_hidden(hidden, next_ids, batch), [len(s) for s in batch_seqs]))

    together = mtp_rows(seqs)
    for s, rows in zip(seqs, together, strict=True):
        assert torch.equal(mtp_rows([s])[0], rows)


def glm45_saved_by_transformers(directory) -> Glm4MoeForCausalLM:
    """A tiny GLM-4.5 built and saved by transformers with one MTP layer declared: the layer at index
    num_hidden_layers (3) is not a module of transformers' model, so `save_pretrained` writes no tensor of it."""
    config = Glm4MoeConfig(
        vocab_size=128, hidden_size=32, intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, n_routed_experts=8, num_experts_per_tok=2,
        n_shared_experts=1, n_group=2, topk_group=1, first_k_dense_replace=1, routed_scaling_factor=1.5,
        partial_rotary_factor=0.5, attention_bias=True, use_qk_norm=True, tie_word_embeddings=False,
        num_nextn_predict_layers=1,
    )  # fmt: skip
    torch.manual_seed(1)
    hf = Glm4MoeForCausalLM(config).eval()
    with torch.no_grad():  # transformers initializes the router bias to zeros: give it values that steer the choice
        for layer in hf.model.layers[1:]:
            layer.mlp.gate.e_score_correction_bias.normal_(0, 0.05)
    hf.save_pretrained(directory)
    return hf


def test_a_glm45_checkpoint_saved_by_transformers_loads_as_its_trunk(tmp_path, caplog) -> None:
    hf = glm45_saved_by_transformers(tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["num_nextn_predict_layers"] == 1
    assert not any(name.startswith("model.layers.3.") for name in load_file(tmp_path / "model.safetensors"))
    assert num_absent_mtp_layers(tmp_path) == 1
    generator = torch.Generator().manual_seed(2)
    seqs = [torch.randint(0, 128, (n,), generator=generator) for n in (9, 20)]
    with torch.no_grad():
        reference = [hf(s[None]).logits[0] for s in seqs]
    with caplog.at_level(logging.WARNING, logger="miles_kernels"):
        config = read_model_config(tmp_path)
        models = [load_model(tmp_path, kernel) for kernel in (KERNEL, KernelConfig(mode="fast"))]
    assert config.num_nextn_predict_layers == 0
    for model in models:
        assert model.config.num_nextn_predict_layers == 0 and model.mtp_layers == []
        for got, want in zip(packed_logits(model, seqs), reference, strict=True):
            torch.testing.assert_close(got, want, rtol=0, atol=1e-4)
    # said once, however often the directory is read: which checkpoint, what it declares and holds, what it means
    (record,) = [r for r in caplog.records if r.name.startswith("miles_kernels")]
    assert record.levelno == logging.WARNING
    message = record.getMessage()
    assert str(tmp_path) in message and "declares 1 MTP layer" in message and "holds none" in message
    assert "no speculative-decoding draft" in message
    # written back, the model says what it is: no MTP modules
    assert json.loads((save_model(models[0], tmp_path / "again") / "config.json").read_text())[
        "num_nextn_predict_layers"
    ] == 0  # fmt: skip


def test_a_qwen3_with_mtp_saved_by_transformers_loads_as_its_trunk(tmp_path) -> None:
    """Qwen3 keeps Miles' `num_nextn_predict_layers` in config.json through transformers, and loses the module too."""
    config = tiny_config("dense", num_nextn_predict_layers=1, tie_word_embeddings=False)
    save_transformers_model(tmp_path, config, seed=3)
    assert json.loads((tmp_path / "config.json").read_text())["num_nextn_predict_layers"] == 1
    hf = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    seqs = [torch.arange(5, 17), torch.arange(40, 47)]
    with torch.no_grad():
        reference = [hf(s[None]).logits[0] for s in seqs]
    model = load_model(tmp_path, KERNEL)
    assert model.mtp_layers == []
    for got, want in zip(packed_logits(model, seqs), reference, strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-4)


@pytest.mark.parametrize("kept", ["some", "only_the_copies"])
def test_partly_missing_mtp_tensors_are_refused(tmp_path, kept: str) -> None:
    """Only a checkpoint with none of an MTP module's tensors is the transformers case; one that holds part of it
    (a truncated copy, a bad merge) is refused, naming what is missing."""
    source = save_random_model(tmp_path, tiny_config("glm", num_nextn_predict_layers=1), seed=4)
    saved = load_file(source / "model.safetensors")
    mtp = [name for name in saved if name.startswith("model.layers.3.")]
    copies = {"model.layers.3.embed_tokens.weight", "model.layers.3.shared_head.head.weight"}
    dropped = {"model.layers.3.eh_proj.weight", "model.layers.3.enorm.weight"} if kept == "some" else set(mtp) - copies
    save_file({k: v for k, v in saved.items() if k not in dropped}, str(source / "model.safetensors"))
    assert read_model_config(source).num_nextn_predict_layers == 1 and num_absent_mtp_layers(source) == 0
    with pytest.raises(ValueError, match=rf"checkpoint is missing {len(dropped)} tensor\(s\): model\.layers\.3\."):
        load_model(source, KERNEL)
