"""Integration tier (a real local Ray cluster, real processes): low-precision rollout end to end,
`examples/fp8_qat.yaml` shortened. With quantization-aware training the FP8 engine's rollout log-probs are the
trainer's bit for bit at every step (mismatch exactly 0) while each weight sync sends FP8 bytes; the same engine
without QAT (here INT4, through HTTP buckets) is an off-policy rollout whose mismatch is measured and corrected by TIS.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from orchestrator_runs import SMALL, cli, history, policy_dir
from safetensors.torch import load_file

EXAMPLE = Path(__file__).parents[2] / "examples" / "fp8_qat.yaml"


@pytest.mark.timeout(1200)
def test_fp8_qat_is_on_policy_and_int4_without_qat_is_corrected(cold_run, tmp_path) -> None:
    _, cache = cold_run
    common = ["--config", str(EXAMPLE), f"model.path={policy_dir(cache)}", *SMALL, "run.eval_every=0"]
    policy = load_file(policy_dir(cache) / "model.safetensors")
    full_bytes = sum(t.numel() * 4 for t in policy.values())  # the float32 policy a kernel-dtype sync sends

    qat = tmp_path / "qat"
    result = cli(*common, "run.num_steps=3", f"run.run_dir={qat}", cache=cache)
    assert result.returncode == 0, result.stderr[-5000:]
    rows = [r for r in history(qat) if r["step"] > 0]
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert all(r["train_rollout_logprob_abs_diff_max"] == 0.0 for r in rows)
    assert all(r["sync_bytes"] < full_bytes * 0.45 for r in rows), (rows[0]["sync_bytes"], full_bytes)

    off = tmp_path / "off_policy"
    overrides = ["rollout.engine.weight_dtype=int4_group", "trainer.qat=false", "trainer.loss.is_mode=truncate",
                 "run.sync_transport=http", "run.num_steps=2"]  # fmt: skip
    result = cli(*common, *overrides, f"run.run_dir={off}", cache=cache)
    assert result.returncode == 0, result.stderr[-5000:]
    rows = [r for r in history(off) if r["step"] > 0]
    assert all(r["train_rollout_logprob_abs_diff_max"] > 0.0 for r in rows)
    assert all(r["sync_bytes"] < full_bytes * 0.35 for r in rows)
    assert all(r["is_weight_raw_max"] > 1.0 for r in rows)  # TIS weights pi_train / pi_rollout away from 1
