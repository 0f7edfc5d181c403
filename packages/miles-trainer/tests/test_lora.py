"""CPU numerics, one in-process rank: LoRA on the FSDP2 backend. Only the adapters train (gradients, optimizer state,
checkpoint bytes, weight sync); a model that merges the synced adapters as the engine does (miles_kernels.lora) gives
the trainer's log-probs bit for bit after steps (true on-policy); checkpoints hold adapters only and resume
bitwise; the export is a PEFT adapter that `peft` + transformers load, and a merged checkpoint."""

from __future__ import annotations

import json

import pytest
import torch
from test_true_on_policy import rollout
from torch.distributed.checkpoint import FileSystemReader

from miles_contracts import Sample
from miles_kernels import (
    KernelConfig,
    add_lora,
    build_packed_batch,
    checkpoint_tensors,
    fold_adapters,
    load_model,
    load_state,
    weights_checksum,
)
from miles_trainer import (
    BackendConfig,
    FSDP2Backend,
    LoraTrainConfig,
    OptimizerConfig,
    PolicyLossConfig,
    export_hf,
    load_checkpoint,
    save_checkpoint,
)

KERNEL = KernelConfig(page_size=8, attention_query_tile=4, linear_tile=4, moe_tile=4)
LORA = LoraTrainConfig(rank=4, alpha=8)


def trainer(
    model_dir: str, lora: LoraTrainConfig = LORA, kernel: KernelConfig = KERNEL, loss: PolicyLossConfig | None = None
) -> FSDP2Backend:
    return FSDP2Backend(model_dir, kernel, OptimizerConfig(lr=1e-2), loss or PolicyLossConfig(),
                        BackendConfig(max_tokens_per_micro_batch=64), lora=lora)  # fmt: skip


def engine_model(model_dir: str, lora: LoraTrainConfig = LORA, kernel: KernelConfig = KERNEL):
    """What the engine serves: the base in the kernel dtype, adapters added, each sync loaded and merged."""
    model = load_model(model_dir, kernel)
    add_lora(model, lora.adapters())
    return model


def sync(backend: FSDP2Backend, model) -> int:
    tensors = backend.weights.export_weights()
    load_state(model, tensors)
    fold_adapters(model)
    return sum(t.numel() * t.element_size() for t in tensors.values())


def samples_of(model, seed: int) -> tuple[list[Sample], list[list[float]]]:
    generator = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(0, 256, (4 + i,), generator=generator).tolist() for i in range(4)]
    samples = rollout(model, prompts, num_new=5, temperature=1.0)
    advantages = [[1.0 if i % 2 else -1.0] * len(s.response_tokens) for i, s in enumerate(samples)]
    return samples, advantages


@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_only_adapters_train_and_the_merged_engine_matches_bitwise(model_dirs, kind: str) -> None:
    backend = trainer(model_dirs[kind])
    engine = engine_model(model_dirs[kind])
    base = {n: p.detach().clone() for n, p in backend.model.named_parameters() if not p.requires_grad}
    adapters = {n: p for n, p in backend.model.named_parameters() if p.requires_grad}
    assert adapters and all(n.endswith((".lora_A", ".lora_B")) for n in adapters)
    assert {id(p) for p in backend.policy_params} == {id(p) for p in adapters.values()}
    sync_bytes = sync(backend, engine)
    assert sync_bytes == sum(p.numel() * 4 for p in adapters.values())  # adapters only, float32
    assert backend.weights.checksum() == weights_checksum(checkpoint_tensors(engine, mtp_copies=False).items())
    for step in range(3):
        samples, advantages = samples_of(engine, seed=step)
        trained = backend.compute_logprobs(samples)
        assert trained == [s.rollout_logprobs for s in samples], f"step {step}: mismatch"
        metrics = backend.train_step(samples, advantages, measure_mismatch=True)
        assert metrics["train_rollout_logprob_abs_diff_max"] == 0.0
        sync(backend, engine)
    for name, param in backend.model.named_parameters():
        if name in base:
            assert torch.equal(param, base[name]), f"frozen {name} moved"
    assert any(not torch.equal(p, torch.zeros_like(p)) for n, p in adapters.items() if n.endswith("lora_B"))
    state_params = {id(p) for p in backend.optimizer.state}
    assert state_params == {id(p) for p in adapters.values()}


def test_checkpoint_holds_adapters_only_and_resumes_bitwise(model_dirs, tmp_path) -> None:
    backend = trainer(model_dirs["dense"])
    engine = engine_model(model_dirs["dense"])
    sync(backend, engine)
    samples, advantages = samples_of(engine, seed=7)
    backend.train_step(samples, advantages)
    save_checkpoint(backend, tmp_path / "ckpt")
    stored = FileSystemReader(str(tmp_path / "ckpt")).read_metadata().state_dict_metadata
    adapters = {n for n, p in backend.model.named_parameters() if p.requires_grad}
    assert {k.removeprefix("model.") for k in stored if k.startswith("model.")} == adapters  # no frozen base
    assert {k.split(".")[2] for k in stored if k.startswith("optim.state.")} <= {"model"}
    stored_elements = sum(v.size.numel() for v in stored.values() if hasattr(v, "size"))
    adapter_elements = sum(p.numel() for p in backend.policy_params)
    assert stored_elements == 3 * adapter_elements + len(adapters)  # adapters, AdamW's moments, its step counters
    state = json.loads((tmp_path / "ckpt" / "trainer_state.json").read_text())
    assert state["lora"] == LORA.adapters().model_dump()
    backend.train_step(samples, advantages)
    expected = {n: p.detach().clone() for n, p in backend.model.named_parameters()}
    resumed = trainer(model_dirs["dense"])
    load_checkpoint(resumed, tmp_path / "ckpt")
    resumed.train_step(samples, advantages)
    for name, param in resumed.model.named_parameters():
        assert torch.equal(param, expected[name]), name
    with pytest.raises(ValueError, match="LoRA settings the run started with"):
        load_checkpoint(trainer(model_dirs["dense"], LoraTrainConfig(rank=8, alpha=8)), tmp_path / "ckpt")


