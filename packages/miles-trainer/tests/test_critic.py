"""PPO's critic in the FSDP2 backend: the value model learns the returns, warm-up moves the critic alone, a value
head trains jointly with the policy (one in-process rank; test_fsdp.py runs the critic on real gloo ranks)."""

from __future__ import annotations

import pytest
import torch

from miles_contracts import Sample
from miles_kernels import KernelConfig, save_model
from miles_kernels.testing import random_model, tiny_config
from miles_trainer import (
    BackendConfig,
    CriticConfig,
    FSDP2Backend,
    OptimizerConfig,
    PolicyLossConfig,
    ensure_process_group,
    gae_advantages,
)

KERNEL = KernelConfig(page_size=8, attention_query_tile=4, linear_tile=4, moe_tile=4)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("critic") / "model"
    save_model(random_model(tiny_config("dense"), seed=21), path)
    ensure_process_group()
    return str(path)


def batch(num: int = 6) -> list[Sample]:
    generator = torch.Generator().manual_seed(3)
    samples = []
    for i in range(num):
        tokens = torch.randint(0, 256, (5 + i + 4 + i % 3,), generator=generator).tolist()
        samples.append(Sample(
            index=i, group_index=i // 2, prompt="", prompt_tokens=tokens[: 5 + i], response_tokens=tokens[5 + i :],
            reward=float(i % 2), rollout_logprobs=(-torch.rand(4 + i % 3, generator=generator) - 3).tolist(),
        ))  # fmt: skip
    return samples


def gae(samples: list[Sample], values: list[list[float]]) -> tuple[list[list[float]], list[list[float]]]:
    """GAE from outcome rewards on the last token (gamma = lam = 1)."""
    width = max(len(s.response_tokens) for s in samples)
    rewards, values_NT, mask = (torch.zeros(len(samples), width) for _ in range(3))
    for i, s in enumerate(samples):
        n = len(s.response_tokens)
        rewards[i, n - 1], mask[i, :n] = float(s.reward or 0.0), 1.0
        values_NT[i, :n] = torch.tensor(values[i])
    adv, ret = gae_advantages(rewards, values_NT, mask, gamma=1.0, lam=1.0, whiten=False)
    n = [len(s.response_tokens) for s in samples]
    return [adv[i, : n[i]].tolist() for i in range(len(samples))], [ret[i, : n[i]].tolist() for i in range(len(n))]


def backend(model_dir: str, kind: str, warmup: int = 0) -> FSDP2Backend:
    critic = CriticConfig(kind=kind, optimizer=OptimizerConfig(lr=3e-3), warmup_steps=warmup)
    return FSDP2Backend(model_dir, KERNEL, OptimizerConfig(lr=1e-3), PolicyLossConfig(),
                        BackendConfig(max_tokens_per_micro_batch=40), critic=critic)  # fmt: skip


@pytest.mark.parametrize("kind", ["separate", "value_head"])
def test_the_critic_learns_the_returns(model_dir: str, kind: str) -> None:
    """Values start at 0 (zero head); the clipped value loss falls and the values approach the returns."""
    trainer = backend(model_dir, kind)
    samples = batch()
    values = trainer.compute_values(samples)
    assert all(v == 0.0 for row in values for v in row)
    losses = []
    for _ in range(8):
        values = trainer.compute_values(samples)
        advantages, returns = gae(samples, values)
        metrics = trainer.train_step(samples, advantages, returns=returns, old_values=values)
        losses.append(metrics["vf_loss"])
        assert 0.0 <= metrics["vf_clip_fraction"] <= 1.0 and metrics["critic_lr"] == pytest.approx(3e-3)
    assert losses[-1] < 0.5 * losses[0], losses
    if kind == "value_head":
        assert trainer.critic_model is None and trainer.value_head is not None
    with pytest.raises(ValueError, match="returns and old_values"):
        trainer.train_step(samples, advantages)


def test_warmup_moves_the_critic_alone(model_dir: str) -> None:
    trainer = backend(model_dir, "separate", warmup=1)
    samples = batch()
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    values = trainer.compute_values(samples)
    advantages, returns = gae(samples, values)
    metrics = trainer.train_step(samples, advantages, returns=returns, old_values=values)
    assert metrics["skipped_update"] == 1.0 and "pg_loss" not in metrics and metrics["vf_loss"] > 0
    assert all(torch.equal(p, before[n]) for n, p in trainer.model.named_parameters())
    assert trainer.compute_values(samples) != values
    metrics = trainer.train_step(samples, advantages, returns=returns, old_values=values)  # warm-up over
    assert metrics["skipped_update"] == 0.0 and "pg_loss" in metrics
    assert not all(torch.equal(p, before[n]) for n, p in trainer.model.named_parameters())


def test_a_critic_needs_the_checkpoint_it_saved(model_dir: str, tmp_path) -> None:
    from miles_trainer import load_checkpoint, save_checkpoint

    plain = FSDP2Backend(model_dir, KERNEL, config=BackendConfig(max_tokens_per_micro_batch=40))
    save_checkpoint(plain, tmp_path / "ckpt")
    with pytest.raises(ValueError, match="holds no critic"):
        load_checkpoint(backend(model_dir, "separate"), tmp_path / "ckpt")


def test_offload_frees_the_critic_and_brings_it_back_bitwise(model_dir: str, tmp_path) -> None:
    trainer = FSDP2Backend(model_dir, KERNEL, config=BackendConfig(max_tokens_per_micro_batch=40),
                           critic=CriticConfig(), offload_dir=tmp_path)  # fmt: skip
    samples = batch()
    values = trainer.compute_values(samples)
    advantages, returns = gae(samples, values)
    trainer.train_step(samples, advantages, returns=returns, old_values=values)  # the critic's AdamW has state
    assert trainer.critic_model is not None
    before = {n: p.detach().clone() for n, p in trainer.critic_model.named_parameters()}
    moments = [s["exp_avg"].clone() for s in trainer.critic_optimizer.state.values()]
    trainer.offload()
    assert all(p.untyped_storage().nbytes() == 0 for p in trainer.critic_model.parameters())
    assert all(s["exp_avg"].untyped_storage().nbytes() == 0 for s in trainer.critic_optimizer.state.values())
    trainer.onload()
    assert all(torch.equal(p, before[n]) for n, p in trainer.critic_model.named_parameters())
    assert all(
        torch.equal(s["exp_avg"], m) for s, m in zip(trainer.critic_optimizer.state.values(), moments, strict=True)
    )
