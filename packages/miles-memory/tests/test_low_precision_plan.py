"""Pure logic tier (no torch): a low-precision rollout engine (rollout.engine.weight_dtype) in the memory planner. Its
weight bytes against the engine's own, measured from miles-kernels for four tiny models, and against a hand count of
each model's linear layers with the stored layouts of the formats; the run config keys reaching the plan; the
refusals; quantization-aware training's term (trainer.qat)."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest

from miles_memory import (
    NATIVE_PANEL_WIDTH,
    ModelShape,
    WeightQuantSettings,
    embedded_engine_bytes,
    fsdp2_bytes,
    native_packed_bytes,
    plan_memory,
    read_run,
    weight_sync_bytes,
)

# miles_kernels.testing.tiny_config(kind, num_nextn_predict_layers=1).to_hf(), the fields the planner reads
TINY = {"vocab_size": 256, "hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4,
        "tie_word_embeddings": True, "num_nextn_predict_layers": 1}  # fmt: skip
MOE = {"num_experts_per_tok": 2, "moe_intermediate_size": 32}
CONFIGS = {
    "dense": TINY | {"model_type": "qwen3", "num_hidden_layers": 2, "num_key_value_heads": 2, "head_dim": 16},
    "moe": TINY | MOE | {"model_type": "qwen3_moe", "num_hidden_layers": 2, "num_key_value_heads": 2, "head_dim": 16,
                         "num_experts": 8, "decoder_sparse_step": 1, "mlp_only_layers": []},
    "glm": TINY | MOE | {"model_type": "glm4_moe", "num_hidden_layers": 3, "num_key_value_heads": 2, "head_dim": 16,
                         "attention_bias": True, "use_qk_norm": True, "n_routed_experts": 8, "n_shared_experts": 1,
                         "first_k_dense_replace": 1},
    "deepseek": TINY | MOE | {"model_type": "deepseek_v3", "num_hidden_layers": 3, "num_key_value_heads": 4,
                              "n_routed_experts": 8, "n_shared_experts": 1, "first_k_dense_replace": 1,
                              "q_lora_rank": 24, "kv_lora_rank": 32, "qk_nope_head_dim": 16, "qk_rope_head_dim": 8,
                              "v_head_dim": 12},
}  # fmt: skip
# int4_group's group size per model: one that divides every linear layer's input size (DeepSeek's q_b_proj takes 24)
GROUP = {"dense": 16, "moe": 16, "glm": 32, "deepseek": 8}
# Measured (miles-kernels 0.1.0, torch 2.9): `save_random_model(dir, tiny_config(kind, num_nextn_predict_layers=1))`,
# then `load_model(dir, KernelConfig(dtype="bfloat16"), weights=WeightQuantConfig(format=..., group_size=GROUP))`;
# (bytes of `checkpoint_tensors(model, mtp_copies=False)` less its buffers — the engine's parameters —, bytes of all
# of them — what a weight sync sends: GLM-4.5 / DeepSeek-V3 also send their routers' float32 biases).
MEASURED = {
    "dense": {"kernel": (271808, 271808), "fp8_block": (198136, 198136), "fp8_channel": (202176, 202176),
              "int4_group": (170656, 170656)},
    "moe": {"kernel": (422336, 422336), "fp8_block": (299680, 299680), "fp8_channel": (309184, 309184),
            "int4_group": (254272, 254272)},
    "glm": {"kernel": (534272, 534368), "fp8_block": (362516, 362612), "fp8_channel": (375040, 375136),
            "int4_group": (288080, 288176)},
    "deepseek": {"kernel": (539584, 539680), "fp8_block": (365536, 365632), "fp8_channel": (379776, 379872),
                 "int4_group": (322816, 322912)},
}  # fmt: skip
FORMATS = ("fp8_block", "fp8_channel", "int4_group")


def linears(kind: str) -> list[tuple[int, int]]:
    """(out, in) of every linear layer of the trunk (not the MTP layer), by hand from CONFIGS: what the engine
    quantizes."""
    attention = [(64, 64), (32, 64), (32, 64), (64, 64)]  # q, k, v (2 KV heads of 16), o
    if kind == "deepseek":  # q_a, q_b (4 heads x (16 + 8)), kv_a_proj_with_mqa (32 + 8), kv_b (4 x (16 + 12)), o
        attention = [(24, 64), (96, 24), (40, 64), (112, 32), (64, 48)]
    dense = [(128, 64), (128, 64), (64, 128)]  # gate, up, down
    expert = [(32, 64), (32, 64), (64, 32)]
    if kind == "dense":
        return 2 * (attention + dense)
    if kind == "moe":  # the router `mlp.gate` (8, 64) is a linear layer the engine keeps
        return 2 * (attention + 8 * expert)
    return attention + dense + 2 * (attention + expert + 8 * expert)  # a dense first layer; a shared expert


def stored(fmt: str, out: int, in_: int, block: tuple[int, int] = (128, 128), group: int = 128) -> int:
    """Bytes of one (out, in) weight in `fmt`, from the formats' stored parts (Hugging Face's layouts)."""
    if fmt == "fp8_block":  # float8 weight + a float32 weight_scale_inv per block
        return out * in_ + 4 * math.ceil(out / block[0]) * math.ceil(in_ / block[1])
    if fmt == "fp8_channel":  # float8 weight + a float32 weight_scale per output row
        return out * in_ + 4 * out
    return out * in_ // 2 + 2 * out * (in_ // group) + 16  # int4 in int32 words, bf16 scales, int64[2] weight_shape


def hand_count(kind: str, fmt: str, block: tuple[int, int] = (128, 128)) -> int:
    """The engine's weights in bfloat16 with the linear layers in `fmt`: the measured bfloat16 engine, less its linear
    layers at 2 B a weight, plus the same layers as stored."""
    layers = linears(kind)
    rest = MEASURED[kind]["kernel"][0] - 2 * sum(o * i for o, i in layers)
    return rest + sum(stored(fmt, o, i, block, GROUP[kind]) for o, i in layers)


def quant(kind: str, fmt: str, block: tuple[int, int] = (128, 128)) -> WeightQuantSettings:
    return WeightQuantSettings(fmt, block, GROUP[kind])


@pytest.mark.parametrize("kind", CONFIGS)
@pytest.mark.parametrize("fmt", FORMATS)
def test_engine_weights_match_the_engines_and_a_hand_count(kind: str, fmt: str) -> None:
    shape = ModelShape.from_hf(CONFIGS[kind])
    planned = embedded_engine_bytes(shape, "bfloat16", 16, 16, weight_quant=quant(kind, fmt))["weights"]
    assert planned == MEASURED[kind][fmt][0] == hand_count(kind, fmt)
    assert embedded_engine_bytes(shape, "bfloat16", 16, 16)["weights"] == MEASURED[kind]["kernel"][0]
    assert weight_sync_bytes(shape, "bfloat16", quant(kind, fmt)) == MEASURED[kind][fmt][1]
    assert sum(t.copies for t in shape.trunk_linears()) == len(linears(kind))


@pytest.mark.parametrize("block", [(16, 32), (48, 48), (128, 128)])
def test_fp8_block_scales_cover_partial_blocks(block: tuple[int, int]) -> None:
    shape = ModelShape.from_hf(CONFIGS["deepseek"])  # 24-, 40-, 96- and 112-row weights: partial 16- and 48-blocks
    planned = embedded_engine_bytes(shape, "bfloat16", 16, 16, weight_quant=quant("deepseek", "fp8_block", block))
    assert planned["weights"] == hand_count("deepseek", "fp8_block", block)


def run_config(path: Path, kind: str = "dense", **engine: object) -> dict[str, object]:
    (path / "config.json").write_text(json.dumps(CONFIGS[kind]))
    return {"model": {"path": str(path)}, "kernel": {"dtype": "bfloat16"}, "rollout": {"engine": engine}}


def test_a_run_configs_weight_dtype_reaches_the_plan(tmp_path: Path) -> None:
    config = run_config(tmp_path, weight_dtype="fp8_block", weight_block_size=[16, 32])
    assert read_run(config).weight_quant == WeightQuantSettings("fp8_block", (16, 32), 128)
    assert read_run(run_config(tmp_path)).weight_quant is None  # kernel, the default
    plan = plan_memory(config, "cpu", find_lever=False)
    (weights,) = [c for c in plan.components if c.phase == "rollout" and c.name.startswith("engine weights")]
    # on a CPU the native linear also keeps packed float32 copies of what it multiplies in the kernel dtype: here
    # the LM head (the fp8 layers run dequantized copies made per call)
    shape = ModelShape.from_hf(CONFIGS["dense"])
    head = 4 * shape.hidden_size * -(-shape.vocab_size // NATIVE_PANEL_WIDTH) * NATIVE_PANEL_WIDTH
    assert native_packed_bytes(shape, "bfloat16", weight_quant=read_run(config).weight_quant) == head
    assert weights.bytes == hand_count("dense", "fp8_block", (16, 32)) + head
    assert "the native linear's packed float32 copies" in weights.name
    assert "fp8_block (1 B/param + fp32 scale per 16x32 block) + the rest in bfloat16" in weights.name
    assert plan.layout["engine_weight_dtype"] == "fp8_block"
    mib = MEASURED["dense"]["kernel"][0] / 2**20
    assert any(f"({mib:,.1f} MiB in bfloat16); a weight sync sends them in that format" in n for n in plan.notes)
    (in_flight,) = [c for c in plan.components if c.phase == "rollout" and "dequantized" in c.name]
    assert in_flight.bytes == 2 * 128 * 64  # one weight at a time: gate / up, the largest, in bfloat16
    full = plan_memory(run_config(tmp_path), "cpu", find_lever=False)
    saved = MEASURED["dense"]["kernel"][0] + native_packed_bytes(shape, "bfloat16") - weights.bytes
    assert full.phases["rollout"] - plan.phases["rollout"] == saved - in_flight.bytes
    int4 = plan_memory(run_config(tmp_path, weight_dtype="int4_group", weight_group_size=16), "cpu", find_lever=False)
    assert int4.by_tag("rollout")["weights"] == MEASURED["dense"]["int4_group"][0] + head


def test_an_moe_engine_dequantizes_a_layers_routed_experts_at_once(tmp_path: Path) -> None:
    """miles_kernels' SparseMoE dequantizes every routed expert's weights before it runs any: 8 experts x (gate, up,
    down) of 32 x 64 in bfloat16 (what experts_forward receives, 98,304 bytes, measured), while its engine holds them
    in FP8."""
    plan = plan_memory(run_config(tmp_path, "moe", weight_dtype="fp8_channel"), "cpu", find_lever=False)
    (in_flight,) = [c for c in plan.components if c.phase == "rollout" and "dequantized" in c.name]
    assert in_flight.bytes == 2 * 8 * 3 * 32 * 64 == 98304
    assert not any("dequantized" in c.name for c in plan_memory(run_config(tmp_path, "moe"), "cpu").components)


@pytest.mark.parametrize(
    ("kind", "engine", "run", "message"),
    [
        ("deepseek", {"weight_dtype": "int4_group"}, {},
         "weight_group_size=128: model.layers.0.self_attn.q_a_proj has 64 input features, not a multiple of it "
         "(weight_group_size=8 fits every layer)"),
        ("dense", {"weight_dtype": "fp4"}, {}, "rollout.engine.weight_dtype must be one of kernel, fp8_block"),
        ("dense", {"weight_dtype": "fp8_block", "weight_block_size": [128]}, {},
         "rollout.engine.weight_block_size must be two positive integers"),
        ("dense", {"weight_dtype": "int4_group", "weight_group_size": 12}, {},
         "rollout.engine.weight_group_size must be a multiple of 8"),
        ("dense", {"weight_dtype": "fp8_block"}, {"trainer": {"lora": {"rank": 8}}},
         "rollout.engine.weight_dtype=fp8_block does not support trainer.lora"),
        ("dense", {"weight_dtype": "fp8_channel"}, {"trainer": {"backend": {"name": "megatron"}}},
         "rollout.engine.weight_dtype=fp8_channel does not support trainer.backend.name=megatron"),
        ("dense", {}, {"trainer": {"qat": True}}, "trainer.qat=true trains against the low-precision engine's"),
    ],
)  # fmt: skip
def test_what_a_low_precision_run_refuses_is_a_clear_error(
    tmp_path: Path, kind: str, engine: dict[str, object], run: dict[str, object], message: str
) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        plan_memory(run_config(tmp_path, kind, **engine) | run, "cpu", find_lever=False)


def test_sglang_with_a_low_precision_engine_is_refused() -> None:
    config = {"model": {"path": "Qwen/Qwen3-30B-A3B"}, "rollout": {"backend": "sglang", "engine": {
        "weight_dtype": "fp8_block"}}, "memory": {"plan": {"hardware": "h100"}}}  # fmt: skip
    with pytest.raises(ValueError, match=re.escape("does not support rollout.backend=sglang")):
        plan_memory(config, find_lever=False)


def test_qat_keeps_each_layers_fake_quantized_weights_for_the_backward(tmp_path: Path) -> None:
    """trainer.qat: every trunk linear layer's weight, fake-quantized in the compute dtype, is saved for backward
    (bf16: 2 B a weight); with full recompute only the recomputed layer's (both dense layers are the same size)."""
    shape = ModelShape.from_hf(CONFIGS["dense"])
    weights = sum(o * i for o, i in linears("dense"))  # both layers'
    per_layer = 2 * weights // 2
    assert fsdp2_bytes(shape, 1, "bfloat16", 256, qat=True)["qat_activations"] == 2 * weights
    assert fsdp2_bytes(shape, 1, "bfloat16", 256, qat=True, recompute="full")["qat_activations"] == per_layer
    assert "qat_activations" not in fsdp2_bytes(shape, 1, "bfloat16", 256)
    config = run_config(tmp_path, weight_dtype="fp8_block") | {"trainer": {"qat": True}}
    plan = plan_memory(config, "cpu", find_lever=False)
    (qat,) = [c for c in plan.components if c.phase == "train" and c.name.startswith("QAT")]
    assert qat.bytes == 2 * weights and plan.layout["qat"] is True
    without = plan_memory(run_config(tmp_path, weight_dtype="fp8_block"), "cpu", find_lever=False)
    assert plan.phases["train"] - without.phases["train"] == 2 * weights
