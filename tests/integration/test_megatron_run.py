"""The Megatron trainer in `miles-orchestrator run` on a real Ray cluster of CPU ranks (docs/megatron.md, "On a
CPU"): a GLM-4.5-style MoE policy (the built-in one's shape, random weights, one MTP module) on 4 ranks, 2 pipeline
stages x 2-way expert parallelism, the MTP draft trained online, the rollout's routing replayed, true on-policy
(`kernel.mode=deterministic`: the Miles layers, docs/true-on-policy.md).

- every step's train / rollout mismatch is exactly 0, and the trainer's router never chooses other experts than the
  engine's;

- a 3-step run SIGKILLed after its first checkpoint and resumed with `--resume` repeats the uninterrupted run's
  steps and final weights bit for bit (megatron-core's `dist_checkpointing` of the model, the MTP module and both
  AdamWs; the data position and the RNG streams of the run directory);
- its first step equals the FSDP2 backend's first step on the same rollout (one rank, the local cluster) within
  float32 rounding: loss, gradient norm, MTP loss (the two backends' step code and forward arithmetic are the same;
  megatron-core's schedule, pipeline sends, expert dispatch and gradient reductions are what differs).
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from orchestrator_runs import DETERMINISTIC_KEYS, SMALL, cli, history, kill_after_checkpoint, policy_dir
from safetensors.torch import load_file

pytest.importorskip("megatron.core", reason="the megatron extra (uv sync --extra megatron)")

RUN = [*SMALL, "trainer.routing_replay=rollout", "spec.mode=online", "reward.name=shaped_rewards:digit_share",
       "run.num_steps=3", "run.eval_every=0"]  # fmt: skip
MEGATRON = ["trainer.backend.name=megatron", "trainer.num_ranks=4", "trainer.backend.megatron.pp=2",
            "trainer.backend.megatron.ep=2", "run.checkpoint_every=1"]  # fmt: skip
STEP_KEYS = (*DETERMINISTIC_KEYS, "mtp_loss", "mtp_accuracy_0", "moe_routing_flip_frac", "moe_load_imbalance")


@pytest.fixture(scope="module")
def glm_policy(cold_run, tmp_path_factory) -> Path:
    """The built-in GLM-4.5-style policy's shape with random weights, and the cold run's tokenizer."""
    from transformers import AutoTokenizer

    from miles_kernels import save_model
    from miles_kernels.testing import random_model
    from miles_orchestrator.data.bootstrap import policy_config

    _, cache = cold_run
    tokenizer_dir = policy_dir(cache)
    out = tmp_path_factory.mktemp("glm") / "policy"
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    save_model(random_model(policy_config(len(tokenizer), "glm4_moe"), seed=11), out, tokenizer=tokenizer)
    for extra in tokenizer_dir.glob("*.jinja"):
        shutil.copy(extra, out / extra.name)
    return out


@pytest.mark.timeout(1500)
def test_a_megatron_moe_run_resumes_after_sigkill_and_its_first_step_is_fsdp2s(cold_run, glm_policy, tmp_path) -> None:
    _, cache = cold_run
    common = [f"model.path={glm_policy}", *RUN]
    straight = tmp_path / "straight"
    result = cli(*common, *MEGATRON, f"run.run_dir={straight}", cache=cache, timeout=1200)
    assert result.returncode == 0, result.stderr[-5000:]
    rows = history(straight)
    assert [r["step"] for r in rows] == [1, 2, 3]
    for row in rows:  # true on-policy every step; the MTP draft reports its loss
        assert row["train_rollout_logprob_abs_diff"] == 0.0 and row["train_rollout_logprob_abs_diff_max"] == 0.0
        assert row["moe_routing_flip_frac"] == 0.0 and row["mtp_loss"] > 0.0 and row["skipped_update"] == 0.0

    killed = tmp_path / "killed"
    kill_after_checkpoint(*common, *MEGATRON, run_dir=killed, cache=cache, step=1, timeout=900)
    result = cli("--resume", str(killed), cache=cache, timeout=1200)
    assert result.returncode == 0, result.stderr[-5000:]
    got = history(killed)
    assert [r["step"] for r in got] == [1, 2, 3], "a step was lost or repeated"
    for want, have in zip(rows, got, strict=True):
        for key in STEP_KEYS:
            assert have.get(key) == want.get(key), (want["step"], key)
    for path in (straight / "final").glob("*.safetensors"):
        resumed = load_file(killed / "final" / path.name)
        for key, value in load_file(path).items():
            assert torch.equal(resumed[key], value), f"{path.name}: {key}"

    fsdp = tmp_path / "fsdp2"
    result = cli(*common, "run.cluster=local", "run.num_steps=1", f"run.run_dir={fsdp}", cache=cache)
    assert result.returncode == 0, result.stderr[-5000:]
    (first,) = history(fsdp)
    assert first["reward_mean"] == rows[0]["reward_mean"]  # the same rollout: the engine and its weights are one
    for key in ("loss", "pg_loss", "grad_norm", "mtp_loss", "entropy"):
        assert rows[0][key] == pytest.approx(first[key], rel=1e-5), key
