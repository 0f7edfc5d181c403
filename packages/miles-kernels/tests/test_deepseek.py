"""The DeepSeek-V3 / Kimi-K2 family (multi-head latent attention, YaRN, GLM-4.5's router) against transformers'
`DeepseekV3ForCausalLM` on the same weights: logits and log-probs within 1e-4 in both kernel modes, through the
trainer's packed forward and the engine's paged latent cache; gradients; configs as the released checkpoints write
them; the latent cache's size."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoModelForCausalLM, DeepseekV3Config, DeepseekV3ForCausalLM

from miles_kernels import KernelConfig, KVStore, ModelConfig, build_packed_batch, load_model, read_model_config
from miles_kernels.ops.rope import apply_rope, deinterleave
from miles_kernels.testing import PagedRunner, packed_logits, random_model, save_random_model, tiny_config

KERNELS = {
    "deterministic": KernelConfig(page_size=8, attention_query_tile=4, linear_tile=4, moe_tile=4),
    "fast": KernelConfig(mode="fast", page_size=8),
}


def random_seqs(vocab: int, lengths: list[int], seed: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=generator) for n in lengths]


def assert_close_logits_and_logprobs(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    torch.testing.assert_close(got, want, rtol=0, atol=1e-4, msg=lambda m: f"{what} logits: {m}")
    torch.testing.assert_close(
        got.log_softmax(-1), want.log_softmax(-1), rtol=0, atol=1e-4, msg=lambda m: f"{what} log-probs: {m}"
    )


# Sequences past YaRN's original context (32 positions in the tiny config) and across several KV pages.
LENGTHS = [1, 6, 19, 70]


@pytest.mark.parametrize(
    "overrides",
    [
        {},  # q-LoRA, interleaved rotary, YaRN with DeepSeek-V3's mscales, grouped routing, tied embeddings
        {"q_lora_rank": None, "tie_word_embeddings": False},  # plain q_proj (DeepSeek-V2-Lite), untied head
        # cos / sin scaled (mscale only: transformers' attention_factor = yarn_mscale(factor)), rotate-half layout
        {"rope_interleave": False, "rope_mscale": 0.0, "rope_mscale_all_dim": 0.0, "tie_word_embeddings": False},
        # Kimi-K2's router (one group), biases on q_a / kv_a / o_proj, value heads wider than query heads, no YaRN
        {"n_group": 1, "topk_group": 1, "attention_bias": True, "v_head_dim": 32, "rope_type": "default",
         "rope_factor": 1.0, "rope_mscale": 0.0, "rope_mscale_all_dim": 0.0},
        # 4 groups of 4, 2 kept, top-3, unnormalized, two shared experts, two dense layers of four
        {"num_experts": 16, "n_group": 4, "topk_group": 2, "num_experts_per_tok": 3, "norm_topk_prob": False,
         "n_shared_experts": 2, "first_k_dense_replace": 2, "num_hidden_layers": 4},
    ],
    ids=["deepseek-v3", "no-q-lora-untied", "rotate-half-mscale", "kimi-router-biases-wide-v", "grouped-dense"],
)  # fmt: skip
def test_matches_transformers_through_the_trainer_and_the_engine(tmp_path, overrides: dict) -> None:
    config = tiny_config("deepseek", **overrides)
    save_random_model(tmp_path, config, seed=3)
    seqs = random_seqs(config.vocab_size, LENGTHS, seed=1)
    hf = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    assert isinstance(hf, DeepseekV3ForCausalLM)
    with torch.no_grad():
        reference = [hf(s[None]).logits[0] for s in seqs]
    for mode, kernel in KERNELS.items():
        model = load_model(tmp_path, kernel)
        packed = packed_logits(model, seqs)
        # Prefill the first 5 tokens, a chunk up to 40 after them (fast mode: both in the expanded form, the chunk over
        # the expanded cached prefix), then decode one token at a time (the absorbed form).
        runner = PagedRunner(model, num_pages=64)
        steps: dict[int, list[torch.Tensor]] = {i: [] for i in range(len(seqs))}
        schedule = [(0, 5), (5, 40)] + [(t, t + 1) for t in range(40, max(LENGTHS))]
        for start, end in schedule:
            out = runner.step({i: s[start:end] for i, s in enumerate(seqs) if start < len(s)})
            for i, rows in out.items():
                steps[i].append(rows)
        for i, want in enumerate(reference):
            assert_close_logits_and_logprobs(packed[i], want, f"{mode} packed seq {i}")
            assert_close_logits_and_logprobs(torch.cat(steps[i]), want, f"{mode} paged seq {i}")
            if mode == "deterministic":  # the engine's latent cache gives the trainer's bits
                assert torch.equal(torch.cat(steps[i]), packed[i]), f"seq {i}: paged decode != packed forward"


def test_gradients_match_transformers(tmp_path) -> None:
    """The trainer's backward through the absorbed attention (deterministic) and the expanded one (fast) gives every
    parameter transformers' gradient, within 1e-5 of its largest entry."""
    save_random_model(tmp_path, tiny_config("deepseek", tie_word_embeddings=False), seed=1)
    (seq,) = random_seqs(256, [40], seed=0)
    hf = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32)
    (-hf(seq[None]).logits[0].log_softmax(-1)[:-1].gather(1, seq[1:, None]).sum()).backward()
    reference = dict(hf.named_parameters())
    for mode, kernel in KERNELS.items():
        model = load_model(tmp_path, kernel)
        for param in model.parameters():
            param.requires_grad_(True)
        batch = build_packed_batch([len(seq)], kernel.page_size, kernel.attention_query_tile)
        logits = model.logits(model.forward_hidden(seq, batch))
        (-logits.log_softmax(-1)[:-1].gather(1, seq[1:, None]).sum()).backward()
        for name, param in model.named_parameters():
            if ".experts." in name:  # transformers fuses the experts' weights (gate_up_proj); compared below
                continue
            want = reference[name].grad
            assert param.grad is not None and want is not None, name
            scale = want.abs().max().item()
            assert (param.grad - want).abs().max().item() <= 1e-5 * scale, f"{mode}: {name}"
        hf_experts = hf.model.layers[2].mlp.experts.down_proj.grad
        experts = [e.down_proj.weight for e in model.model.layers[2].mlp.experts]
        ours = torch.stack([torch.zeros_like(w) if w.grad is None else w.grad for w in experts])  # None: no token
        assert (ours - hf_experts).abs().max().item() <= 1e-5 * hf_experts.abs().max().item(), mode


