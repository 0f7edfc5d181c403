"""Pure logic tier (no torch): model FLOPs against the PaLM closed form, the published active parameters and hand
counts, the batch / training / rollout sums, the hardware peaks and MFU. The count over a real forward
(torch.utils.flop_counter) is packages/miles-orchestrator/tests/test_model_flops.py: miles-memory's tests install
neither torch's models nor miles-kernels."""

from __future__ import annotations

import pytest

from miles_memory import HARDWARE, ModelShape, load_hardware, load_model_profile, mfu, model_flops
from miles_memory.model_shape import model_profiles


def norm_params(shape: ModelShape) -> int:
    """The trunk's 1-D parameters (norm weights, biases, the routing bias): no matmul multiplies them."""
    trunk = [t for t in shape.tensors() if t.layer is None or t.layer < shape.num_hidden_layers]
    return sum(t.numel for t in trunk if len(t.shape) == 1)


def test_dense_matches_palm_closed_form() -> None:
    """PaLM (arXiv 2204.02311, appendix B): training FLOPs per token = 6N + 12 L H Q T, N the non-embedding
    parameters, each token attending T keys. Ours is the same but for exactly: + the LM head (V x H, a matmul PaLM's N
    leaves out with the embedding) - the norm weights (parameters no matmul multiplies)."""
    shape = load_model_profile("Qwen3-8B")
    vh = shape.vocab_size * shape.hidden_size
    n = shape.params(mtp=False) - 2 * vh  # untied: embedding and LM head are the embedding parameters
    assert n == pytest.approx(float(model_profiles()["Qwen3-8B"]["published"]["non_embedding"]), rel=0.01)
    layers, heads, q = shape.num_hidden_layers, shape.num_attention_heads, shape.dim
    flops = model_flops(shape)
    for t in (1, 4096, 32768):
        palm = 6 * n + 12 * layers * heads * q * t
        assert 3 * flops.per_token(t) - palm == 6 * (vh - norm_params(shape))
    assert norm_params(shape) == layers * (2 * shape.hidden_size + 2 * q) + shape.hidden_size  # + q/k norms


@pytest.mark.parametrize("name", ["DeepSeek-V3", "Qwen3-30B-A3B"])
def test_moe_active_weights_match_published(name: str) -> None:
    """The weights a token multiplies (half the matmul FLOPs) plus the embedding it looks up are the active parameters
    the authors report (DeepSeek-V3 37B, Qwen3-30B-A3B 3.3B), and exactly the planner's active count less the norms."""
    shape = load_model_profile(name)
    flops = model_flops(shape)
    embedding = shape.vocab_size * shape.hidden_size
    published = float(model_profiles()[name]["published"]["active"])
    assert flops.matmul // 2 + embedding == pytest.approx(published, rel=0.03)
    assert flops.matmul // 2 + embedding + norm_params(shape) == shape.active_params()


def test_deepseek_v3_by_hand() -> None:
    """DeepSeek-V3 (config_671B.json): MLA with q-LoRA, 3 dense layers, 58 MoE layers of 256 routed experts (top 8)
    and one shared expert, all counted by hand."""
    shape = load_model_profile("DeepSeek-V3")
    h, heads, v = 7168, 128, 129280
    q_lora, kv_lora, nope, rope, v_dim = 1536, 512, 128, 64, 128
    mla = (q_lora * h + heads * (nope + rope) * q_lora + (kv_lora + rope) * h + heads * (nope + v_dim) * kv_lora
           + h * heads * v_dim)  # fmt: skip
    dense = 3 * h * 18432
    moe = 256 * h + 3 * h * 2048 + 8 * 3 * h * 2048  # router, shared expert, 8 routed experts
    flops = model_flops(shape)
    assert flops.matmul == 2 * (61 * mla + 3 * dense + 58 * moe + v * h)
    # attention: per layer and attended key, QK^T over qk_nope + qk_rope and AV over v_head_dim, every head
    one_layer = 2 * heads * (nope + rope) + 2 * heads * v_dim
    assert one_layer == 81920
    assert flops.attention_per_key == 61 * one_layer


def test_mtp_counted_only_when_asked() -> None:
    """GLM-4.5-Air's MTP module: one more MoE decoder layer, eh_proj (H x 2H) and a pass through the shared LM head."""
    shape = load_model_profile("GLM-4.5-Air")
    h, heads, kv, d, v = 4096, 96, 8, 128, 151552
    attention = heads * d * h + 2 * kv * d * h + h * heads * d
    moe = 128 * h + 3 * h * 1408 + 8 * 3 * h * 1408
    trunk, with_mtp = model_flops(shape), model_flops(shape, include_mtp=True)
    assert with_mtp.matmul - trunk.matmul == 2 * (attention + moe + h * 2 * h + v * h)
    assert with_mtp.attention_per_key - trunk.attention_per_key == 2 * heads * 2 * d
    no_mtp = shape.model_copy(update={"num_nextn_predict_layers": 0})
    assert model_flops(no_mtp, include_mtp=True) == trunk


def test_tied_lm_head_counts() -> None:
    """A tied head multiplies the same V x H matrix: the FLOPs do not change with tying."""
    shape = load_model_profile("Qwen3-8B")
    assert model_flops(shape.model_copy(update={"tie_word_embeddings": True})) == model_flops(shape)


def test_batch_sums() -> None:
    flops = model_flops(load_model_profile("Qwen3-30B-A3B"))
    causal = sum(flops.per_token(t) for t in range(1, 101)) + sum(flops.per_token(t) for t in range(1, 8))
    assert flops.forward([100, 7, 0]) == causal
    assert flops.train([100, 7]) == 3 * causal
    # prompt 30, response 5: the prompt's 30 tokens and 4 generated tokens go through the model, at positions 1..34
    assert flops.generate([30, 12], [5, 0]) == sum(flops.per_token(t) for t in range(1, 35)) + flops.forward([12])
    with pytest.raises(ValueError, match="2 prompt lengths and 1 response"):
        flops.generate([30, 12], [5])
    with pytest.raises(ValueError, match="negative"):
        flops.forward([3, -1])


def test_hardware_peaks() -> None:
    """Every GPU profile carries a dense BF16 peak with its source; the CPU has none, so no MFU."""
    peaks = {key: load_hardware(key).bf16_flops_per_s for key in HARDWARE}
    assert peaks == {"h100": 989.4e12, "h200": 989.4e12, "b200": 2.25e15, "gb300": 2.5e15, "cpu": None}
    for key in HARDWARE:
        assert "sparsity" in load_hardware(key).flops_source or key == "cpu"


def test_mfu() -> None:
    h100 = load_hardware("h100")
    assert mfu(0.5 * 8 * 989.4e12 * 10, 10, 8, "h100") == pytest.approx(0.5)
    assert mfu(989.4e12, 2.0, 1, h100) == pytest.approx(0.5)
    assert mfu(1e12, 1.0, 1, "cpu") is None
    with pytest.raises(ValueError, match="seconds > 0"):
        mfu(1e12, 0.0, 1, "h100")
