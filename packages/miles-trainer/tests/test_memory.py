"""CPU numerics tier (one in-process rank; test_fsdp.py runs the two-rank paths; one GPU test, marked): the trainer's
memory under a budget. Resident tensors that exceed it are a fatal OOM at start-up; activations that overrun it make
the step run again with half the tokens per micro-batch and give the gradient of a step that never ran out (to
float32 rounding: another split sums in another order, ~1e-8 here); with no room left to halve, the OOM is fatal and
reports what held memory by tag; partial offload moves only what the engine needs room for, largest first; the
offload plan and the per-step memory metrics are what the tensors hold."""

from __future__ import annotations

import gc
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from miles_contracts import Sample
from miles_kernels import KernelConfig, resolved_backends, save_model
from miles_kernels.testing import random_model, tiny_config
from miles_memory import (
    MemoryBudget,
    ModelShape,
    blocked_attention_elements,
    fsdp2_bytes,
    native_attention_elements,
    storage_bytes,
    unique_storages,
)
from miles_memory.config import MemoryConfig
from miles_trainer import BackendConfig, FSDP2Backend, OptimizerConfig, PolicyLossConfig, ensure_process_group

KERNEL = KernelConfig(page_size=8, attention_query_tile=4, linear_tile=4, moe_tile=4)
MAX_TOKENS = 32


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("memory") / "model"
    save_model(random_model(tiny_config("dense"), seed=5), path)
    ensure_process_group()
    return str(path)


def batch() -> tuple[list[Sample], list[float]]:
    """Twelve short samples (7 tokens each): any token budget down to 8 packs them whole."""
    generator = torch.Generator().manual_seed(9)
    samples = []
    for i in range(12):
        tokens = torch.randint(0, 256, (7,), generator=generator).tolist()
        samples.append(Sample(
            index=i, group_index=i // 4, prompt="", prompt_tokens=tokens[:4], response_tokens=tokens[4:],
            reward=float(i % 2), rollout_logprobs=(-torch.rand(3, generator=generator) - 3).tolist(),
        ))  # fmt: skip
    return samples, [float(i % 3) - 1.0 for i in range(12)]


def backend(model_dir: str, memory: MemoryConfig | None = None, tmp_path=None) -> FSDP2Backend:
    return FSDP2Backend(model_dir, KERNEL, OptimizerConfig(lr=1e-3), PolicyLossConfig(),
                        BackendConfig(max_tokens_per_micro_batch=MAX_TOKENS), offload_dir=tmp_path,
                        memory=memory)  # fmt: skip


def params(trainer: FSDP2Backend) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in trainer.model.named_parameters()}


def grads(trainer: FSDP2Backend) -> dict[str, torch.Tensor]:
    """The last step's gradients (they stay until the next step or an offload)."""
    return {k: v.grad.clone() for k, v in trainer.model.named_parameters() if v.grad is not None}


def test_resident_tensors_over_the_budget_are_a_fatal_oom_at_start(model_dir: str) -> None:
    with pytest.raises(torch.OutOfMemoryError, match=r"resident tensors \(weights .*, optimizer .*, grads") as caught:
        backend(model_dir, MemoryConfig(limit_bytes=1_000_000))
    assert caught.value.report.requested_bytes > 1_000_000  # type: ignore[attr-defined]
    assert "memory.limit_bytes" in str(caught.value)


def test_an_activation_overrun_retries_with_half_the_tokens_and_the_same_update(model_dir: str, tmp_path) -> None:
    samples, advantages = batch()
    free = backend(model_dir, tmp_path=tmp_path)
    metrics = free.train_step(samples, advantages)
    expected, peak = grads(free), int(metrics["mem_train_activation_peak_bytes"])
    held = int(metrics["mem_train_held_bytes"])
    assert peak > 0 and metrics["oom_retries"] == 0
    assert max(float(g.abs().max()) for g in expected.values()) > 1e-3  # a gradient worth comparing
    # Room for ~70% of the activations at 32 tokens per micro-batch: 16 tokens (about half) fit.
    limited = backend(model_dir, MemoryConfig(limit_bytes=held + int(0.7 * peak), min_tokens_per_micro_batch=8),
                      tmp_path)  # fmt: skip
    metrics = limited.train_step(samples, advantages)
    assert metrics["oom_retries"] == 1 and limited.max_tokens == MAX_TOKENS // 2
    assert metrics["mem_train_activation_peak_bytes"] <= 0.7 * peak
    got = grads(limited)
    assert got.keys() == expected.keys()
    for name, tensor in expected.items():  # the gradient is invariant to the micro-batch split
        torch.testing.assert_close(got[name], tensor, rtol=0, atol=1e-7, msg=name)


def test_no_room_to_halve_is_a_fatal_oom_with_a_report(model_dir: str, tmp_path) -> None:
    samples, advantages = batch()
    probe = backend(model_dir, tmp_path=tmp_path)
    held = int(probe.train_step(samples, advantages)["mem_train_held_bytes"])
    trainer = backend(model_dir, MemoryConfig(limit_bytes=held + 1000, min_tokens_per_micro_batch=16), tmp_path)
    with pytest.raises(torch.OutOfMemoryError, match="saved activations") as caught:
        trainer.train_step(samples, advantages)
    report = caught.value.report  # type: ignore[attr-defined]
    assert set(report.held_bytes) == {"weights", "mtp", "optimizer", "grads"} and report.held_bytes["grads"] > 0
    assert trainer.memory.num_oom_retries == 1  # 32 -> 16 tokens, then 8 would be below the minimum


