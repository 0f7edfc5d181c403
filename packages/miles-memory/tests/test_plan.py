"""Pure logic tier (no torch): the memory planner's parameter counts against the models' published numbers, each
byte term against a hand computation, layout errors, the lever finder, and the examples' recorded plans."""

from __future__ import annotations

import json
import re
import struct
from pathlib import Path

import pytest

from miles_memory import LoraSettings, fsdp2_bytes, load_hardware, load_model_profile, plan_memory
from miles_memory.levers import candidates
from miles_memory.model_shape import MODELS, ModelShape, model_profiles
from miles_memory.plan_formulas import embedded_engine_bytes, kv_bytes_per_token, native_packed_bytes
from miles_memory.planner import _plan
from miles_memory.run_inputs import read_run

ROOT = Path(__file__).resolve().parents[3]
GIB = 2**30

# The built-in example's policy (miles_orchestrator.data.bootstrap.policy_config with the default 264-token vocab)
POLICY = {
    "model_type": "qwen3", "vocab_size": 264, "hidden_size": 256, "intermediate_size": 768, "num_hidden_layers": 4,
    "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 32, "tie_word_embeddings": True,
    "num_nextn_predict_layers": 1,
}  # fmt: skip


@pytest.mark.parametrize("name", MODELS)
def test_parameter_counts_match_published(name: str) -> None:
    shape = load_model_profile(name)
    published = model_profiles()[name]["published"]
    total = shape.params(mtp=False)
    assert total == pytest.approx(float(published["total"]), rel=0.02)
    active = shape.active_params()
    if published.get("active_excludes_embeddings"):
        active -= shape.vocab_size * shape.hidden_size * (1 if shape.tie_word_embeddings else 2)
    assert active == pytest.approx(float(published["active"]), rel=0.02)
    if "checkpoint_total" in published:  # DeepSeek-V3's MTP layer stores its own embedding and head copies
        copies = 2 * shape.vocab_size * shape.hidden_size * shape.num_nextn_predict_layers
        assert total + shape.params(mtp=True) + copies == pytest.approx(float(published["checkpoint_total"]), rel=0.01)


def test_policy_params_by_hand() -> None:
    shape = ModelShape.from_hf(POLICY)
    attention = 256 * 256 * 2 + 128 * 256 * 2 + 32 * 2  # q, o; k, v; q_norm, k_norm
    layer = attention + 3 * 256 * 768 + 2 * 256
    assert shape.params(mtp=False) == 264 * 256 + 4 * layer + 256  # tied head: the embedding once
    assert shape.params(mtp=True) == layer + 3 * 256 + 256 * 512  # enorm, hnorm, shared_head.norm; eh_proj


def test_fsdp2_bytes_by_hand() -> None:
    shape = ModelShape.from_hf(POLICY)
    trunk, mtp = shape.params(mtp=False), shape.params(mtp=True)
    tensors = 1 + 4 * 11 + 1  # embedding, 11 per layer, final norm
    one = fsdp2_bytes(shape, 1, "float32", 256)
    assert one["weights"] == 4 * trunk and one["grads"] == 4 * trunk
    assert one["optimizer"] == 8 * trunk + 4 * tensors  # exp_avg, exp_avg_sq; a float32 step per tensor
    assert one["mtp"] == 4 * mtp and one["gathered"] == 0  # one float32 rank is a plain module
    two = fsdp2_bytes(shape, 2, "float32", 256, keep_reference=True, is_mtp_trained=True)
    assert two["weights"] == 4 * trunk // 2 + 4 * (trunk + mtp) // 2  # every dim 0 here is even
    assert two["mtp"] == 4 * mtp // 2 * 2 + 8 * mtp // 2 + 4 * 15  # weights, grads, moments, 15 steps
    assert two["gathered"] > 0
    odd = fsdp2_bytes(ModelShape.from_hf({**POLICY, "vocab_size": 265}), 2, "float32", 256)
    assert odd["weights"] - one["weights"] // 2 == 4 * 133 * 256 - 4 * 132 * 256  # 265 rows pad to 2 x 133


