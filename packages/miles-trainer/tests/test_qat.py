"""CPU numerics, one in-process rank: a low-precision engine on the FSDP2 backend (miles_trainer/qat.py). Weight sync
sends the engine's format (FP8 / INT4 parts: fewer bytes, the same checksum on both sides); with quantization-aware
training the trainer's log-probs equal the quantized engine's rollout log-probs bit for bit after every step (paged
decode with changing batches on one side, packed training forwards on the other), and the master weights keep
training in float32; without it the quantization is a measured, nonzero mismatch."""

from __future__ import annotations

import pytest
import torch
from test_lora import samples_of

from miles_kernels import (
    KernelConfig,
    checkpoint_tensors,
    load_model,
    load_state,
    read_quantization,
    weights_checksum,
)
from miles_kernels.config import WeightQuantConfig
from miles_trainer import (
    BackendConfig,
    FSDP2Backend,
    LoraTrainConfig,
    OptimizerConfig,
    export_hf,
)

KERNEL = KernelConfig(page_size=8, attention_query_tile=4, linear_tile=4, moe_tile=4)
FORMATS = {
    "fp8_block": WeightQuantConfig(format="fp8_block", block_size=(32, 32)),
    "int4_group": WeightQuantConfig(format="int4_group", group_size=32),
}


def trainer(model_dir: str, weights: WeightQuantConfig, qat: bool) -> FSDP2Backend:
    config = BackendConfig(max_tokens_per_micro_batch=64)
    return FSDP2Backend(model_dir, KERNEL, OptimizerConfig(lr=1e-2), config=config, weight_quant=weights, qat=qat)


def sync(backend: FSDP2Backend, engine) -> int:
    tensors = backend.weights.export_weights()
    load_state(engine, tensors)
    return sum(t.numel() * t.element_size() for t in tensors.values())


@pytest.mark.parametrize("fmt", list(FORMATS))
@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_qat_logprobs_equal_the_quantized_engine_bitwise_while_masters_train(model_dirs, kind: str, fmt: str) -> None:
    weights = FORMATS[fmt]
    backend = trainer(model_dirs[kind], weights, qat=True)
    engine = load_model(model_dirs[kind], KERNEL, weights=weights)
    full_bytes = sum(t.numel() * t.element_size() for t in checkpoint_tensors(load_model(model_dirs[kind])).values())
    sent = sync(backend, engine)
    assert sent < full_bytes * (0.45 if fmt == "fp8_block" else 0.35)  # float32 -> FP8 / INT4 linear layers
    assert backend.weights.checksum() == weights_checksum(checkpoint_tensors(engine, mtp_copies=False).items())
    name = (
        "model.layers.0.mlp.down_proj.weight" if kind == "dense" else "model.layers.0.mlp.experts.0.down_proj.weight"
    )
    master = dict(backend.model.named_parameters())[name]
    assert master.dtype == torch.float32 and master.requires_grad
    before = master.detach().clone()
    for step in range(3):
        samples, advantages = samples_of(engine, seed=step)
        assert backend.compute_logprobs(samples) == [s.rollout_logprobs for s in samples], f"step {step}: mismatch"
        metrics = backend.train_step(samples, advantages, measure_mismatch=True)
        assert metrics["train_rollout_logprob_abs_diff_max"] == 0.0
        sync(backend, engine)
    assert not torch.equal(master, before)  # straight-through gradients reach the float32 masters
    assert backend.weights.checksum() == weights_checksum(checkpoint_tensors(engine, mtp_copies=False).items())


def test_without_qat_the_quantized_rollout_is_a_measured_mismatch(model_dirs) -> None:
    weights = FORMATS["int4_group"]
    backend = trainer(model_dirs["dense"], weights, qat=False)
    engine = load_model(model_dirs["dense"], KERNEL, weights=weights)
    sync(backend, engine)
    assert backend.weights.checksum() == weights_checksum(checkpoint_tensors(engine, mtp_copies=False).items())
    samples, advantages = samples_of(engine, seed=0)
    metrics = backend.train_step(samples, advantages, measure_mismatch=True)
    assert metrics["train_rollout_logprob_abs_diff_max"] > 0.0


def test_combinations_that_cannot_run_are_refused(model_dirs) -> None:
    with pytest.raises(ValueError, match=r"qat \(quantization-aware training\) needs the format"):
        trainer(model_dirs["dense"], WeightQuantConfig(), qat=True)
    with pytest.raises(ValueError, match="LoRA adapters is not supported"):
        FSDP2Backend(model_dirs["dense"], KERNEL, lora=LoraTrainConfig(rank=4), weight_quant=FORMATS["fp8_block"])


def test_the_export_adds_the_model_as_the_engine_served_it(model_dirs, tmp_path) -> None:
    weights = FORMATS["int4_group"]
    backend = trainer(model_dirs["dense"], weights, qat=True)
    engine = load_model(model_dirs["dense"], KERNEL, weights=weights)
    samples, advantages = samples_of(engine, seed=0)
    backend.train_step(samples, advantages)
    sync(backend, engine)
    export_hf(backend, tmp_path / "final")
    assert read_quantization(tmp_path / "final") == WeightQuantConfig()  # the float32 masters
    assert read_quantization(tmp_path / "final" / "quantized") == weights
    exported = load_model(tmp_path / "final" / "quantized", KERNEL, weights=weights)
    served = checkpoint_tensors(engine)
    assert all(torch.equal(t, served[n]) for n, t in checkpoint_tensors(exported).items())