def test_loads_a_directory_written_by_transformers(tmp_path) -> None:
    hf_config = DeepseekV3Config(
        vocab_size=128, hidden_size=32, intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=3,
        num_attention_heads=4, q_lora_rank=16, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4,
        v_head_dim=8, n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1, n_group=2, topk_group=1,
        first_k_dense_replace=1, routed_scaling_factor=2.5, max_position_embeddings=256, num_nextn_predict_layers=0,
        rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 8.0, "beta_fast": 32, "beta_slow": 1,
                         "mscale": 1.0, "mscale_all_dim": 1.0, "original_max_position_embeddings": 32},
    )  # fmt: skip
    torch.manual_seed(0)
    hf = DeepseekV3ForCausalLM(hf_config).eval()
    with torch.no_grad():  # transformers initializes the bias to zeros: give it values that change the choice
        for layer in hf.model.layers[1:]:
            layer.mlp.gate.e_score_correction_bias.normal_(0, 0.05)
    hf.save_pretrained(tmp_path)
    seqs = random_seqs(128, [9, 50], seed=0)
    with torch.no_grad():
        reference = [hf(s[None]).logits[0] for s in seqs]
    config = read_model_config(tmp_path)
    assert (config.model_type, config.q_lora_rank, config.rope_type, config.rope_interleave) == (
        "deepseek_v3", 16, "yarn", True,
    )  # fmt: skip
    for got, want in zip(packed_logits(load_model(tmp_path), seqs), reference, strict=True):
        assert_close_logits_and_logprobs(got, want, "transformers-written")