def test_engine_and_kv_bytes_by_hand() -> None:
    shape = ModelShape.from_hf(POLICY)
    engine = embedded_engine_bytes(shape, "bfloat16", 1024, 16, has_draft=True)
    assert engine["weights"] == 2 * (shape.params(mtp=False) + shape.params(mtp=True))
    assert engine["kv_cache"] == 2 * (4 + 1) * 1024 * 4 * 16 * 32 * 2  # K and V, 4 layers + draft
    deepseek = load_model_profile("DeepSeek-V3")
    assert kv_bytes_per_token(deepseek, 2) == (512 + 64) * 61 * 2  # MLA's latent, not per-head K/V
    qwen = load_model_profile("Qwen3-30B-A3B")
    assert kv_bytes_per_token(qwen, 2, tp=8) == 2 * 1 * 128 * 48 * 2  # 4 KV heads over tp 8: one per GPU


MEGATRON = ("tp", "pp", "ep", "etp", "cp")
SGLANG = {"rollout_tp": "tp_size", "rollout_ep": "ep_size", "mem_fraction_static": "mem_fraction_static"}


def _run(trainer_backend: str = "megatron", rollout_engine: str = "sglang", **plan: object) -> dict[str, object]:
    """A Qwen3-30B-A3B run config on h100: the layout in the run's own sections, the rest in memory.plan."""
    plan = {"rollout_tp": 8} | plan
    megatron = {key: plan.pop(key) for key in MEGATRON if key in plan}
    sglang = {name: plan.pop(key) for key, name in SGLANG.items() if key in plan}
    return {
        "model": {"path": "Qwen/Qwen3-30B-A3B"}, "kernel": {"dtype": "bfloat16"},
        "trainer": {"backend": {"name": trainer_backend, "megatron": megatron}},
        "rollout": {"backend": rollout_engine, "sglang": sglang},
        "memory": {"plan": {"hardware": "h100"} | plan},
    }  # fmt: skip


def test_megatron_bytes_per_param_follow_the_distributed_optimizer_table() -> None:
    # Megatron-core docs, "Distributed Optimizer": bf16 params + fp32 grads = 18 B/param, or 6 + 12/d
    shape = load_model_profile("Qwen3-30B-A3B")
    params = shape.params()
    for distributed, expected in ((False, 18), (True, 6 + 12 / 8)):
        plan = plan_memory(_run(distributed_optimizer=distributed, ep=1), find_lever=False)
        state = sum(
            c.bytes for c in plan.components if c.phase == "train" and c.tag in ("weights", "grads", "optimizer")
        )
        assert state == pytest.approx(expected * params, rel=1e-6)


