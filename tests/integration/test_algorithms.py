"""Integration tier (the CLI in a subprocess, the local cluster): the policy-loss, optimizer and reward-shaping
options a `miles-orchestrator run` takes end to end. CISPO, stepped by Muon, trains true on-policy (mismatch exactly
0); DAPO's soft overlong punishment lowers the rewards while the pass rate stays the task's; over-sampling rounds are
counted. On-policy distillation from a served teacher: its reverse KL is the advantage, the student stays exactly
on-policy."""

from __future__ import annotations

import pytest
from orchestrator_runs import SMALL, cli, history, policy_dir


@pytest.mark.timeout(600)
def test_cispo_with_dapos_overlong_punishment_and_muon_runs_on_policy(cold_run, tmp_path) -> None:
    _, cache = cold_run
    run_dir = tmp_path / "cispo"
    options = ["run.num_steps=2", "run.eval_every=0", "run.cluster=local", "trainer.loss.surrogate=cispo",
               "trainer.loss.clip_low=1", "rollout.max_new_tokens=6", "reward.overlong_buffer=4",
               "filter.overlong=true", "trainer.optimizer.name=muon"]  # fmt: skip
    result = cli(f"model.path={policy_dir(cache)}", *SMALL, *options, f"run.run_dir={run_dir}", cache=cache)
    assert result.returncode == 0, result.stderr[-5000:]
    rows = [r for r in history(run_dir) if r["step"] > 0]
    assert [r["step"] for r in rows] == [1, 2]
    assert all(r["train_rollout_logprob_abs_diff_max"] == 0.0 for r in rows)
    assert all(r["overlong_penalty_mean"] < 0 for r in rows)  # answers of 3+ tokens lose reward inside the buffer
    assert all("num_oversample_rounds" in r and "num_overlong_filtered" in r for r in rows)


@pytest.mark.timeout(600)
def test_on_policy_distillation_from_a_served_teacher(cold_run, tmp_path) -> None:
    """`miles-orchestrator run` with opd.teacher_url: a `miles-rollout serve` of another model on the policy's
    tokenizer (the bootstrap's random base) scores each step's samples; pure distillation (the task reward off), the
    teacher's own pass@1 logged at step 0, the student true on-policy."""
    from miles_rollout.launch import launch_server

    _, cache = cold_run
    policy = policy_dir(cache)
    run_dir = tmp_path / "opd"
    with launch_server(policy.parent / "base", log_path=tmp_path / "teacher.log") as url:
        options = ["run.num_steps=2", "run.eval_every=2", "data.num_eval_prompts=16", "run.cluster=local",
                   f"opd.teacher_url={url}", "opd.task_reward=false", "opd.kl_coef=0.5"]  # fmt: skip
        result = cli(f"model.path={policy}", *SMALL, *options, f"run.run_dir={run_dir}", cache=cache)
    assert result.returncode == 0, result.stderr[-5000:]
    rows = history(run_dir)
    assert rows[0]["step"] == 0 and rows[0]["teacher_eval_pass@1"] == 0.0 and "eval_pass@1" in rows[0]
    trained = [r for r in rows if r["step"] > 0]
    assert [r["step"] for r in trained] == [1, 2]
    assert all(r["train_rollout_logprob_abs_diff_max"] == 0.0 for r in trained)
    assert all(r["opd_reverse_kl"] > 1.0 and r["num_teacher_failed_groups"] == 0.0 for r in trained)  # a random teacher
