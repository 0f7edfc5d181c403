"""Integration tier (the CLI in a subprocess, the local cluster): the policy-loss, optimizer and reward-shaping
options a `miles-orchestrator run` takes end to end. CISPO, stepped by Muon, trains true on-policy (mismatch exactly
0); DAPO's soft overlong punishment lowers the rewards while the pass rate stays the task's; over-sampling rounds are
counted. On-policy distillation from a served teacher: its reverse KL is the advantage, the student stays exactly
on-policy; from an embedded teacher's top-k: their forward KL is a loss term. A reward model and a generative judge
score every sample of a run. The host-memory AdamW (moments, weights and gradients in host memory, bfloat16 moments)
trains true on-policy and checkpoints its moments as such."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from orchestrator_runs import SMALL, cli, history, policy_dir


@pytest.mark.timeout(600)
def test_cispo_with_dapos_overlong_punishment_and_muon_runs_on_policy(cold_run, tmp_path) -> None:
    _, cache = cold_run
    run_dir = tmp_path / "cispo"
    options = ["run.num_steps=2", "run.eval_every=0", "run.cluster=local", "trainer.loss.surrogate=cispo",
               "trainer.loss.clip_low=1", "rollout.max_new_tokens=6", "reward.overlong_buffer=4",
               "filter.overlong=true", "trainer.optimizer.algorithm=muon"]  # fmt: skip
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
    assert all(r["num_teacher_failed_groups"] == 0.0 for r in trained)
    assert all(r["opd_reverse_kl"] > 1.0 for r in trained)  # a random teacher


class _Judge(BaseHTTPRequestHandler):
    """An OpenAI-compatible judge that grades 10 when the response holds the reference answer, else 0."""

    def do_GET(self) -> None:
        self._answer({"data": [{"id": "judge"}]})

    def do_POST(self) -> None:
        text = json.loads(self.rfile.read(int(self.headers["Content-Length"])))["messages"][0]["content"]
        label, response = text.split("Reference answer: ")[1].split("\n")[0], text.split("Response: ")[1]
        score = 10 if label and label in response.split("\n\n")[0] else 0
        self._answer({"choices": [{"message": {"role": "assistant", "content": f"Score: {score}"}}]})

    def _answer(self, payload: dict) -> None:
        data = json.dumps(payload).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args: object) -> None:
        pass


@pytest.mark.timeout(600)
def test_model_based_rewards_train_a_run(cold_run, tmp_path) -> None:
    """reward.name=reward_model (a random sequence-classification model on the policy's tokenizer, in the driver)
    and reward.name=judge (a served judge over HTTP): two steps each, every sample scored, true on-policy."""
    import torch
    from transformers import AutoConfig, AutoModelForSequenceClassification, AutoTokenizer

    _, cache = cold_run
    policy = policy_dir(cache)
    hf = json.loads((policy / "config.json").read_text())
    hf |= {"architectures": ["Qwen3ForSequenceClassification"], "num_labels": 1, "num_nextn_predict_layers": 0}
    torch.manual_seed(0)
    rm_dir = tmp_path / "rm"
    AutoModelForSequenceClassification.from_config(AutoConfig.for_model(**hf), dtype=torch.float32).save_pretrained(
        rm_dir
    )
    AutoTokenizer.from_pretrained(policy).save_pretrained(rm_dir)
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Judge)
    threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True).start()
    judge_url = f"http://127.0.0.1:{server.server_address[1]}"
    rewards = {"rm": ["reward.name=reward_model", f"reward.model_path={rm_dir}"],
               "judge": ["reward.name=judge", f"reward.judge_url={judge_url}"]}  # fmt: skip
    try:
        for name, options in rewards.items():
            run_dir = tmp_path / name
            common = ["run.num_steps=2", "run.eval_every=0", "run.cluster=local", *options]
            result = cli(f"model.path={policy}", *SMALL, *common, f"run.run_dir={run_dir}", cache=cache)
            assert result.returncode == 0, result.stderr[-5000:]
            rows = [r for r in history(run_dir) if r["step"] > 0]
            assert [r["step"] for r in rows] == [1, 2], name
            assert all(r["num_reward_failures"] == 0.0 for r in rows)
            assert all(r["train_rollout_logprob_abs_diff_max"] == 0.0 for r in rows)
            if name == "judge":  # the judge's verdicts are the task's: its reward mean is the pass rate
                assert all(r["reward_mean"] == r["pass_rate"] for r in rows)
            else:  # a random reward model's scores: real numbers, not the task's 0 / 1
                assert all(abs(r["reward_mean"]) > 0.0 and r["reward_mean"] != r["pass_rate"] for r in rows)
    finally:
        server.shutdown()
        server.server_close()


@pytest.mark.timeout(600)
def test_on_policy_distillation_from_the_teachers_top_k(cold_run, tmp_path) -> None:
    """`miles-orchestrator run` with an embedded teacher (the bootstrap's random base, on the policy's tokenizer) and
    opd.top_k: pure distillation on the teacher's top-4 forward KL (a loss term; the advantages are 0), logged every
    step, the student true on-policy."""
    _, cache = cold_run
    policy = policy_dir(cache)
    run_dir = tmp_path / "opd_topk"
    options = ["run.num_steps=2", "run.eval_every=0", "run.cluster=local", "opd.task_reward=false",
               f"opd.teacher.path={policy.parent / 'base'}", "filter.dynamic_sampling=false", "opd.top_k=4",
               "opd.kl_coef=0.5"]  # fmt: skip
    result = cli(f"model.path={policy}", *SMALL, *options, f"run.run_dir={run_dir}", cache=cache)
    assert result.returncode == 0, result.stderr[-5000:]
    rows = [r for r in history(run_dir) if r["step"] > 0]
    assert [r["step"] for r in rows] == [1, 2]
    assert all(r["train_rollout_logprob_abs_diff_max"] == 0.0 for r in rows)
    assert all(r["opd_topk_kl"] > 0 and r["opd_topk_loss"] == pytest.approx(0.5 * r["opd_topk_kl"], rel=1e-4)
               for r in rows)  # fmt: skip
    assert all(r["pg_loss"] == 0.0 for r in rows)  # pure distillation: no advantage
    assert all(r["skipped_update"] == 0.0 for r in rows)  # the loss term alone moves the student


@pytest.mark.timeout(600)
def test_host_memory_adamw_with_bfloat16_moments_runs_on_policy(cold_run, tmp_path) -> None:
    """`miles-orchestrator run` with trainer.optimizer.offload=moments_and_master and bfloat16 moments: the policy's
    AdamW state, weights and gradients in host memory (miles_trainer.host_adam, FSDP2's CPU offload), every step true
    on-policy, and the checkpoint holds the moments in bfloat16."""
    import torch
    from torch.distributed.checkpoint import FileSystemReader

    _, cache = cold_run
    run_dir = tmp_path / "host_adam"
    options = ["run.num_steps=2", "run.eval_every=0", "run.cluster=local", "run.checkpoint_every=2",
               "trainer.optimizer.offload=moments_and_master", "trainer.optimizer.moments_dtype=bfloat16"]  # fmt: skip
    result = cli(f"model.path={policy_dir(cache)}", *SMALL, *options, f"run.run_dir={run_dir}", cache=cache)
    assert result.returncode == 0, result.stderr[-5000:]
    rows = [r for r in history(run_dir) if r["step"] > 0]
    assert [r["step"] for r in rows] == [1, 2]
    assert all(r["train_rollout_logprob_abs_diff_max"] == 0.0 for r in rows)
    metadata = FileSystemReader(str(run_dir / "checkpoints" / "step_000002")).read_metadata().state_dict_metadata
    moments = {key: m.properties.dtype for key, m in metadata.items() if key.startswith("optim.state.")
               and key.endswith(("exp_avg", "exp_avg_sq"))}  # fmt: skip
    assert moments and set(moments.values()) == {torch.bfloat16}, moments