# Kimi-K2-Instruct's config.json (moonshotai/Kimi-K2-Instruct; its custom-code `auto_map` left out), and
# DeepSeek-V3's (deepseek-ai/DeepSeek-V3) in its original rope_scaling form.
KIMI_K2 = {
    "architectures": ["DeepseekV3ForCausalLM"], "model_type": "kimi_k2", "vocab_size": 163840, "hidden_size": 7168,
    "intermediate_size": 18432, "moe_intermediate_size": 2048, "num_hidden_layers": 61, "num_attention_heads": 64,
    "num_key_value_heads": 64, "n_shared_experts": 1, "n_routed_experts": 384, "ep_size": 1,
    "routed_scaling_factor": 2.827, "kv_lora_rank": 512, "q_lora_rank": 1536, "qk_rope_head_dim": 64,
    "v_head_dim": 128, "qk_nope_head_dim": 128, "topk_method": "noaux_tc", "n_group": 1, "topk_group": 1,
    "num_experts_per_tok": 8, "moe_layer_freq": 1, "first_k_dense_replace": 1, "norm_topk_prob": True,
    "scoring_func": "sigmoid", "aux_loss_alpha": 0.001, "seq_aux": True, "hidden_act": "silu",
    "max_position_embeddings": 131072, "initializer_range": 0.02, "rms_norm_eps": 1e-06, "use_cache": True,
    "pad_token_id": 163839, "bos_token_id": 163584, "eos_token_id": 163585, "tie_word_embeddings": False,
    "rope_theta": 50000.0, "rope_scaling": {"beta_fast": 1.0, "beta_slow": 1.0, "factor": 32.0, "mscale": 1.0,
    "mscale_all_dim": 1.0, "original_max_position_embeddings": 4096, "type": "yarn"},
    "attention_bias": False, "attention_dropout": 0.0, "num_nextn_predict_layers": 0, "torch_dtype": "bfloat16",
}  # fmt: skip
DEEPSEEK_V3 = {
    **KIMI_K2, "model_type": "deepseek_v3", "vocab_size": 129280, "num_attention_heads": 128,
    "num_key_value_heads": 128, "n_routed_experts": 256, "routed_scaling_factor": 2.5, "n_group": 8, "topk_group": 4,
    "first_k_dense_replace": 3, "max_position_embeddings": 163840, "rope_theta": 10000.0, "bos_token_id": 0,
    "eos_token_id": 1, "num_nextn_predict_layers": 1,
    "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0, "mscale_all_dim": 1.0,
                     "original_max_position_embeddings": 4096, "type": "yarn"},
}  # fmt: skip


