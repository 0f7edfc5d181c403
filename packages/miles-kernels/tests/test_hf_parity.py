"""CPU numerics: the miles model equals Hugging Face `transformers` on the same weights (logits within 1e-4 in
fp32) for Qwen3 dense, Qwen2.5, Llama 3.x, Qwen3-MoE and GLM-4.5 MoE, tied and untied embeddings, GQA ratios 1, 2
and 4, in both kernel modes; and HF directories round-trip through `load_model` / `save_model` in both directions.

Parity inputs are random floats, so no two router scores tie exactly (transformers' `topk(sorted=False)` leaves the
order of ties unspecified; Miles' tie rule is tested in test_ops.py)."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, Glm4MoeConfig, Glm4MoeForCausalLM, Qwen3Config, Qwen3ForCausalLM

from miles_kernels import KernelConfig, checkpoint_tensors, load_model, read_model_config, save_model
from miles_kernels.testing import packed_logits, save_random_model, tiny_config

KERNELS = {
    "deterministic": KernelConfig(page_size=8, attention_query_tile=4, linear_tile=4, moe_tile=4),
    "fast": KernelConfig(mode="fast", page_size=8),
}


def hf_logits(model_dir, seqs: list[torch.Tensor]) -> list[torch.Tensor]:
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        return [hf(s[None]).logits[0] for s in seqs]


def random_seqs(vocab: int, lengths: list[int], seed: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=generator) for n in lengths]


@pytest.mark.parametrize("kind", ["dense", "moe"])
@pytest.mark.parametrize("tied", [True, False])
@pytest.mark.parametrize("num_kv_heads", [4, 2, 1])  # GQA ratios 1, 2, 4 with 4 query heads
def test_logits_match_transformers(tmp_path, kind: str, tied: bool, num_kv_heads: int) -> None:
    config = tiny_config(kind, tie_word_embeddings=tied, num_key_value_heads=num_kv_heads)
    save_random_model(tmp_path, config, seed=num_kv_heads)
    seqs = random_seqs(config.vocab_size, [1, 6, 19, 40], seed=num_kv_heads)
    reference = hf_logits(tmp_path, seqs)
    for mode, kernel in KERNELS.items():
        ours = packed_logits(load_model(tmp_path, kernel), seqs)
        for got, want in zip(ours, reference, strict=True):
            torch.testing.assert_close(got, want, rtol=0, atol=1e-4, msg=lambda m, mode=mode: f"{mode}: {m}")


@pytest.mark.parametrize("kind", ["qwen2", "llama"])
@pytest.mark.parametrize("tied", [True, False])
@pytest.mark.parametrize("num_kv_heads", [4, 2, 1])
def test_qwen25_and_llama3_logits_match_transformers(tmp_path, kind: str, tied: bool, num_kv_heads: int) -> None:
    """Qwen2.5 (q / k / v biases, no QK-norm) and Llama 3.x (Llama 3 RoPE scaling with all three frequency bands at
    this head size, no QK-norm), over sequences past the scaling's original context (64 positions)."""
    config = tiny_config(kind, tie_word_embeddings=tied, num_key_value_heads=num_kv_heads)
    save_random_model(tmp_path, config, seed=40 + num_kv_heads)
    assert_matches_transformers(tmp_path, random_seqs(config.vocab_size, [1, 6, 19, 90], seed=num_kv_heads))


@pytest.mark.parametrize("kind", ["dense", "qwen2", "llama"])
def test_dense_families_gradients_match_transformers(tmp_path, kind: str) -> None:
    """The trainer's backward (the hand-written attention / RMSNorm / RoPE / SwiGLU passes) gives every parameter
    the gradient transformers' autograd gives it, within 1e-5 of its largest entry, in both kernel modes."""
    from miles_kernels import build_packed_batch

    save_random_model(tmp_path, tiny_config(kind, tie_word_embeddings=False), seed=1)
    (seq,) = random_seqs(256, [40], seed=0)
    hf = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32)
    (-hf(seq[None]).logits[0].log_softmax(-1)[:-1].gather(1, seq[1:, None]).sum()).backward()
    reference = dict(hf.named_parameters())
    for mode, kernel in KERNELS.items():
        model = load_model(tmp_path, kernel)
        for param in model.parameters():
            param.requires_grad_(True)
        batch = build_packed_batch([len(seq)], kernel.page_size, kernel.attention_query_tile, seq.device)
        logits = model.logits(model.forward_hidden(seq, batch))
        (-logits.log_softmax(-1)[:-1].gather(1, seq[1:, None]).sum()).backward()
        for name, param in model.named_parameters():
            want = reference[name].grad
            assert param.grad is not None and want is not None, name
            scale = want.abs().max().item()
            assert (param.grad - want).abs().max().item() <= 1e-5 * scale, f"{mode}: {name}"


