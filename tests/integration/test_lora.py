"""Integration tier (a real local Ray cluster, real processes): LoRA RL end to end, `examples/lora.yaml` shortened.

The run is true on-policy with adapters (the train/rollout mismatch exactly 0 at every step), each weight sync sends
the adapters only (their bytes, against the full policy's), its checkpoints hold the adapters and their optimizer
state only, a run SIGKILLed after a checkpoint resumes with exactly the uninterrupted run's steps, and final/ is a
PEFT adapter plus the merged model.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from orchestrator_runs import DETERMINISTIC_KEYS, INTERRUPTED, cli, history, kill_after_checkpoint, policy_dir
from safetensors.torch import load_file

EXAMPLE = Path(__file__).parents[2] / "examples" / "lora.yaml"


@pytest.mark.timeout(1200)
def test_the_lora_example_is_on_policy_syncs_adapters_and_resumes(cold_run, tmp_path) -> None:
    _, cache = cold_run
    common = ["--config", str(EXAMPLE), f"model.path={policy_dir(cache)}", *INTERRUPTED]
    straight = tmp_path / "straight"
    result = cli(*common, f"run.run_dir={straight}", cache=cache)
    assert result.returncode == 0, result.stderr[-5000:]
    rows = [r for r in history(straight) if r["step"] > 0]
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5, 6]
    assert all(r["train_rollout_logprob_abs_diff_max"] == 0.0 for r in rows)
    policy = load_file(policy_dir(cache) / "model.safetensors")
    full_bytes = sum(t.numel() * 4 for t in policy.values())
    adapter = load_file(straight / "final" / "adapter_model.safetensors")
    adapter_bytes = sum(t.numel() * t.element_size() for t in adapter.values())
    assert all(r["sync_bytes"] == adapter_bytes for r in rows), (rows[0]["sync_bytes"], adapter_bytes)
    assert adapter_bytes < full_bytes / 2
    config = json.loads((straight / "final" / "adapter_config.json").read_text())
    assert config["peft_type"] == "LORA" and config["r"] == 16
    assert (straight / "final" / "merged" / "model.safetensors").is_file()
    state = json.loads((straight / "checkpoints" / "step_000006" / "trainer_state.json").read_text())
    assert state["lora"]["rank"] == 16

    # killed after its first checkpoint, resumed: the straight run's steps and adapter, bit for bit (http buckets)
    killed = tmp_path / "killed"
    kill_after_checkpoint(*common, "run.sync_transport=http", run_dir=killed, cache=cache, step=2)
    result = cli("--resume", str(killed), cache=cache)
    assert result.returncode == 0, result.stderr[-5000:]
    got = history(killed)
    assert [r["step"] for r in got if r["step"] > 0] == [1, 2, 3, 4, 5, 6], "a step was lost or repeated"
    for want, have in zip(history(straight), got, strict=True):
        for key in DETERMINISTIC_KEYS:
            assert have.get(key) == want.get(key), (want["step"], key)
    resumed = load_file(killed / "final" / "adapter_model.safetensors")
    assert all(torch.equal(resumed[name], value) for name, value in adapter.items())
