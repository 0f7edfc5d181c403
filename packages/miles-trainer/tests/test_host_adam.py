"""AdamW with its state in host memory (miles_trainer.host_adam; `OptimizerConfig.offload`).

- CPU numerics: `HostAdamW` with float32 moments steps bit for bit as `torch.optim.AdamW(fused=True)`, whatever the
  chunk size, through the staging slots (a device's path, its copies plain on a CPU) or in place, through state-dict
  round trips with torch's AdamW in both directions; bfloat16 moments against the AdamW formula written out with the
  moments rounded to bfloat16 after every step.
- FSDP2 in real gloo rank processes: `offload=moments` and `moments_and_master` (FSDP2's CPU offload of the shards)
  train bit for bit as the on-device AdamW, resume from their checkpoints exactly, and a checkpoint of the on-device
  AdamW resumes with the offload on; bfloat16 moments stay within bfloat16's rounding of the float32 run.
- GPU: the staged path's streams and pinned slots against the fused kernel on the CPU, and the device holds none of
  the state.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from pydantic import ValidationError

from miles_kernels import save_model
from miles_kernels.testing import random_model, tiny_config
from miles_trainer.config import OptimizerConfig
from miles_trainer.host_adam import HostAdamW


def state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """The bytes of the optimizer's moments, read off its state tensors."""
    return sum(v.numel() * v.element_size() for s in optimizer.state.values() for k, v in s.items() if k != "step")


SHAPES = [(300, 257), (5000,), (7,), (1,)]  # a matrix over several chunks, vectors, a scalar-like tensor
HYPER = {"lr": 1e-3, "betas": (0.9, 0.99), "eps": 1e-8, "weight_decay": 0.1}


def params(seed: int, device: str = "cpu") -> list[torch.nn.Parameter]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(*s, generator=generator).to(device)) for s in SHAPES]


def set_grads(groups: list[list[torch.nn.Parameter]], generator: torch.Generator) -> None:
    for tensors in zip(*groups, strict=True):
        grad = torch.randn(tensors[0].shape, generator=generator)
        for p in tensors:
            p.grad = grad.to(p.device)


@pytest.mark.parametrize("staging", [False, True])
@pytest.mark.parametrize("chunk_bytes", [4096 * 4, 100_000, 1 << 25])
def test_float32_moments_step_bit_for_bit_as_torchs_fused_adamw(staging: bool, chunk_bytes: int) -> None:
    ours, theirs = params(0), params(0)
    make = lambda: HostAdamW(ours, chunk_bytes=chunk_bytes, staging=staging, **HYPER)  # noqa: E731
    optimizer = make()
    reference = torch.optim.AdamW(theirs, fused=True, **HYPER)
    generator = torch.Generator().manual_seed(1)
    for step in range(5):
        set_grads([ours, theirs], generator)
        optimizer.step()
        reference.step()
        if step == 1:  # a checkpoint's round trip
            saved = optimizer.state_dict()
            optimizer = make()
            optimizer.load_state_dict(saved)
        if step == 3:  # the two optimizers' checkpoints load into each other
            mine, torchs = optimizer.state_dict(), reference.state_dict()
            optimizer, reference = make(), torch.optim.AdamW(theirs, fused=True, **HYPER)
            optimizer.load_state_dict(torchs)
            reference.load_state_dict(mine)
        for p, q in zip(ours, theirs, strict=True):
            assert torch.equal(p, q)
    state = optimizer.state[ours[0]]
    assert set(state) == {"step", "exp_avg", "exp_avg_sq"} and float(state["step"]) == 5
    assert state["exp_avg"].dtype == torch.float32 and state_bytes(optimizer) == 8 * sum(p.numel() for p in ours)


def test_bfloat16_moments_follow_the_formula_with_rounded_moments() -> None:
    """Each step against AdamW's formula in float64 from the step's inputs (the weights and the bfloat16 moments
    before it): the weights to float32 rounding, the moments to one bfloat16 rounding."""
    ours, full = params(2), params(2)
    optimizer = HostAdamW(ours, moments_dtype="bfloat16", chunk_bytes=4096 * 4, **HYPER)
    fp32 = torch.optim.AdamW(full, fused=True, **HYPER)
    (beta1, beta2), lr, eps, wd = HYPER["betas"], HYPER["lr"], HYPER["eps"], HYPER["weight_decay"]
    generator = torch.Generator().manual_seed(3)
    for t in range(1, 6):
        set_grads([ours, full], generator)
        before = [p.detach().double() for p in ours]
        moments = [
            (optimizer.state[p]["exp_avg"].double(), optimizer.state[p]["exp_avg_sq"].double()) if t > 1 else (0, 0)
            for p in ours
        ]
        optimizer.step()
        fp32.step()
        for p, p0, (m0, v0) in zip(ours, before, moments, strict=True):  # decoupled decay, bias-corrected moments
            g = p.grad.double()  # type: ignore[union-attr]
            m, v = beta1 * m0 + (1 - beta1) * g, beta2 * v0 + (1 - beta2) * g * g
            expected = p0 * (1 - lr * wd) - lr / (1 - beta1**t) * m / (v.sqrt() / math.sqrt(1 - beta2**t) + eps)
            torch.testing.assert_close(p.double(), expected, rtol=2e-7, atol=1e-9)
            state = optimizer.state[p]
            assert state["exp_avg"].dtype == state["exp_avg_sq"].dtype == torch.bfloat16
            torch.testing.assert_close(state["exp_avg"].double(), m, rtol=2**-8, atol=1e-8)  # cancellation near 0
            torch.testing.assert_close(state["exp_avg_sq"].double(), v, rtol=2**-8, atol=1e-12)
    assert state_bytes(optimizer) == 4 * sum(p.numel() for p in ours)
    assert not all(torch.equal(p, q) for p, q in zip(ours, full, strict=True))  # the rounding does show