@pytest.mark.parametrize(
    ("plan", "message"),
    [
        ({"tp": 3}, "tp*pp*cp = 3 does not divide"),
        ({"ep": 3}, "ep=3 does not divide the model's 128 experts"),
        ({"tp": 8}, "tp=8 does not divide num_key_value_heads=4"),
        ({"rollout_tp": 3}, "rollout_tp=3 does not divide"),
    ],
)
def test_impossible_layouts_are_clear_errors(plan: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        plan_memory(_run(**plan))


def test_the_layout_is_read_from_the_runs_own_sections() -> None:
    run = read_run(_run(tp=2, ep=4, rollout_ep=4, mem_fraction_static=0.6))
    assert (run.plan.trainer_backend, run.plan.tp, run.plan.ep, run.plan.etp) == ("megatron", 2, 4, 1)
    assert (run.plan.rollout_engine, run.plan.rollout_tp, run.plan.rollout_ep) == ("sglang", 8, 4)
    assert run.plan.mem_fraction_static == 0.6
    fsdp2 = read_run(_run(trainer_backend="fsdp2", rollout_engine="embedded", tp=2, rollout_tp=4))
    assert (fsdp2.plan.tp, fsdp2.plan.rollout_tp) == (1, 1)  # the sections of another backend are not read
    old = _run()
    old["memory"]["plan"] |= {"tp": 4, "rollout_engine": "sglang"}  # type: ignore[index]
    with pytest.raises(ValueError, match=r"memory\.plan\.tp is now trainer\.backend\.megatron\.tp, memory\.plan\."
                       r"rollout_engine is now rollout\.backend"):  # fmt: skip
        read_run(old)


def test_unknown_hardware_and_model_list_the_known_ones() -> None:
    with pytest.raises(ValueError, match="known: h100, h200, b200, gb300, cpu"):
        plan_memory(_run(), hardware="tpu")
    with pytest.raises(ValueError, match="known profiles: Qwen3-30B-A3B"):
        plan_memory({"model": {"path": "nobody/NoModel"}})


def test_the_named_lever_makes_the_run_fit() -> None:
    config = _run(ep=8, rollout_tp=4, rollout_ep=4)
    plan = plan_memory(config)
    assert not plan.fits and plan.lever
    run, hw = read_run(config), load_hardware("h100")
    changed = dict(candidates(run, hw, plan))[plan.lever]
    assert _plan(changed, hw).fits


def test_cpu_plan_of_a_local_model_sums_ranks(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps(POLICY))
    one = plan_memory({"model": {"path": str(tmp_path)}, "run": {"colocate": False}}, "cpu")
    two = plan_memory(
        {"model": {"path": str(tmp_path)}, "run": {"colocate": False}, "trainer": {"num_ranks": 2}}, "cpu"
    )
    assert one.fits and two.fits and one.supported_by == ["fsdp2"]
    # two ranks hold half the state each, plus a second runtime: more than one rank's total, less than twice
    assert one.phases["train"] < two.phases["train"] < 2 * one.phases["train"]


def write_safetensors(path: Path, names: list[str]) -> None:
    """A safetensors file of one-float tensors (the format: 8-byte little-endian header length, JSON header, data)."""
    header = {name: {"dtype": "F32", "shape": [1], "data_offsets": [4 * i, 4 * i + 4]} for i, name in enumerate(names)}
    data = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(data)) + data + bytes(4 * len(names)))


def test_a_checkpoint_without_the_mtp_layer_its_config_declares_is_planned_without(tmp_path: Path) -> None:
    """As transformers saves GLM-4.5 (and Miles loads it): config.json declares the MTP layer, no tensor of it."""
    (tmp_path / "config.json").write_text(json.dumps(POLICY))  # 4 trunk layers + 1 MTP layer (layer 4)
    trunk = ["model.embed_tokens.weight", "model.layers.0.self_attn.q_proj.weight", "model.norm.weight"]
    config = {"model": {"path": str(tmp_path)}, "run": {"colocate": False}, "spec": {"mode": "online"}}
    write_safetensors(tmp_path / "model.safetensors", trunk)
    without = plan_memory(config, "cpu")
    assert without.params["mtp"] == 0 and "1 MTP layer(s) absent from the checkpoint" in without.model
    assert not any(c.tag == "mtp" and c.bytes for c in without.components)
    write_safetensors(tmp_path / "model.safetensors", [*trunk, "model.layers.4.eh_proj.weight"])
    with_mtp = plan_memory(config, "cpu")
    assert with_mtp.params["mtp"] == ModelShape.from_hf(POLICY).params(mtp=True) > 0
    assert any(c.tag == "mtp" and c.bytes for c in with_mtp.components)
    assert with_mtp.phases["train"] > without.phases["train"]


def lora_params(rank: int, *shapes: tuple[int, int]) -> int:
    """Adapter parameters of adapted (out, in) weights: lora_A (rank x in) + lora_B (out x rank) each."""
    return sum(rank * (out + in_) for out, in_ in shapes)


# the built-in policy's linear layers (out, in) in each of its 4 decoder layers
LINEAR = {"q_proj": (256, 256), "k_proj": (128, 256), "v_proj": (128, 256), "o_proj": (256, 256),
          "gate_proj": (768, 256), "up_proj": (768, 256), "down_proj": (256, 768)}  # fmt: skip