def test_peft_loads_the_export_and_reproduces_the_served_logprobs(model_dirs, tmp_path) -> None:
    """The exported adapter through `peft` on the transformers model gives the engine-merged model's log-probs within
    1e-4; the merged export is the engine's merged weights bit for bit."""
    import peft  # the test group's `peft` (noxfile.py): required, never skipped
    from transformers import AutoModelForCausalLM

    lora = LoraTrainConfig(rank=4, alpha=8, use_rslora=True, target_modules=["q_proj", "v_proj", "down_proj"],
                           export_merged=True)  # fmt: skip
    backend = trainer(model_dirs["dense"], lora)
    engine = engine_model(model_dirs["dense"], lora)
    sync(backend, engine)
    for seed in range(2):
        samples, advantages = samples_of(engine, seed=seed)
        backend.train_step(samples, advantages)
    sync(backend, engine)
    out = export_hf(backend, tmp_path / "final")
    assert out is not None
    config = json.loads((out / "adapter_config.json").read_text())
    assert config["r"] == 4 and config["use_rslora"] and config["target_modules"] == ["down_proj", "q_proj", "v_proj"]
    base = AutoModelForCausalLM.from_pretrained(model_dirs["dense"], dtype=torch.float32)
    served = peft.PeftModel.from_pretrained(base, str(out)).eval()
    ids = torch.tensor([[3, 17, 42, 99, 7, 250, 31, 64, 5]])
    with torch.no_grad():
        expected = torch.log_softmax(served(ids).logits[0].float(), -1)
        batch = build_packed_batch([ids.shape[1]], KERNEL.page_size, KERNEL.attention_query_tile, ids.device)
        ours = torch.log_softmax(engine.logits(engine.forward_hidden(ids[0], batch)), -1)
    assert (expected - ours).abs().max().item() < 1e-4
    merged = load_model(out / "merged", KERNEL)
    for name, layer in engine.named_modules():
        if getattr(layer, "folded", None) is not None:
            assert torch.equal(dict(merged.named_parameters())[f"{name}.weight"], layer.folded), name


def test_bf16_base_with_float32_adapters_stays_on_policy(model_dirs) -> None:
    kernel = KERNEL.model_copy(update={"dtype": "bfloat16"})
    lora = LoraTrainConfig(rank=4, alpha=8, base_dtype="bfloat16")
    with pytest.raises(ValueError, match=r"needs kernel\.dtype=bfloat16"):
        trainer(model_dirs["moe"], lora)
    backend = trainer(model_dirs["moe"], lora, kernel)
    dtypes = {p.dtype for n, p in backend.model.named_parameters() if not p.requires_grad}
    assert dtypes == {torch.bfloat16}
    assert {p.dtype for p in backend.policy_params} == {torch.float32}
    engine = engine_model(model_dirs["moe"], lora, kernel)
    sync(backend, engine)
    for step in range(2):
        samples, advantages = samples_of(engine, seed=10 + step)
        assert backend.compute_logprobs(samples) == [s.rollout_logprobs for s in samples], f"step {step}"
        backend.train_step(samples, advantages)
        sync(backend, engine)
    # after the last step too; and the model's last forward is then one without autograd (an in-process FSDP2 module
    # outlives its backend, and an MoE layer keeps its last routing: test_memory.py checks no graph is left over)
    samples, _ = samples_of(engine, seed=12)
    assert backend.compute_logprobs(samples) == [s.rollout_logprobs for s in samples]


def test_the_kl_reference_of_a_lora_run_is_its_base_without_a_copy(model_dirs) -> None:
    backend = trainer(model_dirs["dense"], loss=PolicyLossConfig(kl_coef=0.1))
    assert backend.reference is None and backend.has_reference
    engine = engine_model(model_dirs["dense"])
    base = engine_model(model_dirs["dense"])  # the adapters' B stays zero: the base model's log-probs
    sync(backend, engine)
    for step in range(2):
        samples, advantages = samples_of(engine, seed=20 + step)
        metrics = backend.train_step(samples, advantages)
        assert metrics["kl"] >= 0.0
        sync(backend, engine)
    samples, _ = samples_of(base, seed=30)
    assert backend.compute_logprobs(samples, reference=True) == [s.rollout_logprobs for s in samples]
    assert backend.compute_logprobs(samples) != [s.rollout_logprobs for s in samples]  # the adapters did move