def test_llama_with_attention_biases_and_no_scaling_matches_transformers(tmp_path) -> None:
    config = tiny_config("llama", attention_bias=True, rope_type="default", tie_word_embeddings=False)
    save_random_model(tmp_path, config, seed=51)
    assert_matches_transformers(tmp_path, random_seqs(config.vocab_size, [7, 30], seed=51))


@pytest.mark.parametrize("family", ["qwen2", "llama"])
def test_loads_qwen25_and_llama3_directories_written_by_transformers(tmp_path, family: str) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    shape = dict(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, tie_word_embeddings=family == "llama",
                 max_position_embeddings=256)  # fmt: skip
    if family == "llama":  # Llama 3.2's settings, scaled down
        hf_config = LlamaConfig(**shape, rope_theta=500000.0, rms_norm_eps=1e-5, rope_scaling={
            "rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 32})  # fmt: skip
        model_class = LlamaForCausalLM
    else:
        hf_config, model_class = Qwen2Config(**shape, rope_theta=1000000.0), Qwen2ForCausalLM
    torch.manual_seed(0)
    hf = model_class(hf_config).eval()
    with torch.no_grad():  # transformers initializes biases to zeros: give them values
        for name, param in hf.named_parameters():
            if name.endswith(".bias"):
                param.normal_(0, 0.1)
    hf.save_pretrained(tmp_path)
    seqs = random_seqs(128, [9, 60], seed=0)
    with torch.no_grad():
        reference = [hf(s[None]).logits[0] for s in seqs]
    config = read_model_config(tmp_path)
    assert config.model_type == family and not config.use_qk_norm
    assert config.rope_type == ("llama3" if family == "llama" else "default")
    model = load_model(tmp_path)
    for got, want in zip(packed_logits(model, seqs), reference, strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-4)
    again = load_model(save_model(model, tmp_path / "again"))  # save → load is bit-exact, and transformers reads it
    for name, tensor in checkpoint_tensors(model).items():
        assert torch.equal(tensor, checkpoint_tensors(again)[name]), name
    assert type(AutoModelForCausalLM.from_pretrained(tmp_path / "again")).__name__ == model_class.__name__


WINDOWED = {
    "qwen2": ("full_attention", "sliding_attention"),  # Qwen2.5's max_window_layers rule: the later layers windowed
    "dense": ("sliding_attention", "sliding_attention"),  # Qwen3
    "moe": ("sliding_attention", "sliding_attention"),  # Qwen3-MoE windows every layer
}


@pytest.mark.parametrize("kind", sorted(WINDOWED))
@pytest.mark.parametrize("window", [5, 11])
def test_sliding_window_matches_transformers(tmp_path, kind: str, window: int) -> None:
    """Sliding-window attention (Qwen2.5, Qwen3, Qwen3-MoE) against transformers' sliding-window mask, in both modes
    (fast mode's SDPA path for the 60-token sequence), windows inside a page of 8 and across pages; the window
    changes the logits of the long sequences."""
    config = tiny_config(kind, sliding_window=window, layer_types=WINDOWED[kind], tie_word_embeddings=False)
    save_random_model(tmp_path, config, seed=60 + window)
    hf_config = json.loads((tmp_path / "config.json").read_text())
    assert hf_config["use_sliding_window"] and hf_config["sliding_window"] == window
    seqs = random_seqs(config.vocab_size, [1, 6, 19, 60], seed=window)
    assert_matches_transformers(tmp_path, seqs)
    hf = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32)
    assert [layer.self_attn.sliding_window for layer in hf.model.layers] == [
        window if layer_type == "sliding_attention" else None for layer_type in WINDOWED[kind]
    ]
    (tmp_path / "config.json").write_text(json.dumps({**hf_config, "use_sliding_window": False}))
    unwindowed = packed_logits(load_model(tmp_path), seqs[-1:])[0]
    (tmp_path / "config.json").write_text(json.dumps(hf_config))
    assert (packed_logits(load_model(tmp_path), seqs[-1:])[0] - unwindowed).abs().max() > 1e-2


def test_loads_a_windowed_qwen25_directory_written_by_transformers(tmp_path) -> None:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    hf_config = Qwen2Config(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                            num_attention_heads=4, num_key_value_heads=2, use_sliding_window=True, sliding_window=6,
                            max_window_layers=1)  # fmt: skip
    torch.manual_seed(1)
    hf = Qwen2ForCausalLM(hf_config).eval()
    hf.save_pretrained(tmp_path)
    config = read_model_config(tmp_path)
    assert config.sliding_window == 6
    assert config.layer_types == ("full_attention", "sliding_attention", "sliding_attention")
    seqs = random_seqs(128, [30], seed=1)
    with torch.no_grad():
        reference = hf(seqs[0][None]).logits[0]
    model = load_model(tmp_path)
    torch.testing.assert_close(packed_logits(model, seqs)[0], reference, rtol=0, atol=1e-4)
    again = AutoModelForCausalLM.from_pretrained(save_model(model, tmp_path / "again"))
    assert again.config.layer_types == list(config.layer_types) and again.config.sliding_window == 6


def test_sliding_window_settings_are_checked() -> None:
    from miles_kernels import ModelConfig

    # no layer_types: the max_window_layers rule, as transformers applies it
    hf = tiny_config("qwen2").to_hf() | {"use_sliding_window": True, "sliding_window": 4, "max_window_layers": 1}
    assert ModelConfig.from_hf(hf).layer_types == ("full_attention", "sliding_attention")
    assert ModelConfig.from_hf({**hf, "use_sliding_window": False}).sliding_window is None
    moe = tiny_config("moe").to_hf() | {"use_sliding_window": True, "sliding_window": 4, "max_window_layers": 1}
    assert ModelConfig.from_hf(moe).layer_types == ("sliding_attention",) * 2  # Qwen3-MoE: every layer
    with pytest.raises(ValueError, match=r"use_sliding_window=true; llama has no sliding-window attention"):
        ModelConfig.from_hf(tiny_config("llama").to_hf() | {"use_sliding_window": True, "sliding_window": 4})
    with pytest.raises(ValueError, match="glm4_moe has no sliding-window attention"):
        tiny_config("glm", sliding_window=4, layer_types=("sliding_attention",) * 3)
    with pytest.raises(ValueError, match=r"sliding_window=0 must be >= 1"):
        tiny_config("qwen2", sliding_window=0, layer_types=("sliding_attention",) * 2)
    with pytest.raises(ValueError, match=r"layer_types needs one of .* per layer \(2\)"):
        tiny_config("qwen2", sliding_window=4, layer_types=("sliding_attention",))
    with pytest.raises(ValueError, match="layer_types is given without a sliding_window"):
        tiny_config("qwen2", layer_types=("sliding_attention",) * 2)
    with pytest.raises(ValueError, match="qwen3_moe windows every layer"):
        tiny_config("moe", sliding_window=4, layer_types=("full_attention", "sliding_attention"))


def test_family_settings_are_checked() -> None:
    with pytest.raises(ValueError, match=r"qwen2 .* has biases on q / k / v: attention_bias=True"):
        tiny_config("qwen2", attention_bias=False)
    with pytest.raises(ValueError, match="llama has no QK-norm: use_qk_norm=False"):
        tiny_config("llama", use_qk_norm=True)
    with pytest.raises(ValueError, match=r"unsupported RoPE scaling 'llama3' for qwen3; implemented: \['default'\]"):
        tiny_config("dense", rope_type="llama3")
    with pytest.raises(ValueError, match="low_freq_factor < high_freq_factor"):
        tiny_config("llama", rope_low_freq_factor=4.0)


def test_moe_with_dense_layers_and_unnormalized_topk(tmp_path) -> None:
    config = tiny_config("moe", num_hidden_layers=3, mlp_only_layers=[1], norm_topk_prob=False, num_experts_per_tok=3)
    save_random_model(tmp_path, config, seed=11)
    seqs = random_seqs(config.vocab_size, [13, 27], seed=11)
    for got, want in zip(packed_logits(load_model(tmp_path), seqs), hf_logits(tmp_path, seqs), strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-4)


def assert_matches_transformers(model_dir, seqs: list[torch.Tensor], modes=KERNELS) -> None:
    reference = hf_logits(model_dir, seqs)
    for mode, kernel in modes.items():
        for got, want in zip(packed_logits(load_model(model_dir, kernel), seqs), reference, strict=True):
            torch.testing.assert_close(got, want, rtol=0, atol=1e-4, msg=lambda m, mode=mode: f"{mode}: {m}")


@pytest.mark.parametrize("tied", [True, False])
@pytest.mark.parametrize("num_kv_heads", [4, 2, 1])
def test_glm4_moe_logits_match_transformers(tmp_path, tied: bool, num_kv_heads: int) -> None:
    """The full GLM-4.5 family (tiny_config("glm")): grouped sigmoid routing with a nonzero correction bias, a
    shared expert, a dense first layer, partial rotary, q/k/v biases, QK-norm, routed scaling."""
    config = tiny_config("glm", tie_word_embeddings=tied, num_key_value_heads=num_kv_heads)
    save_random_model(tmp_path, config, seed=20 + num_kv_heads)
    assert_matches_transformers(tmp_path, random_seqs(config.vocab_size, [1, 6, 19, 40], seed=num_kv_heads))


@pytest.mark.parametrize(
    "overrides",
    [
        # GLM-4.5 / GLM-4.5-Air as released: one group, no QK-norm, full... (partial rotary 0.5 kept), biases
        {"n_group": 1, "topk_group": 1, "use_qk_norm": False},
        # 4 groups of 4, 2 kept, top-3, unnormalized, no shared expert, no dense layer, full rotary, no biases
        {"num_experts": 16, "n_group": 4, "topk_group": 2, "num_experts_per_tok": 3, "norm_topk_prob": False,
         "n_shared_experts": 0, "first_k_dense_replace": 0, "partial_rotary_factor": 1.0, "attention_bias": False},
        # two shared experts, two dense layers of four
        {"n_shared_experts": 2, "first_k_dense_replace": 2, "num_hidden_layers": 4, "routed_scaling_factor": 1.0},
    ],
    ids=["glm45-layout", "grouped-unnormalized", "dense-first-layers"],
)  # fmt: skip
def test_glm4_moe_variants_match_transformers(tmp_path, overrides: dict) -> None:
    config = tiny_config("glm", **overrides)
    save_random_model(tmp_path, config, seed=31)
    assert_matches_transformers(tmp_path, random_seqs(config.vocab_size, [5, 33], seed=31))


def test_glm4_moe_router_bias_stays_float32_and_round_trips(tmp_path) -> None:
    source = save_random_model(tmp_path / "src", tiny_config("glm"), seed=7, dtype="bfloat16")
    name = "model.layers.1.mlp.gate.e_score_correction_bias"
    stored = load_file(source / "model.safetensors")[name]
    assert stored.dtype == torch.float32 and stored.abs().sum() > 0
    model = load_model(source, KernelConfig(dtype="bfloat16"))
    bias = model.get_buffer(name)
    assert bias.dtype == torch.float32 and torch.equal(bias, stored)
    assert model.get_parameter("model.layers.1.mlp.gate.weight").dtype == torch.bfloat16
    assert all(not b.requires_grad for b in model.buffers())  # frozen: no optimizer sees it
    again = load_model(save_model(model, tmp_path / "again"), KernelConfig(dtype="bfloat16"))
    for key, tensor in checkpoint_tensors(model).items():
        assert torch.equal(tensor, checkpoint_tensors(again)[key]), key
    hf = AutoModelForCausalLM.from_pretrained(source, dtype=torch.bfloat16)
    assert torch.equal(hf.model.layers[1].mlp.gate.e_score_correction_bias, stored)


def test_loads_a_glm4_moe_directory_written_by_transformers(tmp_path) -> None:
    hf_config = Glm4MoeConfig(
        vocab_size=128, hidden_size=32, intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, n_routed_experts=8, num_experts_per_tok=2,
        n_shared_experts=1, n_group=2, topk_group=1, first_k_dense_replace=1, routed_scaling_factor=1.5,
        partial_rotary_factor=0.5, attention_bias=True, use_qk_norm=True, tie_word_embeddings=False,
        num_nextn_predict_layers=0,
    )  # fmt: skip
    torch.manual_seed(0)
    hf = Glm4MoeForCausalLM(hf_config).eval()
    with torch.no_grad():  # transformers initializes the bias to zeros: give it values that change the choice
        for layer in hf.model.layers[1:]:
            layer.mlp.gate.e_score_correction_bias.normal_(0, 0.05)
    hf.save_pretrained(tmp_path)
    seqs = random_seqs(128, [9, 20], seed=0)
    with torch.no_grad():
        reference = [hf(s[None]).logits[0] for s in seqs]
    config = read_model_config(tmp_path)
    assert (config.model_type, config.num_experts, config.partial_rotary_factor) == ("glm4_moe", 8, 0.5)
    for got, want in zip(packed_logits(load_model(tmp_path), seqs), reference, strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-4)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"n_group": 3}, "n_group=3 must divide"),
        ({"topk_group": 3}, r"topk_group=3 must be in \[1, n_group=2\]"),
        ({"num_experts_per_tok": 5}, "exceeds the 4 experts"),
        ({"partial_rotary_factor": 0.1875}, "even rotary"),
    ],
)
def test_glm4_moe_config_errors_name_the_setting(overrides: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        tiny_config("glm", **overrides)
    with pytest.raises(ValueError, match="are glm4_moe settings"):
        tiny_config("moe", n_shared_experts=1)


def test_loads_a_directory_written_by_transformers(tmp_path) -> None:
    hf_config = Qwen3Config(
        vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, tie_word_embeddings=False, rope_theta=500.0,
    )  # fmt: skip
    torch.manual_seed(0)
    hf = Qwen3ForCausalLM(hf_config).eval()
    hf.save_pretrained(tmp_path)
    seqs = random_seqs(128, [9, 20], seed=0)
    with torch.no_grad():
        reference = [hf(s[None]).logits[0] for s in seqs]
    assert read_model_config(tmp_path).rope_theta == 500.0
    for got, want in zip(packed_logits(load_model(tmp_path), seqs), reference, strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-4)


@pytest.mark.parametrize("kind", ["dense", "moe", "qwen2", "llama"])
def test_save_is_bit_exact_and_shards(tmp_path, kind: str) -> None:
    config = tiny_config(kind)
    source = save_random_model(tmp_path / "src", config, seed=3)
    model = load_model(source)
    sharded = save_model(model, tmp_path / "sharded", max_shard_bytes=20_000)
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 2
    assert "lm_head.weight" not in index["weight_map"]  # tied: stored once, as HF does
    again = load_model(sharded)
    for name, tensor in checkpoint_tensors(model).items():
        assert torch.equal(tensor, checkpoint_tensors(again)[name]), name
    seqs = random_seqs(config.vocab_size, [17], seed=3)
    assert torch.equal(packed_logits(again, seqs)[0], packed_logits(model, seqs)[0])
    torch.testing.assert_close(packed_logits(again, seqs)[0], hf_logits(sharded, seqs)[0], rtol=0, atol=1e-4)


def test_bfloat16_save_and_load(tmp_path) -> None:
    save_random_model(tmp_path, tiny_config("dense"), seed=4, dtype="bfloat16")
    assert json.loads((tmp_path / "config.json").read_text())["dtype"] == "bfloat16"
    model = load_model(tmp_path, KernelConfig(dtype="bfloat16"))
    assert model.lm_head.weight.dtype == torch.bfloat16


def test_unsupported_architecture_is_named(tmp_path) -> None:
    (tmp_path / "config.json").write_text(
        json.dumps({"model_type": "mistral", "architectures": ["MistralForCausalLM"]})
    )
    with pytest.raises(ValueError, match=r"unsupported architecture: model_type='mistral'.*'LlamaForCausalLM', "
                       r"'Qwen2ForCausalLM', 'Qwen3ForCausalLM'"):  # fmt: skip
        load_model(tmp_path)
    with pytest.raises(FileNotFoundError, match=r"config.json not found"):
        load_model(tmp_path / "nowhere")


def test_missing_mismatched_and_unexpected_tensors_are_named(tmp_path) -> None:
    source = save_random_model(tmp_path, tiny_config("dense"), seed=5)
    tensors = load_file(source / "model.safetensors")
    weight = "model.layers.1.self_attn.q_proj.weight"

    def write(changed: dict[str, torch.Tensor]) -> None:
        save_file(changed, str(source / "model.safetensors"))

    write({k: v for k, v in tensors.items() if k != weight})
    with pytest.raises(ValueError, match=rf"missing 1 tensor\(s\): {weight}"):
        load_model(source)
    write({**tensors, weight: tensors[weight][:, :10].contiguous()})
    with pytest.raises(ValueError, match=rf"{weight}' has shape \(64, 10\), the model expects \(64, 64\)"):
        load_model(source)
    write({**tensors, "model.layers.9.mlp.gate_proj.weight": tensors[weight].clone()})
    with pytest.raises(ValueError, match=r"unexpected tensor 'model\.layers\.9\.mlp\.gate_proj\.weight'"):
        load_model(source)


def test_unsupported_options_are_named(tmp_path) -> None:
    source = save_random_model(tmp_path, tiny_config("dense"), seed=6)
    config = json.loads((source / "config.json").read_text())
    for change, message in (
        ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4}}, "unsupported RoPE scaling 'yarn' for qwen3"),
        ({"hidden_act": "gelu"}, "hidden_act 'gelu'"),
        ({"num_key_value_heads": 3}, "multiple of num_key_value_heads=3"),
    ):
        (source / "config.json").write_text(json.dumps({**config, **change}))
        with pytest.raises(ValueError, match=message):
            load_model(source)


