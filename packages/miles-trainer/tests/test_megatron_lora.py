"""Multi-process (gloo rank processes on the CPU, megatron_lora_worker.py): LoRA on the Megatron backend (tp = 1).
Only the per-HF-projection adapters train (gradients, AdamW state, sync, checkpoint), the frozen base stays as loaded;
in deterministic mode (the Miles layers) the trainer's log-probs equal bit for bit those of a miles-kernels model given
the synced adapters and `fold_adapters` (the engine), over three steps, dense (pp = 2) and MoE (ep = 2; float32, and
bfloat16 with float32 masters), and its KL reference is the base with no copy; with either layer spec two steps'
adapters equal the FSDP2 LoRA steps' within float32 rounding; a checkpoint holds the adapters only and resumes bit for
bit; the HF export is a PEFT adapter and merged/; tp > 1 is refused by name."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from miles_kernels import load_model, merge_lora, read_peft_adapter, save_model
from miles_kernels.testing import random_model, tiny_config

pytest.importorskip("megatron.core", reason="the megatron extra (uv sync --extra megatron)")

WORKER = Path(__file__).with_name("megatron_lora_worker.py")
OPTIMIZER = {"lr": 1.0, "eps": 1.0, "max_grad_norm": 1e9}  # the FSDP2 comparison's: steps proportional to gradients


def run(tmp_path: Path, kind: str, world: int, layout: dict, mode: str, kernel_mode: str = "deterministic",
        out: str = "out", optimizer: str = "{}", dtype: str = "float32") -> Path:  # fmt: skip
    from test_fsdp import run_ranks

    if not (tmp_path / "model").exists():
        save_model(random_model(tiny_config(kind), seed=5), tmp_path / "model")
    outputs: list = []
    run_ranks(tmp_path / "model", tmp_path / out, world=world, mode=mode, worker=WORKER, outputs=outputs,
              extra_env={"MILES_TEST_MEGATRON": json.dumps(layout), "MILES_TEST_MODE": kernel_mode,
                         "MILES_TEST_OPTIMIZER": optimizer, "MILES_TEST_DTYPE": dtype})  # fmt: skip
    assert [code for code, _ in outputs] == [0] * world, "\n".join(text[-3000:] for _, text in outputs)
    return tmp_path / out


@pytest.mark.parametrize(
    ("kind", "layout", "dtype"),
    [("dense", {"pp": 2}, "float32"), ("moe", {"ep": 2}, "float32"), ("moe", {"ep": 2}, "bfloat16")],
    ids=["dense-pp2", "moe-ep2", "moe-ep2-bf16"],
)
def test_only_adapters_train_and_the_engine_merge_matches_bitwise(
    tmp_path: Path, kind: str, layout: dict, dtype: str
) -> None:
    result = json.loads((run(tmp_path, kind, 2, layout, "on-policy", dtype=dtype) / "results.json").read_text())
    assert result["equal"] == [True, True, True], "trainer log-probs differ from the engine-merged model's"
    assert result["mismatch"] == [0.0, 0.0, 0.0]
    assert result["trained"] and all(".lora.lora_A." in n or ".lora.lora_B." in n for n in result["trained"])
    assert result["base_moved"] == [] and result["adapters_moved"] and result["optimizer_is_adapters"]
    assert result["checksum_matches"]  # the checksum covers the base and the adapters
    assert result["reference_is_base"] and not result["reference_chunks"]  # the KL reference: adapters off, no copy
    names = result["sync_names"]
    assert names and all(n.endswith((".lora_A", ".lora_B")) for n in names)  # the sync sends the adapters only
    assert "model.layers.0.self_attn.q_proj.lora_A" in names  # per HF projection, not per fused Megatron linear
    if kind == "moe":
        config = tiny_config("moe")
        assert {f"model.layers.0.mlp.experts.{e}.up_proj.lora_B" for e in range(config.num_experts)} <= set(names)


@pytest.mark.parametrize(("layer_spec", "mode"), [("megatron", "fast"), ("miles", "deterministic")])
def test_steps_equal_the_fsdp2_lora_steps(tmp_path: Path, layer_spec: str, mode: str) -> None:
    """Two steps on two data-parallel ranks (megatron-core's own layers in fast mode, the Miles layers in
    deterministic mode) against FSDP2's on the whole batch, the same adapters to start with (seeded by HF name).
    AdamW with eps = 1 takes steps proportional to the gradients, so the comparison sees the gradients' float32
    rounding (the data-parallel sum's order), not AdamW's first-step division of near-zero entries by themselves,
    which turns that rounding into visible differences of A's second step."""
    from fsdp_worker import batch
    from megatron_lora_worker import KERNEL, LORA

    from miles_trainer import BackendConfig, FSDP2Backend, OptimizerConfig, PolicyLossConfig, ensure_process_group

    out = run(tmp_path, "dense", 2, {"layer_spec": layer_spec}, "step", kernel_mode=mode,
              optimizer=json.dumps(OPTIMIZER))  # fmt: skip
    megatron = load_file(str(out / "adapters.safetensors"))
    ensure_process_group()
    kernel = KERNEL.model_copy(update={"mode": mode})
    fsdp = FSDP2Backend(str(tmp_path / "model"), kernel, OptimizerConfig(**OPTIMIZER),
                        PolicyLossConfig(agg_mode="seq-mean-token-mean"), BackendConfig(max_tokens_per_micro_batch=64),
                        lora=LORA)  # fmt: skip
    before = {n: p.detach().clone() for n, p in fsdp.model.named_parameters() if p.requires_grad}
    samples, advantages = batch()
    fsdp.train_step(samples, advantages)
    fsdp.train_step(samples, [-a for a in advantages])
    expected = {n: p.detach() for n, p in fsdp.model.named_parameters() if p.requires_grad}
    assert set(megatron) == set(expected)
    for name, tensor in expected.items():
        assert (tensor - before[name]).abs().max() > 1e-4, f"{name} did not move (far beyond the tolerance below)"
        torch.testing.assert_close(
            megatron[name], tensor, rtol=1e-5, atol=1e-6, msg=lambda m, name=name: f"{name}: {m}"
        )


def test_checkpoint_holds_adapters_only_resumes_bitwise_and_exports_peft(tmp_path: Path) -> None:
    from megatron_lora_worker import KERNEL
    from torch.distributed.checkpoint import FileSystemReader

    two = run(tmp_path, "moe", 2, {"ep": 2}, "two-steps")
    stored = FileSystemReader(str(tmp_path / "checkpoint")).read_metadata().state_dict_metadata
    assert stored and all(k.startswith(("lora.", "optimizer.")) for k in stored), sorted(stored)[:5]
    state = json.loads((tmp_path / "checkpoint" / "trainer_state.json").read_text())
    assert state["lora"]["rank"] == 4
    resumed = run(tmp_path, "moe", 2, {"ep": 2}, "resume", out="resumed")
    expected, got = load_file(str(two / "adapters.safetensors")), load_file(str(resumed / "adapters.safetensors"))
    assert set(expected) == set(got)
    for name, tensor in expected.items():
        assert torch.equal(got[name], tensor), name
    # export_hf: the PEFT adapter (the trained adapters under PEFT's names) and merged/ (each adapted weight the
    # engine's merge of the base and its adapter)
    config, exported = read_peft_adapter(two / "final")
    assert config.rank == 4 and set(exported) == set(expected)
    assert all(torch.equal(exported[name], tensor) for name, tensor in expected.items())
    base, merged = load_model(tmp_path / "model", KERNEL), load_model(two / "final" / "merged", KERNEL)
    layer = "model.layers.1.mlp.experts.3.down_proj"
    want = merge_lora(dict(base.named_parameters())[f"{layer}.weight"], expected[f"{layer}.lora_A"],
                      expected[f"{layer}.lora_B"], config.scaling, KERNEL)  # fmt: skip
    assert torch.equal(dict(merged.named_parameters())[f"{layer}.weight"], want)


def test_tensor_parallel_lora_is_refused_by_name() -> None:
    from miles_trainer import LoraTrainConfig
    from miles_trainer.config import MegatronConfig
    from miles_trainer.megatron_lora import check_megatron_lora

    lora, model = LoraTrainConfig(rank=4), tiny_config("dense")
    check_megatron_lora(lora, MegatronConfig(pp=2), model)
    with pytest.raises(ValueError, match=r"trainer\.backend\.megatron\.tp=2 .*splitting the way the weights are"):
        check_megatron_lora(lora, MegatronConfig(tp=2), model)
    with pytest.raises(ValueError, match=r"trainer\.backend\.megatron\.etp=2"):
        check_megatron_lora(lora, MegatronConfig(ep=2, etp=2), tiny_config("moe"))
