"""Multi-process tier (gloo): an FSDP2 step with 2 processes equals a 1-process step on the same global batch.

Tolerance: the two runs reduce gradients in different orders (a sum across ranks vs one process accumulating
micro-batches), so parameters after one AdamW step agree to float32 rounding, not bitwise: |Δ| ≤ 1e-6 with
lr = 1e-3 (the step itself moves parameters by ~1e-3), and the reported loss and gradient norm agree to 1e-5.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from miles_kernels import KernelConfig, load_model, random_model, save_model, tiny_config

WORKER = Path(__file__).with_name("fsdp_worker.py")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def run_ranks(
    model_dir: Path, out_dir: Path, world: int, mode: str = "step"
) -> tuple[dict[str, torch.Tensor], dict[str, float]]:
    out_dir.mkdir()
    port = str(free_port())
    processes = []
    for rank in range(world):
        env = {**os.environ, "RANK": str(rank), "WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1",
               "MASTER_PORT": port, "OMP_NUM_THREADS": "1"}  # fmt: skip
        processes.append(subprocess.Popen([sys.executable, str(WORKER), str(model_dir), str(out_dir), mode], env=env,
                                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))  # fmt: skip
    for process in processes:
        output, _ = process.communicate(timeout=180)
        assert process.returncode == 0, output
    return load_file(out_dir / "params.safetensors"), json.loads((out_dir / "metrics.json").read_text())


@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_two_processes_match_one(tmp_path, kind: str) -> None:
    model_dir = tmp_path / "model"
    save_model(random_model(tiny_config(kind), seed=4), model_dir)
    one, metrics_one = run_ranks(model_dir, tmp_path / "one", world=1)
    two, metrics_two = run_ranks(model_dir, tmp_path / "two", world=2)
    initial = load_model(model_dir, KernelConfig()).state_dict()
    assert one.keys() == two.keys()
    moved = max(float((one[name] - initial[name]).abs().max()) for name in one)
    assert moved > 1e-4, "the optimizer step did not move the parameters: the comparison would be vacuous"
    for name in one:
        torch.testing.assert_close(two[name], one[name], rtol=0, atol=1e-6, msg=name)
    assert metrics_two["loss"] == pytest.approx(metrics_one["loss"], abs=1e-5)
    assert metrics_two["grad_norm"] == pytest.approx(metrics_one["grad_norm"], rel=1e-5)


def test_checkpoint_resume_is_bit_exact_and_export_loads(tmp_path) -> None:
    """step 1 → checkpoint → step 2, vs a fresh run that loads the checkpoint then runs step 2: same bits.
    The exported Hugging Face directory loads in `transformers` and gives the trained model's logits."""
    from transformers import AutoModelForCausalLM

    model_dir = tmp_path / "model"
    save_model(random_model(tiny_config("dense"), seed=6), model_dir)
    straight, metrics_straight = run_ranks(model_dir, tmp_path / "straight", world=2, mode="two-steps")
    resumed, metrics_resumed = run_ranks(model_dir, tmp_path / "resumed", world=2, mode="resume")
    assert (tmp_path / "checkpoint" / "trainer_state.json").is_file()
    assert not (tmp_path / "checkpoint.tmp").exists()
    for name in straight:
        assert torch.equal(resumed[name], straight[name]), name
    assert metrics_resumed == metrics_straight
    exported = load_model(tmp_path / "resumed" / "hf", KernelConfig())
    for name, tensor in exported.state_dict().items():
        if name in resumed:
            assert torch.equal(tensor, resumed[name]), name
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "resumed" / "hf", dtype=torch.float32).eval()
    ids = torch.arange(1, 12)[None]
    with torch.no_grad():
        from miles_kernels import packed_logits

        torch.testing.assert_close(hf(ids).logits[0], packed_logits(exported, [ids[0]])[0], rtol=0, atol=1e-4)