def test_config_refusals() -> None:
    with pytest.raises(ValidationError, match="algorithm=muon steps on the device"):
        OptimizerConfig(offload="moments", algorithm="muon")
    with pytest.raises(ValidationError, match="set offload=moments"):
        OptimizerConfig(moments_dtype="bfloat16")
    with pytest.raises(ValueError, match="float32 parameters"):
        HostAdamW([torch.nn.Parameter(torch.zeros(3, dtype=torch.bfloat16))], **HYPER)


def _run(model_dir: Path, root: Path, name: str, mode: str, optimizer: dict[str, object], checkpoint_from: Path
         | None = None) -> tuple[dict[str, torch.Tensor], dict[str, float]]:  # fmt: skip
    from test_fsdp import run_ranks

    base = root / name
    base.mkdir()
    if checkpoint_from is not None:
        (base / "checkpoint").symlink_to(checkpoint_from / "checkpoint")
    env = {"MILES_TEST_OPTIMIZER": json.dumps({"weight_decay": 0.01, **optimizer})}
    trained, metrics = run_ranks(model_dir, base / "out", world=2, mode=mode, extra_env=env)
    described = json.loads((base / "out" / "optimizer.json").read_text())
    expected = {
        "class": "HostAdamW" if optimizer.get("offload") else "AdamW",
        "offload_policy": "CPUOffloadPolicy" if optimizer.get("offload") == "moments_and_master" else "OffloadPolicy",
        "moments_dtype": f"torch.{optimizer.get('moments_dtype', 'float32')}",
    }
    assert described == expected, name
    return trained, metrics


def test_fsdp2_offload_trains_and_resumes_bit_for_bit_as_adamw(tmp_path: Path) -> None:
    model_dir = tmp_path / "model"
    save_model(random_model(tiny_config("dense"), seed=5), model_dir)
    straight, metrics = _run(model_dir, tmp_path, "adamw", "two-steps", {})
    for offload in ("moments", "moments_and_master"):
        trained, trained_metrics = _run(model_dir, tmp_path, offload, "two-steps", {"offload": offload})
        assert trained_metrics == metrics, offload
        resumed, resumed_metrics = _run(model_dir, tmp_path, offload + "-resumed", "resume", {"offload": offload},
                                        checkpoint_from=tmp_path / offload)  # fmt: skip
        assert resumed_metrics == metrics, offload
        for name in straight:
            assert torch.equal(trained[name], straight[name]), (offload, name)
            assert torch.equal(resumed[name], straight[name]), (offload, name)
    # the on-device AdamW's checkpoint, resumed with the moments in host memory
    crossed, _ = _run(model_dir, tmp_path, "crossed", "resume", {"offload": "moments"},
                      checkpoint_from=tmp_path / "adamw")  # fmt: skip
    bf16, _ = _run(model_dir, tmp_path, "bf16", "two-steps", {"offload": "moments", "moments_dtype": "bfloat16"})
    for name in straight:
        assert torch.equal(crossed[name], straight[name]), name
        torch.testing.assert_close(bf16[name], straight[name], rtol=0, atol=1e-5)
    assert any(not torch.equal(bf16[name], straight[name]) for name in straight)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_cuda_parameters_step_through_pinned_slots_as_the_cpu_kernel() -> None:
    ours, theirs = params(4, "cuda"), params(4)
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    optimizer = HostAdamW(ours, chunk_bytes=4096 * 4, **HYPER)
    reference = torch.optim.AdamW(theirs, fused=True, **HYPER)
    generator = torch.Generator().manual_seed(5)
    for _ in range(3):
        set_grads([ours, theirs], generator)
        optimizer.step()
        reference.step()
    for p, q in zip(ours, theirs, strict=True):
        assert torch.equal(p.cpu(), q)
    state = optimizer.state[ours[0]]
    assert state["exp_avg"].device.type == "cpu" and state["exp_avg"].is_pinned()
    grads = sum(p.grad.numel() * 4 for p in ours if p.grad is not None)
    assert torch.cuda.memory_allocated() - before <= grads  # the gradients; no state on the device
