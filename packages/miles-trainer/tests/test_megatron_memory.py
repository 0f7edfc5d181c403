"""The Megatron backend's memory under a budget (one in-process rank on the CPU device mode; docs/memory.md), the
FSDP2 backend's contract (test_memory.py) through the same `TrainerMemory` (megatron_memory.py): resident tensors
over the budget are a fatal OOM at start-up naming them by tag; an activation overrun runs the step again with half
the tokens per micro-batch and gives the gradient and the loss of a step that never ran out (and FSDP2's loss on the
same batch); with no room left to halve, the OOM is fatal and reports what held memory by tag; partial offload moves
only what the engine needs room for, largest storage first, and brings it back bit for bit."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from test_memory import KERNEL, MAX_TOKENS, batch
from test_memory import backend as fsdp2_backend

from miles_kernels import save_model
from miles_kernels.testing import random_model, tiny_config
from miles_memory import unique_storages
from miles_memory.config import MemoryConfig
from miles_trainer import BackendConfig, MegatronBackend, OptimizerConfig, PolicyLossConfig, ensure_process_group

pytest.importorskip("megatron.core", reason="the megatron extra (uv sync --extra megatron)")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Iterator[str]:
    path = tmp_path_factory.mktemp("megatron-memory") / "model"
    save_model(random_model(tiny_config("dense"), seed=5), path)
    ensure_process_group()
    yield str(path)
    from megatron.core import parallel_state

    parallel_state.destroy_model_parallel()


def backend(model_dir: str, memory: MemoryConfig | None = None, tmp_path=None) -> MegatronBackend:
    return MegatronBackend(model_dir, KERNEL, OptimizerConfig(lr=1e-3), PolicyLossConfig(),
                           BackendConfig(name="megatron", max_tokens_per_micro_batch=MAX_TOKENS), memory=memory,
                           offload_dir=tmp_path)  # fmt: skip


def main_grads(trainer: MegatronBackend) -> list[torch.Tensor]:
    """The last step's gradients (megatron-core's float32 `main_grad` buffers)."""
    return [p.main_grad.clone() for p in trainer.params]


def test_resident_tensors_over_the_budget_are_a_fatal_oom_at_start(model_dir: str) -> None:
    with pytest.raises(torch.OutOfMemoryError, match=r"resident tensors \(weights .*, optimizer .*, grads"):
        backend(model_dir, MemoryConfig(limit_bytes=1_000_000))


def test_an_activation_overrun_retries_with_half_the_tokens_and_the_same_update(model_dir: str, tmp_path) -> None:
    samples, advantages = batch()
    free = backend(model_dir, tmp_path=tmp_path)
    metrics = free.train_step(samples, advantages)
    expected, peak = main_grads(free), int(metrics["mem_train_activation_peak_bytes"])
    held, loss = int(metrics["mem_train_held_bytes"]), metrics["loss"]
    assert peak > 0 and metrics["oom_retries"] == 0 and held > 0
    assert max(float(g.abs().max()) for g in expected) > 1e-3  # a gradient worth comparing
    fsdp2_loss = fsdp2_backend(model_dir, tmp_path=tmp_path).train_step(samples, advantages)["loss"]
    assert loss == pytest.approx(fsdp2_loss, rel=1e-6)
    # Room for ~70% of the activations at 32 tokens per micro-batch: 16 tokens (about half) fit.
    limited = backend(model_dir, MemoryConfig(limit_bytes=held + int(0.7 * peak), min_tokens_per_micro_batch=8),
                      tmp_path)  # fmt: skip
    metrics = limited.train_step(samples, advantages)
    assert metrics["oom_retries"] == 1 and limited.max_tokens == MAX_TOKENS // 2
    assert metrics["mem_train_activation_peak_bytes"] <= 0.7 * peak
    assert metrics["loss"] == pytest.approx(loss, rel=1e-6)
    for got, want in zip(main_grads(limited), expected, strict=True):  # invariant to the micro-batch split
        torch.testing.assert_close(got, want, rtol=0, atol=1e-7)


def test_no_room_to_halve_is_a_fatal_oom_with_a_report(model_dir: str, tmp_path) -> None:
    samples, advantages = batch()
    held = int(backend(model_dir, tmp_path=tmp_path).train_step(samples, advantages)["mem_train_held_bytes"])
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
    by_tag = trainer.memory.manager.resident_bytes()
    assert by_tag["grads"] > 0 and by_tag["optimizer"] > 0  # megatron-core's buffers and AdamW's moments
    storages = trainer.memory.manager.resident_storages()
    largest = max(s.nbytes() for group in storages.values() for s in group)
    state = [v for s in trainer.optimizer.state.values() for v in s.values() if v.dim()]
    assert largest > max(s.nbytes() for s in unique_storages([*trainer.params, *state]))  # a gradient buffer
    before = [p.detach().clone() for p in trainer.params]
    # one byte short: the largest storage goes (the gradient buffer: dropped, the cheapest to free), nothing else
    assert trainer.offload(room_for=10**9 - sum(by_tag.values()) + 1) == largest
    assert trainer.memory.manager.resident_bytes()["grads"] == by_tag["grads"] - largest
    assert trainer.is_offloaded
    with pytest.raises(RuntimeError, match="call onload"):
        trainer.compute_logprobs(samples)
    trainer.onload()
    assert all(torch.equal(p, b) for p, b in zip(trainer.params, before, strict=True))
    assert trainer.offload() == sum(by_tag.values())  # no room_for: everything, the gradient buffers too