def policy_layer(rank: int, *names: str) -> int:
    """Adapter parameters of one policy layer with adapters on `names` (all its linear layers when none)."""
    return lora_params(rank, *(LINEAR[name] for name in names or LINEAR))


def test_lora_adapters_by_hand() -> None:
    """ModelShape.lora_tensors against hand counts, with miles_kernels.lora.target_names' rules: PEFT's name matching,
    'all-linear' over the trunk's linear layers (no router, LM head or MTP layer), one regex over the full name.
    (test_lora_plan.py checks the same against the adapters miles_kernels.add_lora makes.)"""
    policy = ModelShape.from_hf(POLICY)

    def count(shape: ModelShape, rank: int, targets: str | tuple[str, ...]) -> int:
        return sum(t.numel for t in shape.lora_tensors(rank, targets))

    assert count(policy, 8, "all-linear") == 4 * policy_layer(8)  # 4 layers; the MTP layer takes none
    assert count(policy, 8, ("q_proj", "v_proj")) == 4 * policy_layer(8, "q_proj", "v_proj")
    mlp = policy_layer(8, "gate_proj", "up_proj", "down_proj")
    assert count(policy, 8, r"model\.layers\.[02]\.mlp\..*") == 2 * mlp
    qwen = load_model_profile("Qwen3-30B-A3B")  # 48 MoE layers of 128 experts (768 x 2048); the router stays frozen
    assert count(qwen, 4, ("experts.0.up_proj",)) == 48 * lora_params(4, (768, 2048))
    assert count(qwen, 4, ("up_proj",)) == 48 * 128 * lora_params(4, (768, 2048))
    deepseek = load_model_profile("DeepSeek-V3")  # MLA with a q-LoRA; 3 dense layers, then 256 experts + 1 shared
    mla = [(1536, 7168), (128 * 192, 1536), (512 + 64, 7168), (128 * (128 + 128), 512), (7168, 128 * 128)]
    dense = [(18432, 7168), (18432, 7168), (7168, 18432)]
    expert = [(2048, 7168), (2048, 7168), (7168, 2048)]
    assert count(deepseek, 16, "all-linear") == (
        61 * lora_params(16, *mla) + 3 * lora_params(16, *dense) + 58 * 257 * lora_params(16, *expert)
    )
    assert count(deepseek, 16, ("kv_b_proj",)) == 61 * lora_params(16, (128 * 256, 512))


def test_lora_fsdp2_bytes_by_hand() -> None:
    shape = ModelShape.from_hf(POLICY)
    trunk = shape.params(mtp=False)
    targets = ("q_proj", "v_proj")
    adapters = 4 * policy_layer(8, "q_proj", "v_proj")
    full = fsdp2_bytes(shape, 1, "float32", 256)
    lora = fsdp2_bytes(shape, 1, "float32", 256, lora=LoraSettings(8, targets))
    assert lora["weights"] == full["weights"] == 4 * trunk  # the frozen base, float32
    assert lora["adapters"] == 4 * adapters and "adapters" not in full
    assert lora["grads"] == 4 * adapters  # the base has none
    assert lora["optimizer"] == 8 * adapters + 4 * 4 * 2 * 2  # moments; a step per tensor: 4 layers x 2 x (A, B)
    assert lora["mtp"] == full["mtp"] and lora["activations"] == full["activations"]
    merged = 256 * 256 + 128 * 256  # elements of one layer's adapted weights (q, v)
    assert lora["lora_activations"] == 4 * merged * 4  # deterministic: each of 4 layers keeps its merged q, v (fp32)
    bf16 = fsdp2_bytes(shape, 1, "bfloat16", 256, lora=LoraSettings(8, targets, "bfloat16"))
    assert bf16["weights"] == 2 * trunk and bf16["adapters"] == 4 * adapters
    layer = sum(t.numel for t in shape.tensors() if t.layer == 0) + policy_layer(8, "q_proj", "v_proj")
    assert bf16["gathered"] == 2 * (264 * 256 + 256 + 2 * layer)  # root + 2 layers, adapters with their layer
    assert bf16["lora_activations"] == 4 * merged * 2  # in the compute dtype
    full_recompute = fsdp2_bytes(shape, 1, "float32", 256, recompute="full", lora=LoraSettings(8, targets))
    assert full_recompute["lora_activations"] == merged * 4  # only the layer being recomputed
    fast = fsdp2_bytes(shape, 1, "float32", 256, lora=LoraSettings(8, targets), is_deterministic=False)
    assert fast["lora_activations"] == 4 * 2 * 256 * 8 * 4  # x A^T (N x r) of q and v in each layer


