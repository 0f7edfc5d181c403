"""The online MTP draft trained on the Megatron trainer, in real rank processes (gloo, the CPU device mode; the
Megatron backend's own tests, miles-trainer's tests/test_megatron_mtp.py, check its conversion and its modules'
numerics): a GLM-4.5 with an MTP layer on PP 2 x EP 2 x DP 2 (four ranks, untied embeddings: the first stage sends
the embedding to the MTP modules) with miles-spec's `MTPLoss`, against one FSDP2 rank with the same loss: the policy's
loss, gradient norm, MTP loss, accuracy and gradient norm, and every parameter after the step (trunk and MTP) within
the MoE tolerances of test_megatron.py; gradient isolation: the trunk after a step with the MTP loss is bitwise the
trunk after a step without it; a checkpoint with the MTP modules' AdamW state resumes bit-exact (the straight run
offloads and onloads between the steps, the resumed one does not). Three rank runs: 1, 4 and 4 processes, of
miles-trainer's test workers (tests/fsdp_worker.py, tests/megatron_worker.py with MILES_TEST_MTP=1).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

from miles_kernels import KernelConfig, save_model
from miles_kernels.testing import random_model, tiny_config

pytest.importorskip("megatron.core", reason="the megatron extra (uv sync --extra megatron)")

TRAINER_TESTS = Path(__file__).resolve().parents[2] / "miles-trainer" / "tests"
sys.path.insert(0, str(TRAINER_TESTS))  # the rank runner (test_fsdp.run_ranks) and the workers it starts
WORKER = TRAINER_TESTS / "megatron_worker.py"


def test_online_mtp_on_megatron_matches_fsdp2_is_isolated_and_resumes(tmp_path) -> None:
    """One GLM-4.5 (2 layers, MoE MTP layer, untied) step with the MTP loss on PP 2 x EP 2 x DP 2 against FSDP2's on
    one rank; the trunk of that step bitwise the trunk of a step without the MTP loss; a second step after a
    checkpoint, and the same second step resumed from it in fresh processes, bit for bit (the MTP modules' AdamW
    state and schedule included); the HF export holds the trained draft."""
    from safetensors.torch import load_file
    from test_fsdp import TIMING, run_ranks

    from miles_kernels import load_model

    config = tiny_config("glm", num_hidden_layers=2, num_nextn_predict_layers=1, tie_word_embeddings=False)
    model_dir = tmp_path / "model"
    save_model(random_model(config, seed=4), model_dir)
    mtp = "model.layers.2."
    env = {"MILES_TEST_MTP": "1"}
    fsdp, fsdp_metrics = run_ranks(model_dir, tmp_path / "fsdp", world=1, extra_env=env)
    env |= {"MILES_TEST_MEGATRON": json.dumps({"pp": 2, "ep": 2, "moe_token_dispatcher": "alltoall"})}
    straight, metrics_straight = run_ranks(model_dir, tmp_path / "two", 4, "two-steps", extra_env=env, worker=WORKER)

    def step(name: str) -> tuple[dict[str, torch.Tensor], dict[str, float]]:  # what the worker wrote of a step
        metrics = json.loads((tmp_path / "two" / f"{name}_metrics.json").read_text())
        params = load_file(tmp_path / "two" / f"{name}.safetensors")
        return params, {key: value for key, value in metrics.items() if key not in TIMING}

    first, metrics = step("step1")
    for key in ("loss", "pg_loss", "entropy", "num_tokens", "grad_norm", "mtp_loss", "mtp_accuracy_0", "aux_grad_norm",
                "aux_lr"):  # fmt: skip
        assert metrics[key] == pytest.approx(fsdp_metrics[key], rel=1e-6, abs=1e-7), key
    assert metrics["mtp_loss"] > 0 and metrics["aux_grad_norm"] > 0
    assert first.keys() == fsdp.keys() and any(name.startswith(mtp) for name in fsdp)
    for name, tensor in fsdp.items():  # the MoE tolerance of test_megatron.py
        torch.testing.assert_close(first[name], tensor, rtol=0, atol=5e-5, msg=name)
    plain, plain_metrics = step("plain")  # gradient isolation: the trunk moved by the same bits without the MTP loss
    assert (plain_metrics["loss"], plain_metrics["grad_norm"]) == (metrics["loss"], metrics["grad_norm"])
    initial = load_file(model_dir / "model.safetensors")
    for name, tensor in plain.items():
        assert torch.equal(first[name], tensor) or name.startswith(mtp), name
        assert torch.equal(tensor, initial[name]) or not name.startswith(mtp), name  # without the loss: as loaded
    assert any(not torch.equal(first[name], plain[name]) for name in plain if name.startswith(mtp))
    resumed, metrics_resumed = run_ranks(model_dir, tmp_path / "resume", 4, "resume", extra_env=env, worker=WORKER)
    assert metrics_resumed == metrics_straight and metrics_straight["checksum_matches"] == 1.0
    for name, tensor in straight.items():
        assert torch.equal(resumed[name], tensor), name
    exported = load_model(tmp_path / "two" / "hf", KernelConfig()).state_dict()
    for name, tensor in straight.items():
        assert torch.equal(exported[name], tensor), name