@pytest.mark.parametrize("hf", [DEEPSEEK_V3, KIMI_K2], ids=["deepseek-v3", "kimi-k2"])
def test_released_configs_load_as_the_family(hf: dict) -> None:
    config = ModelConfig.from_hf(hf)
    assert (config.model_type, config.is_mla, config.router, config.head_dim) == ("deepseek_v3", True, "sigmoid", 64)
    assert (config.qk_head_dim, config.kv_cache_width, config.rope_type) == (192, 576, "yarn")
    assert config.rope_interleave and config.rope_attention_factor == 1.0
    factor = hf["rope_scaling"]["factor"]
    assert config.softmax_scale == pytest.approx(192**-0.5 * (0.1 * torch.log(torch.tensor(factor)).item() + 1) ** 2)
    assert config.is_moe_layer(hf["first_k_dense_replace"]) and not config.is_moe_layer(0)
    again = ModelConfig.from_hf(config.to_hf())
    assert again == config
    transformers_config = DeepseekV3Config(**{k: v for k, v in config.to_hf().items() if k != "model_type"})
    assert transformers_config.qk_head_dim == 192 and transformers_config.rope_parameters["factor"] == factor


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"scoring_func": "softmax"}, "scoring_func 'softmax'"),
        ({"moe_layer_freq": 2}, "moe_layer_freq=2"),
        ({"topk_method": "greedy"}, "topk_method 'greedy'"),
        ({"rope_scaling": {"type": "dynamic", "factor": 2.0}}, "unsupported RoPE scaling 'dynamic'"),
    ],
)
def test_unsupported_deepseek_settings_are_named(change: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        ModelConfig.from_hf({**DEEPSEEK_V3, **change})


def test_config_errors_name_the_setting() -> None:
    with pytest.raises(ValueError, match="head_dim=16 must be qk_rope_head_dim=8"):
        tiny_config("deepseek", head_dim=16)
    with pytest.raises(ValueError, match="deepseek_v3 \\(MLA\\) settings"):
        tiny_config("dense", kv_lora_rank=32)
    with pytest.raises(ValueError, match="even qk_rope_head_dim"):
        tiny_config("deepseek", kv_lora_rank=0)


def test_the_latent_cache_holds_one_shared_latent_per_token_and_layer() -> None:
    """The point of MLA: per token and layer the cache holds kv_lora_rank + qk_rope_head_dim values shared by every
    head, one tensor serving as both K and V. DeepSeek-V3's shapes (bf16): 1152 bytes per token and layer, against
    65536 for GQA-free multi-head K/V of its 128 heads of 128 (the model it compresses) and 4096 for 8 KV heads."""
    config = tiny_config("deepseek")
    store = KVStore.allocate(config, num_pages=4, page_size=8, dtype=torch.bfloat16, device="cpu", num_draft_layers=1)
    assert len(store.tensors()) == config.num_hidden_layers + 1
    assert all(k is v for k, v in zip(store.k, store.v, strict=True))
    assert store.k[0].shape == (4, 1, 8, 32 + 8)
    assert store.bytes_per_token == (config.num_hidden_layers + 1) * 40 * 2
    deepseek = ModelConfig.from_hf(DEEPSEEK_V3)
    assert deepseek.kv_cache_width * 2 == 1152
    gqa = ModelConfig(hidden_size=7168, num_attention_heads=128, num_key_value_heads=128, head_dim=128)
    assert gqa.kv_cache_width * 2 == 65536


def test_the_two_attention_forms_agree_closely_but_not_bitwise() -> None:
    """The absorbed form (the engine's decode, and both sides in deterministic mode) and the expanded one (fast mode's
    trainer and long engine prefills) compute the same function in different summation orders: close, and not
    bit-equal, which is why deterministic mode runs the absorbed one on both sides."""
    config = tiny_config("deepseek")
    model = random_model(config, KernelConfig(mode="fast", page_size=8), seed=5)
    (seq,) = random_seqs(config.vocab_size, [40], seed=2)
    expanded = packed_logits(model, [seq])[0]  # fast-mode trainer: expanded
    runner = PagedRunner(model, num_pages=16)
    absorbed = torch.cat([runner.step({0: seq[t : t + 1]})[0] for t in range(len(seq))])  # decode: absorbed
    torch.testing.assert_close(absorbed, expanded, rtol=0, atol=1e-5)
    assert not torch.equal(absorbed[1:], expanded[1:])  # (the first row has one key: it expands)


def test_the_engine_picks_the_cheaper_form_in_fast_mode() -> None:
    """Per head (tiny config: W = 40, qk = 24, v = 12, (nope + v) x kv_lora_rank = 896): a prefill without a prefix
    expands (its expansion costs what the absorption would), decode stays absorbed, a chunk after a cached prefix
    expands only when it is long enough against the prefix."""
    from miles_kernels.ops.attention_batch import build_attention_batch

    attention = random_model(tiny_config("deepseek"), KernelConfig(mode="fast", page_size=8)).model.layers[0].self_attn

    def expands(query_lens: list[int], prefix_lens: list[int]) -> bool:
        tables = [list(range(1 + 40 * s, 1 + 40 * s + -(-(q + p) // 8))) for s, (q, p) in
                  enumerate(zip(query_lens, prefix_lens, strict=True))]  # fmt: skip
        return attention.expands(build_attention_batch(query_lens, prefix_lens, tables, 8, 4))

    assert expands([300], [0]) and expands([3, 7], [0, 0])
    assert not expands([1, 1, 1], [200, 50, 9])
    assert not expands([4], [200]) and expands([100], [200])  # 100 x 300 x 44 > 200 x 896 > 4 x 204 x 44


def test_compacted_batch_renumbers_the_pages_it_reads() -> None:
    from miles_kernels.ops.attention_batch import build_attention_batch

    batch = build_attention_batch([3, 2], [8, 0], [[9, 4], [17]], page_size=8, query_tile=4)
    used, compact = batch.compacted(num_pages=20)
    assert used.tolist() == [0, 4, 9, 17]
    assert compact.block_tables_SB.tolist() == [[2, 1], [3, 0]]
    assert compact.write_pages_N.tolist() == [1, 1, 1, 3, 3]


def test_deinterleave_then_rotate_half_is_transformers_interleaved_rope() -> None:
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import apply_rotary_pos_emb_interleave

    generator = torch.Generator().manual_seed(0)
    q, k = torch.randn(2, 4, 9, 8, generator=generator), torch.randn(2, 1, 9, 8, generator=generator)
    angles = torch.arange(9.0)[:, None] * torch.rand(4, generator=generator)[None]
    cos, sin = torch.cat((angles, angles), -1).cos(), torch.cat((angles, angles), -1).sin()
    want_q, want_k = apply_rotary_pos_emb_interleave(q, k, cos[None], sin[None])
    for x, want in ((q, want_q), (k, want_k)):
        x_NHD = x[0].transpose(0, 1)  # (tokens, heads, dim)
        got = apply_rope(deinterleave(x_NHD), cos, sin)
        assert torch.equal(got, want[0].transpose(0, 1))


def test_refusal_is_gone_from_load_model(tmp_path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({**KIMI_K2, "num_hidden_layers": 1}))
    assert read_model_config(tmp_path).model_type == "deepseek_v3"
