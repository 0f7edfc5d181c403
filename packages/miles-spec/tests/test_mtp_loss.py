"""The MTP draft's online loss: its shift and mask rule, its value against the formula on each sample alone (a
shared prompt and the micro-batch split change nothing), and gradient isolation in a real FSDP2 step: the policy's
update is bitwise the same with and without MTP training, while the MTP modules learn."""

from __future__ import annotations

import pytest
import torch

from miles_contracts import Sample
from miles_kernels import KernelConfig, build_packed_batch, save_model
from miles_kernels.testing import random_model, tiny_config
from miles_spec.mtp_loss import MTPLoss, mtp_targets
from miles_trainer import BackendConfig, FSDP2Backend, OptimizerConfig, PolicyLossConfig, accumulate_policy_gradients

KERNEL = KernelConfig(page_size=8, attention_query_tile=4, linear_tile=4, moe_tile=4)


def test_targets_shift_by_module_and_skip_the_prompt_and_masked_tokens() -> None:
    sample = Sample(index=0, group_index=0, prompt="", prompt_tokens=[10, 11, 12], response_tokens=[13, 14, 15],
                    loss_mask=[1, 0, 1])  # fmt: skip
    inputs, targets, trains = mtp_targets(sample, 0)  # row p reads T[p+1], predicts T[p+2]
    assert inputs == [11, 12, 13, 14, 15]
    assert targets == [12, 13, 14, 15, 0]
    assert trains == [False, True, False, True, False]  # 12: prompt; 14: loss mask 0; row 4: nothing left
    inputs, targets, trains = mtp_targets(sample, 1)  # module 1: T[p+2] in, T[p+3] out
    assert inputs == [12, 13, 14, 15, 0] and targets == [13, 14, 15, 0, 0]
    assert trains == [True, False, True, False, False]


def make_samples(vocab: int) -> list[Sample]:
    generator = torch.Generator().manual_seed(4)
    prompt = torch.randint(0, vocab, (9,), generator=generator).tolist()
    samples = []
    for i, n in enumerate((6, 4, 7)):  # one group sharing a prompt, then a sample of its own
        own = prompt if i < 2 else torch.randint(0, vocab, (5,), generator=generator).tolist()
        response = torch.randint(0, vocab, (n,), generator=generator).tolist()
        samples.append(Sample(index=i, group_index=0 if i < 2 else 1, prompt="", prompt_tokens=own,
                              response_tokens=response, loss_mask=[1] * (n - 2) + [0, 1],
                              rollout_logprobs=[-1.0] * n, reward=float(i)))  # fmt: skip
    return samples


def expected_loss(model, samples: list[Sample], coef: float) -> float:
    """The formula, each sample alone: its whole sequence through the trunk, then the chained MTP modules."""
    depth = len(model.mtp_layers)
    sums, counts = [0.0] * depth, [0] * depth
    with torch.no_grad():
        for s in samples:
            tokens = torch.tensor(s.prompt_tokens + s.response_tokens)
            batch = build_packed_batch([len(tokens) - 1], KERNEL.page_size, KERNEL.attention_query_tile)
            hidden = model.forward_hidden(tokens[:-1], batch)
            for module in range(depth):
                inputs, targets, trains = mtp_targets(s, module)
                hidden = model.mtp_hidden(hidden, torch.tensor(inputs), batch, module)
                logprobs = torch.log_softmax(model.mtp_logits(hidden), -1)
                for p, (target, train) in enumerate(zip(targets, trains, strict=True)):
                    if train:
                        sums[module] -= float(logprobs[p, target])
                        counts[module] += 1
    return coef / depth * sum(total / count for total, count in zip(sums, counts, strict=True))


@pytest.mark.parametrize("budget", [10_000, 20])  # one micro-batch (the group's prompt shared), or several
def test_the_loss_is_the_formula_whatever_the_packing(budget: int) -> None:
    model = random_model(tiny_config("dense", num_nextn_predict_layers=2), KERNEL, seed=3).train()
    samples = make_samples(model.config.vocab_size)
    loss = MTPLoss(coef=0.3)
    stats = accumulate_policy_gradients(model, samples, [0.0] * 3, KERNEL, PolicyLossConfig(), budget,
                                        aux_losses=[loss]).summary()  # fmt: skip
    assert stats["mtp_loss"] == pytest.approx(expected_loss(model, samples, 0.3), rel=1e-5)
    assert 0.0 <= stats["mtp_accuracy_0"] <= 1.0 and "mtp_accuracy_1" in stats
    trunk = {id(p) for layer in model.trunk_layers for p in layer.parameters()}
    trained = loss.parameters(model)
    assert trained and all(p.grad is not None and p.grad.abs().sum() > 0 for p in trained)
    assert not any(id(p) in trunk for p in trained)
    assert {id(model.model.embed_tokens.weight), id(model.lm_head.weight)}.isdisjoint(id(p) for p in trained)
    # the advantages are 0, so only the MTP loss could move the trunk: its gradients are exactly 0
    for name, param in model.named_parameters():
        if id(param) in trunk or name.startswith(("model.embed_tokens", "lm_head", "model.norm")):
            assert param.grad is None or not param.grad.any(), name


def test_a_model_without_mtp_modules_is_refused() -> None:
    with pytest.raises(ValueError, match="no MTP modules"):
        MTPLoss().parameters(random_model(tiny_config("dense"), KERNEL))