def policy_run(tmp_path: Path, **lora: object) -> dict[str, object]:
    (tmp_path / "config.json").write_text(json.dumps(POLICY))
    return {"model": {"path": str(tmp_path)}, "kernel": {"dtype": "bfloat16"}, "trainer": {"lora": lora}}


def test_a_lora_run_trains_adapter_sized_grads_and_optimizer(tmp_path: Path) -> None:
    """The same run with and without LoRA: grads and AdamW state drop to the adapters', the base halves in bfloat16,
    and the engine holds the adapters and a merged copy of each adapted layer besides its base."""
    full = plan_memory(policy_run(tmp_path), "cpu")
    lora = plan_memory(policy_run(tmp_path, rank=8, base_dtype="bfloat16"), "cpu")
    adapters = 4 * policy_layer(8)
    trunk = ModelShape.from_hf(POLICY).params(mtp=False)
    assert lora.params["lora"] == adapters and "lora" not in full.params
    train, train_full = lora.by_tag("train"), full.by_tag("train")
    assert train_full["grads"] == 4 * trunk and train["grads"] == 4 * adapters
    assert train["optimizer"] == 8 * adapters + 4 * 2 * 28  # 28 adapted layers, A and B each
    weights = {c.name: c.bytes for c in lora.components if c.phase == "train" and c.tag == "weights"}
    assert weights["frozen base (bfloat16) + critic params"] == 2 * trunk
    assert weights["LoRA adapters (rank 8): fp32 masters"] == 4 * adapters
    # colocated on cpu: the released engine keeps its weights in host memory, the same RAM (weight syncs send only
    # the adapters, so its base cannot be dropped and sent again)
    engine = 2 * (trunk + ModelShape.from_hf(POLICY).params(mtp=True))
    engine += native_packed_bytes(ModelShape.from_hf(POLICY), "bfloat16")  # the native linear's copies (a CPU)
    folded = 2 * (adapters + 4 * sum(out * in_ for out, in_ in LINEAR.values()))
    kept = sum(c.bytes for c in lora.components if c.phase == "train" and "kept in host memory" in c.name)
    assert kept == engine + folded
    assert lora.by_tag("rollout")["weights"] == engine + folded
    assert lora.phases["train"] < full.phases["train"]
    assert any("LoRA rank 8 on 28 linear layers" in note for note in lora.notes)
    # kl_coef > 0: the full run plans a reference copy, the LoRA run none (its reference is the base, adapters off)
    full_run, lora_run = policy_run(tmp_path), policy_run(tmp_path, rank=8, base_dtype="bfloat16")
    for run in (full_run, lora_run):
        run["trainer"]["loss"] = {"kl_coef": 0.1}  # type: ignore[index]
    full_kl, lora_kl = plan_memory(full_run, "cpu"), plan_memory(lora_run, "cpu")
    assert full_kl.by_tag("train")["weights"] == train_full["weights"] + 4 * ModelShape.from_hf(POLICY).params()
    assert lora_kl.by_tag("train")["weights"] == train["weights"]