@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_bucket_stream_restores_a_model_bit_exactly(kind: str) -> None:
    """Trainer side: HF-named tensors -> buckets; engine side: assemble -> load_state. Tied embeddings travel once."""
    from miles_kernels import BucketAssembler, decode_bucket, iter_buckets
    from miles_kernels.testing import random_model

    source = random_model(tiny_config(kind), seed=7)
    target = random_model(tiny_config(kind), seed=8)
    tensors = checkpoint_tensors(source)
    assert "lm_head.weight" not in tensors
    assembler = BucketAssembler(version=3)
    buckets = list(iter_buckets(list(tensors.items()), version=3, bucket_bytes=8_000))
    assert len(buckets) > 3
    for data in reversed(buckets):
        assembler.add(decode_bucket(data))
    assert assembler.is_complete
    from miles_kernels import load_state

    load_state(target, assembler.tensors)
    for (name, a), b in zip(source.state_dict().items(), target.state_dict().values(), strict=True):
        assert torch.equal(a, b), name
    assert target.lm_head.weight.data_ptr() == target.model.embed_tokens.weight.data_ptr()


@pytest.mark.parametrize(
    ("rope", "head_dim"),
    [
        ({"factor": 40.0, "original_max_position_embeddings": 4096, "beta_fast": 32, "beta_slow": 1, "mscale": 1.0,
          "mscale_all_dim": 1.0}, 64),  # DeepSeek-V3 / Kimi-K2 (Kimi-K2: factor 32)
        ({"factor": 4.0, "original_max_position_embeddings": 256, "beta_fast": 16, "beta_slow": 2, "mscale": 0.707,
          "mscale_all_dim": 1.0, "truncate": False}, 32),
    ],
)  # fmt: skip
def test_yarn_frequencies_and_mscale_are_transformers(rope: dict, head_dim: int) -> None:
    """YaRN (the DeepSeek-V3 family's RoPE scaling) against transformers' `rope_type: yarn`: the frequencies bit for
    bit, and its cos / sin factor from `yarn_mscale`."""
    from transformers import DeepseekV3Config
    from transformers.modeling_rope_utils import _compute_yarn_parameters

    from miles_kernels.model_config import yarn_mscale
    from miles_kernels.ops.rope import yarn_inv_frequencies

    config = DeepseekV3Config(qk_rope_head_dim=head_dim, max_position_embeddings=163840,
                              rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, **rope})  # fmt: skip
    expected, attention_factor = _compute_yarn_parameters(config)
    got = yarn_inv_frequencies(head_dim, 10000.0, rope["factor"], rope["original_max_position_embeddings"],
                               rope["beta_fast"], rope["beta_slow"], rope.get("truncate", True))  # fmt: skip
    assert torch.equal(got, expected)
    ratio = yarn_mscale(rope["factor"], rope["mscale"]) / yarn_mscale(rope["factor"], rope["mscale_all_dim"])
    assert ratio == pytest.approx(attention_factor, rel=1e-12)
