"""Pure logic tier (no torch): the throughput meter's tokens per second, TFLOP/s per device and MFU for a rollout and
a training phase, against sums of per-token FLOPs and the hardware profile's peak."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest

from miles_memory import load_hardware, load_model_profile, model_flops
from miles_memory.model_shape import model_profiles
from miles_orchestrator.throughput import ThroughputMeter


@pytest.fixture
def model_dir(tmp_path: Path) -> Path:
    """A local Hugging Face directory holding Qwen3-8B's config.json (no weights: the meter reads the config only)."""
    (tmp_path / "config.json").write_text(json.dumps(model_profiles()["Qwen3-8B"]["config"]))
    return tmp_path


def causal(flops_of_token: Callable[[int], int], n: int) -> int:
    """Forward FLOPs of a causal sequence of n tokens, token t attending t keys."""
    return sum(flops_of_token(t) for t in range(1, n + 1))


def test_rollout(model_dir: Path) -> None:
    meter = ThroughputMeter.from_model_dir(model_dir, "h100", num_devices=8, num_rollout_devices=4)
    per_token = meter.flops.per_token
    # prompt 100 + 20 generated: 119 tokens through the model; prompt 50 with nothing generated: its prefill
    expected = causal(per_token, 119) + causal(per_token, 50)
    metrics = meter.rollout([100, 50], [20, 0], seconds=2.0)
    assert metrics["rollout_tokens_per_s"] == 10.0
    assert metrics["rollout_tflops_per_s"] == pytest.approx(expected / 2.0 / 4 / 1e12)
    assert metrics["rollout_mfu"] == pytest.approx(expected / 2.0 / (4 * 989.4e12))


def test_train(model_dir: Path) -> None:
    meter = ThroughputMeter.from_model_dir(model_dir, "b200", num_devices=8)
    forward = causal(meter.flops.per_token, 120) + causal(meter.flops.per_token, 50)
    metrics = meter.train([120, 50], seconds=4.0, num_passes=2, num_forwards=1)  # 2 passes, recomputed log-probs
    assert metrics["train_tokens_per_s"] == 2 * 170 / 4.0
    assert metrics["train_tflops_per_s"] == pytest.approx((2 * 3 + 1) * forward / 4.0 / 8 / 1e12)
    assert metrics["train_mfu"] == pytest.approx(metrics["train_tflops_per_s"] * 1e12 / 2.25e15)


def test_no_peak_no_mfu(model_dir: Path) -> None:
    for hardware in (None, "cpu"):
        meter = ThroughputMeter.from_model_dir(model_dir, hardware, num_devices=1)
        assert set(meter.train([10], seconds=1.0)) == {"train_tokens_per_s", "train_tflops_per_s"}
        assert set(meter.rollout([10], [5], seconds=1.0)) == {"rollout_tokens_per_s", "rollout_tflops_per_s"}
    assert meter.train([10], seconds=0.0) == {} and meter.rollout([10], [5], seconds=0.0) == {}


def test_model_and_hardware(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> None:
    meter = ThroughputMeter.from_model_dir(model_dir, "gb300", num_devices=4)
    assert meter.flops == model_flops(load_model_profile("Qwen3-8B"))
    assert meter.hardware == load_hardware("gb300") and meter.num_rollout_devices == 4
    with pytest.raises(ValueError, match="no config"):
        ThroughputMeter.from_model_dir(tmp_path_factory.mktemp("empty"), "h100", num_devices=1)
    with pytest.raises(ValueError, match="unknown hardware"):
        ThroughputMeter.from_model_dir(model_dir, "a100", num_devices=1)