@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_policy_update_is_bitwise_the_same_with_and_without_mtp_training(tmp_path, kind: str) -> None:
    """Gradient isolation in a real FSDP2 step: the policy's weights, grad norm and loss after two steps are the
    same bits with and without the MTP loss; the MTP modules move only when trained, with their own AdamW."""
    from miles_trainer import ensure_process_group

    ensure_process_group()
    model_dir = tmp_path / "model"
    save_model(random_model(tiny_config(kind, num_nextn_predict_layers=1), seed=9), model_dir)
    samples = make_samples(tiny_config(kind).vocab_size)
    advantages = [1.0, -1.0, 0.5]

    def two_steps(aux: list[MTPLoss]) -> tuple[dict[str, torch.Tensor], list[dict[str, float]]]:
        backend = FSDP2Backend(model_dir, KERNEL, OptimizerConfig(lr=1e-2), PolicyLossConfig(),
                               BackendConfig(max_tokens_per_micro_batch=24), aux_losses=aux,
                               aux_optimizer=OptimizerConfig(lr=5e-2))  # fmt: skip
        metrics = [backend.train_step(samples, advantages) for _ in range(2)]
        return {n: p.detach().clone() for n, p in backend.model.named_parameters()}, metrics

    plain, plain_metrics = two_steps([])
    trained, trained_metrics = two_steps([MTPLoss()])
    mtp_prefix = "model.layers.2."  # tiny_config has 2 trunk layers
    for name, tensor in plain.items():
        if name.startswith(mtp_prefix):
            continue
        assert torch.equal(trained[name], tensor), name
    for before, after in zip(plain_metrics, trained_metrics, strict=True):
        assert after["grad_norm"] == before["grad_norm"] and after["loss"] == before["loss"]
        assert after["mtp_loss"] > 0 and after["aux_grad_norm"] > 0
    initial = random_model(tiny_config(kind, num_nextn_predict_layers=1), seed=9).state_dict()
    moved = [n for n in plain if n.startswith(mtp_prefix) and not torch.equal(trained[n], initial[n])]
    assert moved and all(torch.equal(plain[n], initial[n]) for n in plain if n.startswith(mtp_prefix))


def test_two_gloo_ranks_train_the_draft_like_one(tmp_path) -> None:
    """FSDP2 over 2 real ranks (the MTP modules sharded like the trunk's layers): the MTP loss, the policy's loss
    and the trained weights agree with one rank to float32 rounding (AdamW at lr 5e-2 turns the different
    summation order of two ranks into differences of up to ~1e-5 in two steps)."""
    import json
    import os
    import socket
    import subprocess
    import sys
    from pathlib import Path

    from safetensors.torch import load_file

    model_dir = tmp_path / "model"
    save_model(random_model(tiny_config("dense", num_nextn_predict_layers=1), seed=11), model_dir)
    results = {}
    for world in (1, 2):
        out = tmp_path / f"world{world}"
        out.mkdir()
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = str(sock.getsockname()[1])
        worker = Path(__file__).with_name("spec_worker.py")
        processes = [
            subprocess.Popen([sys.executable, str(worker), str(model_dir), str(out)], stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True,
                             env={**os.environ, "RANK": str(r), "WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1",
                                  "MASTER_PORT": port, "OMP_NUM_THREADS": "1"})
            for r in range(world)
        ]  # fmt: skip
        for process in processes:
            output, _ = process.communicate(timeout=240)
            assert process.returncode == 0, output
        results[world] = (json.loads((out / "metrics.json").read_text()), load_file(out / "params.safetensors"))
    (one, one_params), (two, two_params) = results[1], results[2]
    assert two["mtp_loss"] == pytest.approx(one["mtp_loss"], rel=1e-5)
    assert two["loss"] == pytest.approx(one["loss"], rel=1e-5)
    for name, tensor in one_params.items():
        torch.testing.assert_close(two_params[name], tensor, rtol=0, atol=1e-5, msg=name)


def test_sft_trains_the_draft_without_touching_the_policys_update(tmp_path) -> None:
    """The bootstrap's path: `sft_step` with the MTP loss leaves the trunk's weights, loss and grad norm bitwise
    those of a plain SFT step, and moves the MTP module with its own optimizer."""
    from miles_trainer import ensure_process_group

    ensure_process_group()
    model_dir = tmp_path / "model"
    save_model(random_model(tiny_config("dense", num_nextn_predict_layers=1), seed=5), model_dir)
    samples = make_samples(tiny_config("dense").vocab_size)

    def two_steps(aux: list[MTPLoss]) -> tuple[dict[str, torch.Tensor], list[dict[str, float]]]:
        backend = FSDP2Backend(model_dir, KERNEL, OptimizerConfig(lr=1e-2), config=BackendConfig(
            max_tokens_per_micro_batch=24), aux_losses=aux, aux_optimizer=OptimizerConfig(lr=5e-2))  # fmt: skip
        metrics = [backend.sft_step(samples) for _ in range(2)]
        return {n: p.detach().clone() for n, p in backend.model.named_parameters()}, metrics

    plain, plain_metrics = two_steps([])
    trained, trained_metrics = two_steps([MTPLoss()])
    mtp = "model.layers.2."
    assert all(torch.equal(trained[n], t) for n, t in plain.items() if not n.startswith(mtp))
    assert any(not torch.equal(trained[n], t) for n, t in plain.items() if n.startswith(mtp))
    for before, after in zip(plain_metrics, trained_metrics, strict=True):
        assert after["grad_norm"] == before["grad_norm"] and after["loss"] == before["loss"]
        assert after["mtp_loss"] > 0 and after["aux_grad_norm"] > 0