def test_a_colocated_lora_engine_on_gpus_keeps_its_weights_in_host_memory() -> None:
    run = {
        "model": {"path": "Qwen/Qwen3-30B-A3B"}, "kernel": {"dtype": "bfloat16", "mode": "fast"},
        "trainer": {"lora": {"rank": 16, "target_modules": ["q_proj", "v_proj"]}},
        "memory": {"plan": {"hardware": "h100"}},
    }  # fmt: skip
    plan = plan_memory(run, find_lever=False)
    kept = [c for c in plan.components if c.phase == "host" and "kept in host memory" in c.name]
    engine = sum(c.bytes for c in plan.components if c.phase == "rollout" and c.tag == "weights")
    assert sum(c.bytes for c in kept) == 8 * engine  # 8 embedded engines a node, each its whole model
    without = plan_memory({**run, "trainer": {}}, find_lever=False)
    assert not any("kept in host memory" in c.name for c in without.components)


@pytest.mark.parametrize(
    ("run", "message"),
    [
        (
            {"kernel": {"dtype": "float32"}, "trainer": {"lora": {"rank": 8, "base_dtype": "bfloat16"}}},
            "trainer.lora.base_dtype=bfloat16 needs kernel.dtype=bfloat16 (it is float32): the trainer refuses it",
        ),
        (
            {"trainer": {"backend": {"name": "megatron", "megatron": {"tp": 2}}, "lora": {"rank": 8}}},
            "does not support trainer.lora (LoRA adapters) with trainer.backend.megatron.tp > 1",
        ),
        (
            {"rollout": {"backend": "sglang"}, "kernel": {"mode": "fast"}, "trainer": {"lora": {"rank": 8}}},
            "trainer.lora with rollout.backend=sglang is not supported yet",
        ),
        (
            {"trainer": {"lora": {"rank": 8, "target_modules": ["gate"]}}},
            "trainer.lora.target_modules ['gate'] match no linear layer of the qwen3_moe decoder",
        ),
        ({"trainer": {"lora": {"rank": 8, "target_modules": ["lm_head"]}}}, "['lm_head'] match no linear layer"),
        ({"trainer": {"lora": {"rank": 8, "target_modules": []}}}, "trainer.lora.target_modules is empty"),
        ({"trainer": {"lora": {"rank": 8, "target_modules": "q_proj("}}}, "is not a regular expression"),
        (
            {"trainer": {"lora": {"rank": 8, "target_modules": r"lm_head|model\.layers\.48\..*"}}},
            "match no linear layer of the decoder",
        ),
        ({"trainer": {"lora": {"rank": -1}}}, "trainer.lora.rank must be an integer from 0 (no LoRA) to 4096"),
        ({"trainer": {"lora": {"rank": 8, "base_dtype": "float16"}}}, "must be float32 or bfloat16, not 'float16'"),
    ],
)
def test_lora_settings_the_trainer_refuses_are_clear_errors(run: dict[str, object], message: str) -> None:
    config = {"model": {"path": "Qwen/Qwen3-30B-A3B"}, "memory": {"plan": {"hardware": "h100"}}}
    with pytest.raises(ValueError, match=re.escape(message)):
        plan_memory(config | run, find_lever=False)


def test_the_lora_base_in_bfloat16_is_a_lever(tmp_path: Path) -> None:
    config = policy_run(tmp_path, rank=8)  # a float32 base under bfloat16 kernels
    plan = plan_memory(config, "cpu")
    assert plan.peak_phase == "train"
    run, hw = read_run(config), load_hardware("cpu")
    changed = dict(candidates(run, hw, plan))["trainer.lora.base_dtype: bfloat16"]
    trunk = ModelShape.from_hf(POLICY).params(mtp=False)
    assert plan.phases["train"] - _plan(changed, hw).phases["train"] == 2 * trunk
    assert "trainer.lora.base_dtype: bfloat16" in [lever.change for lever in plan.levers]


EXAMPLES = sorted((ROOT / "examples" / "plans").glob("*.json"))


@pytest.mark.parametrize("record", EXAMPLES, ids=lambda p: p.stem)
def test_examples_fit_and_match_their_records(record: Path) -> None:
    name, hardware = record.stem.rsplit(".", 1)
    plan = plan_memory(ROOT / "examples" / f"{name}.yaml")
    assert plan.hardware == hardware and plan.fits, plan.summary()
    assert plan.model_dump(mode="json") == json.loads(record.read_text()), "re-record: tests/plan_matrix.py --record"