def test_partial_offload_moves_only_what_the_engine_needs(model_dir: str, tmp_path) -> None:
    samples, advantages = batch()
    trainer = backend(model_dir, MemoryConfig(limit_bytes=10**9, partial_offload=True), tmp_path)
    trainer.train_step(samples, advantages)
    resident = sum(n for tag, n in trainer.memory.manager.resident_bytes().items() if tag != "grads")  # dropped
    state = [v for s in trainer.optimizer.state.values() for v in s.values() if v.dim()]
    largest = max(s.nbytes() for s in unique_storages([*trainer.model.parameters(), *state]))
    room_for = 10**9 - resident + 1  # one byte short: the largest storage goes, nothing else
    before = params(trainer)
    assert trainer.offload(room_for=room_for) == largest
    assert trainer.is_offloaded
    trainer.onload()
    for name, tensor in params(trainer).items():
        assert torch.equal(tensor, before[name]), name
    assert trainer.offload() == resident  # no room_for: everything


def test_an_onload_that_would_not_fit_keeps_the_state_offloaded(model_dir: str, tmp_path) -> None:
    trainer = backend(model_dir, tmp_path=tmp_path)
    resident = storage_bytes(trainer.model.parameters())
    trainer.offload()
    trainer.memory.manager.budget = MemoryBudget(resident // 2)
    with pytest.raises(torch.OutOfMemoryError, match="trainer onload"):
        trainer.onload()
    assert trainer.is_offloaded
    trainer.memory.manager.budget = None
    assert trainer.onload() == resident


# The built-in policy's shape (2 layers here), and the same trunk in the DeepSeek-V3 family (MLA, a dense first layer
# and an MoE one: the bootstrap's deepseek_v3 policy, miles_orchestrator.data.bootstrap).
PLANNED = {
    "dense": ("dense", {"num_key_value_heads": 4, "head_dim": 32}),
    "deepseek": ("deepseek", {"num_key_value_heads": 8, "head_dim": 16, "num_experts": 8, "moe_intermediate_size": 256,
                              "n_group": 4, "topk_group": 2, "q_lora_rank": 128, "kv_lora_rank": 64,
                              "qk_nope_head_dim": 32, "qk_rope_head_dim": 16, "v_head_dim": 32}),
}  # fmt: skip


@pytest.mark.parametrize("family", list(PLANNED))
def test_the_planner_predicts_what_the_trainer_holds_by_tag(tmp_path, family: str) -> None:
    """miles_memory.fsdp2_bytes against the bytes the tensors hold after a step of a model shaped like the built-in
    policy (hidden 256, 8 / 4 heads of 32; 2 layers here; and its DeepSeek-V3 form) on 16-token sequences (one rank;
    benchmarks/memory.py runs the policy itself on 1 and 2 ranks): parameters, gradients, AdamW state and MTP modules
    exactly, and the activations counted as autograd saves them, with the deterministic attention's per-block term,
    within 10%."""
    kind, overrides = PLANNED[family]
    config = tiny_config(kind, hidden_size=256, intermediate_size=768, num_hidden_layers=2, num_attention_heads=8,
                         num_nextn_predict_layers=1, **overrides)  # fmt: skip
    save_model(random_model(config, seed=1), tmp_path / "model")
    ensure_process_group()
    trainer = FSDP2Backend(tmp_path / "model", KernelConfig(), OptimizerConfig(), PolicyLossConfig(),
                           BackendConfig(max_tokens_per_micro_batch=512), offload_dir=tmp_path)  # fmt: skip
    generator = torch.Generator().manual_seed(0)
    samples = []
    for i in range(32):
        tokens = torch.randint(0, 256, (16,), generator=generator).tolist()
        samples.append(Sample(index=i, group_index=i, prompt="", prompt_tokens=tokens[:12],
                              response_tokens=tokens[12:], reward=1.0, rollout_logprobs=[-1.0] * 4))  # fmt: skip
    trainer.train_step(samples, [1.0] * 32)
    resident = trainer.memory.manager.resident_bytes()
    shape = ModelShape.from_hf(json.loads((tmp_path / "model" / "config.json").read_text()))
    kernel = KernelConfig()
    if resolved_backends(kernel)["attention"] == "native":  # the default on a CPU where the library built
        extra = native_attention_elements(shape, 16)
    else:
        extra = blocked_attention_elements(shape, 16, kernel.attention_query_tile, kernel.page_size)
    planned = fsdp2_bytes(shape, 1, "float32", 512, attention_extra=extra)
    for tag in ("weights", "grads", "optimizer", "mtp"):
        assert planned[tag] == resident[tag], (tag, planned[tag], resident[tag])
    measured = trainer.memory.peak_activation_bytes
    assert planned["activations"] == pytest.approx(measured, rel=0.10), (planned["activations"], measured)


@pytest.mark.parametrize(("offload", "moments_dtype"), [("moments", "float32"), ("moments", "bfloat16"),
                                                       ("moments_and_master", "bfloat16")])  # fmt: skip
def test_the_planner_predicts_the_host_optimizers_bytes(tmp_path, offload: str, moments_dtype: str) -> None:
    """`fsdp2_bytes(..., offload=)` against the tensors of an FSDP2 trainer with its AdamW state in host memory
    (miles_trainer.host_adam) after a step, one rank: the moments (and `step`s) exactly, in their dtype, and with
    `moments_and_master` the float32 shards and gradients FSDP2's CPU offload keeps there, none of it planned on the
    device."""
    config = tiny_config("dense", hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=16, num_nextn_predict_layers=1)  # fmt: skip
    save_model(random_model(config, seed=1), tmp_path / "model")
    ensure_process_group()
    optimizer = OptimizerConfig(offload=offload, moments_dtype=moments_dtype)
    trainer = FSDP2Backend(tmp_path / "model", KernelConfig(), optimizer, PolicyLossConfig(),
                           BackendConfig(max_tokens_per_micro_batch=512), offload_dir=tmp_path)  # fmt: skip
    samples, advantages = batch()
    trainer.train_step(samples, advantages)
    shape = ModelShape.from_hf(json.loads((tmp_path / "model" / "config.json").read_text()))
    planned = fsdp2_bytes(shape, 1, "float32", 512, offload=offload, moments_dtype=moments_dtype)

    def local_bytes(tensors) -> int:  # type: ignore[no-untyped-def]
        return storage_bytes(t.to_local() if hasattr(t, "to_local") else t for t in tensors)

    state = [v for s in trainer.optimizer.state.values() for v in s.values()]
    assert {v.dtype for v in state if v.dim() > 0} == {getattr(torch, moments_dtype)}
    assert planned["host_optimizer"] == local_bytes(state)
    assert planned["optimizer"] == 0
    trunk = [p for p in trainer.model.parameters() if id(p) not in {id(q) for q in trainer.model.mtp_parameters()}]
    if offload == "moments_and_master":
        assert planned["host_weights"] == local_bytes(trainer.model.parameters())
        assert planned["host_grads"] == local_bytes(p.grad for p in trunk if p.grad is not None) > 0
        assert planned["weights"] == planned["grads"] == planned["mtp"] == 0
        assert planned["gathered"] > 0  # one float32 rank is sharded for the offload: FSDP2 uploads its layers
    else:
        assert planned["weights"] == local_bytes(trunk) and "host_weights" not in planned


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_the_planner_predicts_a_gpu_steps_peak(tmp_path) -> None:
    """benchmarks/memory_gpu.py on the GPU: a 0.25B-parameter model's FSDP2 step in bf16 fast kernels, planned
    (`fsdp2_bytes`) vs `torch.cuda.max_memory_allocated`, within 10%, with and without activation checkpointing."""
    script = Path(__file__).parents[3] / "benchmarks" / "memory_gpu.py"
    out = tmp_path / "memory_gpu.json"
    subprocess.run([sys.executable, str(script), "--out", str(out)], check=True, timeout=900)
    for run in json.loads(out.read_text())["runs"]:
        assert abs(run["error"]) <= 0.10, run


@pytest.mark.parametrize("kind", ["dense", "moe", "glm", "qwen2", "llama", "deepseek"])
@pytest.mark.parametrize("tied", [True, False])
def test_the_planner_counts_every_tensor_of_each_family(kind: str, tied: bool) -> None:
    """The planner's tensor list (miles_memory.ModelShape, read from config.json) holds exactly the model's
    checkpoint tensors, shape for shape: the q / k / v / o biases, QK-norms and router biases of each family."""
    from miles_kernels import checkpoint_tensors

    config = tiny_config(kind, tie_word_embeddings=tied)
    shape = ModelShape.from_hf(config.to_hf())
    planned = sorted((t.shape, t.copies) for t in shape.tensors())
    tensors = checkpoint_tensors(random_model(config, seed=0))
    assert shape.params() == sum(t.numel() for t in tensors.values())
    expert_free = sorted(((tuple(t.shape), 1) for name, t in tensors.items() if ".experts." not in name))
    assert [p for p in planned if p[1] == 1] == expert_free


def test_no_graph_outlives_a_step(model_dir: str, tmp_path) -> None:
    """The entropy (a metric at entropy_coef 0) is computed outside autograd, and what the activation meter keeps
    holds no grad_fn: after a step no tensor of an autograd graph is left (each one left would stay for good)."""
    samples, advantages = batch()
    trainer = backend(model_dir, tmp_path=tmp_path)
    for _ in range(2):
        metrics = trainer.train_step(samples, advantages)
    gc.collect()
    left = [tuple(t.shape) for t in gc.get_objects() if isinstance(t, torch.Tensor) and t.grad_fn is not None]
    assert not left, f"tensors of an autograd graph outlive the step: {left}"
    assert metrics["entropy"] > 1.0  # still reported
