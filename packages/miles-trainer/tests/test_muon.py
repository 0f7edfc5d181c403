"""Muon for the policy's matrices, AdamW for the rest (miles_trainer.muon; `OptimizerConfig.algorithm=muon`).

- The orthogonalization against a plain SVD-based reference: Newton-Schulz maps G = U S V^T to about U S' V^T
  (torch's quintic coefficients: S' spread around 1; the classic cubic iteration, run long: U V^T itself).
- One process: `MuonWithAdamW` steps exactly as `torch.optim.Muon` (the matrices) and `torch.optim.AdamW(fused)` (the
  rest) side by side, bit for bit, through a state-dict round trip.
- FSDP2 in real gloo rank processes: Muon trains the trunk's matrices (the update is not AdamW's), and a run that
  resumes from the checkpoint between two steps (the momentum buffers and AdamW's moments in one `optim` state) is
  bit for bit the uninterrupted one; the same step on one rank and on two agree to float32 rounding.
"""

from __future__ import annotations

import json

import pytest
import torch
from torch.optim._muon import _zeropower_via_newtonschulz

from miles_kernels import KernelConfig, load_model, save_model
from miles_kernels.testing import random_model, tiny_config
from miles_trainer.muon import MUON_NS_COEFFICIENTS, MuonWithAdamW


def svd_polar(matrix: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    u, s, vh = torch.linalg.svd(matrix.double(), full_matrices=False)
    return u, s, vh


@pytest.mark.parametrize("shape", [(48, 32), (32, 80)])
def test_newton_schulz_orthogonalizes_as_the_svd_says(shape: tuple[int, int]) -> None:
    g = torch.randn(*shape, generator=torch.Generator().manual_seed(0))
    u, _, vh = svd_polar(g)
    quintic = _zeropower_via_newtonschulz(g, MUON_NS_COEFFICIENTS, 5, 1e-7).double()
    in_svd_basis = u.T @ quintic @ vh.T  # U^T O V: diagonal when O = U S' V^T
    diagonal = torch.diagonal(in_svd_basis)
    off = in_svd_basis - torch.diag(diagonal)
    assert off.abs().max() < 0.05 and diagonal.min() > 0.5 and diagonal.max() < 1.3
    cubic = _zeropower_via_newtonschulz(g, (1.5, -0.5, 0.0), 60, 1e-7).double()  # converges to U V^T
    torch.testing.assert_close(cubic, u @ vh, atol=3e-2, rtol=0)  # bfloat16 iterations
    assert (cubic - u @ vh).abs().mean() < 5e-3


def test_one_process_steps_as_torchs_muon_and_adamw() -> None:
    generator = torch.Generator().manual_seed(1)
    shapes = [(16, 8), (8, 24), (8,), (30, 8)]  # two matrices for Muon; a norm-like vector and an embedding for AdamW
    ours = [torch.nn.Parameter(torch.randn(*s, generator=generator)) for s in shapes]
    theirs = [torch.nn.Parameter(p.detach().clone()) for p in ours]
    hyper = {"lr": 0.02, "weight_decay": 0.1}
    optimizer = MuonWithAdamW(ours[:2], ours[2:], betas=(0.9, 0.95), eps=1e-8, momentum=0.95, nesterov=True,
                              ns_steps=5, **hyper)  # fmt: skip
    muon = torch.optim.Muon(theirs[:2], momentum=0.95, nesterov=True, adjust_lr_fn="match_rms_adamw", **hyper)
    adamw = torch.optim.AdamW(theirs[2:], betas=(0.9, 0.95), eps=1e-8, fused=True, **hyper)
    for step in range(4):
        grads = [torch.randn(*s, generator=generator) for s in shapes]
        for p, q, g in zip(ours, theirs, grads, strict=True):
            p.grad, q.grad = g.clone(), g.clone()
        optimizer.step()
        muon.step()
        adamw.step()
        if step == 1:  # a checkpoint's round trip in the middle
            saved = optimizer.state_dict()
            optimizer = MuonWithAdamW(ours[:2], ours[2:], betas=(0.9, 0.95), eps=1e-8, momentum=0.95, nesterov=True,
                                      ns_steps=5, **hyper)  # fmt: skip
            optimizer.load_state_dict(saved)
        for p, q in zip(ours, theirs, strict=True):
            assert torch.equal(p, q)
    assert set(optimizer.state[ours[0]]) == {"momentum_buffer"}
    assert set(optimizer.state[ours[2]]) == {"step", "exp_avg", "exp_avg_sq"}
    with pytest.raises(ValueError, match="2-D matrices only"):
        MuonWithAdamW([ours[2]], [], lr=1, weight_decay=0, betas=(0.9, 0.9), eps=1e-8, momentum=0.9, nesterov=True,
                      ns_steps=5)  # fmt: skip


def test_muon_under_fsdp2_trains_the_matrices_and_resumes_bit_exact(tmp_path) -> None:
    from test_fsdp import run_ranks

    model_dir = tmp_path / "model"
    save_model(random_model(tiny_config("dense"), seed=6), model_dir)
    muon = {"MILES_TEST_OPTIMIZER": json.dumps({"algorithm": "muon", "weight_decay": 0.01})}
    straight, metrics = run_ranks(model_dir, tmp_path / "straight", world=2, mode="two-steps", extra_env=muon)
    resumed, metrics_resumed = run_ranks(model_dir, tmp_path / "resumed", world=2, mode="resume", extra_env=muon)
    assert metrics_resumed == metrics
    for name in straight:
        assert torch.equal(resumed[name], straight[name]), name
    one, _ = run_ranks(model_dir, tmp_path / "one", world=1, mode="step", extra_env=muon)
    two, _ = run_ranks(model_dir, tmp_path / "two", world=2, mode="step", extra_env=muon)
    adamw, _ = run_ranks(model_dir, tmp_path / "adamw", world=2, mode="step",  # the same first step, AdamW's
                         extra_env={"MILES_TEST_OPTIMIZER": json.dumps({"weight_decay": 0.01})})  # fmt: skip
    initial = load_model(model_dir, KernelConfig()).state_dict()
    matrix, norm = "model.layers.0.self_attn.q_proj.weight", "model.layers.0.input_layernorm.weight"
    assert not torch.equal(two[matrix], initial[matrix]) and not torch.equal(two[matrix], adamw[matrix])
    assert torch.equal(two[norm], adamw[norm]) and not torch.equal(two[norm], initial[norm])  # AdamW's own step
    for name in one:  # the gradients' sums differ in order over ranks: float32 rounding, amplified by bf16 NS
        torch.testing.assert_close(two[name], one[name], rtol=0, atol=2e-4, msg=name)
