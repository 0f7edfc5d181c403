"""CPU tier (one process, no Ray): `run_training` end to end on the local cluster with a tiny random policy -- the
loop's mechanics in seconds: every step trains with a train/rollout mismatch of exactly 0, evaluates, exports, and
a run stopped after a checkpoint resumes with exactly the steps (metrics and weights) of an uninterrupted run.
Whether the reward rises (which needs a bootstrapped policy) is checked on both clusters by the integration tier.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from miles_kernels.testing import build_tokenizer, save_random_model, save_transformers_model, tiny_config
from miles_orchestrator.config import load_config
from miles_orchestrator.loop import run_training
from miles_orchestrator.run_dir import RunDir

SMALL = [
    "run.cluster=local", "rollout.num_prompts_per_step=4", "rollout.n_samples_per_prompt=4",
    "trainer.global_batch_size=16", "rollout.max_new_tokens=6", "filter.dynamic_sampling=false",
    "data.num_eval_prompts=8", "reward.num_workers=1", "rollout.engine.num_kv_pages=128", "run.num_threads=1",
]  # fmt: skip
VARYING_SUFFIXES = ("time", "_time_s", "_per_s", "_mfu")  # wall-clock measurements: the rest is deterministic
# Memory measurements depend on what the process did before, not only on the step: a checkpoint save creates the
# AdamW state of an optimizer that has not stepped yet, so a run stopped after a save holds it a step earlier.
MEMORY_PREFIX = "mem_"


def run(policy: Path, run_dir: Path, *overrides: str) -> list[dict]:
    cfg = load_config(None, [*SMALL, f"model.path={policy}", f"run.run_dir={run_dir}", *overrides])
    return run_training(cfg, str(policy), RunDir(run_dir, quiet=True))


def deterministic(rows: list[dict]) -> list[dict]:
    return [
        {k: v for k, v in row.items() if not k.endswith(VARYING_SUFFIXES) and not k.startswith(MEMORY_PREFIX)}
        for row in rows
    ]


@pytest.mark.timeout(300)
def test_the_loop_runs_on_the_local_cluster_and_resumes_exactly(policy, tmp_path) -> None:
    straight = run(policy, tmp_path / "straight", "run.num_steps=4", "run.eval_every=2")
    assert [r["step"] for r in straight] == [0, 1, 2, 3, 4]
    trained = [r for r in straight if r["step"] > 0]
    assert all(r["train_rollout_logprob_abs_diff"] == 0.0 == r["train_rollout_logprob_abs_diff_max"] for r in trained)
    assert all(r["num_tokens"] > 0 and r["weight_version"] == r["step"] for r in trained)
    assert {"eval_pass@1"} <= set(straight[0]) and "eval_pass@1" in straight[2] and "eval_pass@1" in straight[4]
    assert (tmp_path / "straight" / "final" / "config.json").is_file()

    stopped = tmp_path / "stopped"
    first = run(policy, stopped, "run.num_steps=2", "run.eval_every=2")  # its last step saves a checkpoint
    assert [r["step"] for r in first] == [0, 1, 2]
    resumed = run(policy, stopped, "run.num_steps=4", "run.eval_every=2")
    assert [r["step"] for r in resumed] == [0, 1, 2, 3, 4], "a step was lost or repeated"
    assert deterministic(resumed) == deterministic(straight)
    for file in (tmp_path / "straight" / "final").glob("*.safetensors"):
        want, have = load_file(file), load_file(stopped / "final" / file.name)
        assert all(torch.equal(have[k], v) for k, v in want.items()), file.name
    log = (stopped / "run.log").read_text()
    assert "resuming from" in log and "synced via an in-process copy and verified" in log
    assert json.loads((stopped / "metrics.jsonl").read_text().splitlines()[-1])["step"] == 4


PPO = [
    "trainer.advantage_estimator=gae", "trainer.critic.warmup_steps=1", "trainer.critic.optimizer.lr=1e-3",
    "trainer.loss.kl_coef=0.05", "rollout.eval_k=2", "run.eval_every=3", "reward.name=orchestrator_plugins:behaves",
]  # fmt: skip


@pytest.mark.timeout(300)
def test_ppo_with_a_critic_and_a_kl_reference_runs_end_to_end_and_resumes_exactly(
    policy, tmp_path, monkeypatch
) -> None:
    """`trainer.advantage_estimator=gae`: GAE on the critic's values, the critic warms up alone for one step, the
    KL term against the frozen reference is live once the policy moves, pass@k is evaluated, and a run stopped
    after a checkpoint (critic included) resumes with exactly the uninterrupted run's steps. The reward is the
    response length (the random policy never solves the task), so the returns vary."""
    monkeypatch.syspath_prepend(str(Path(__file__).parent))
    straight = run(policy, tmp_path / "straight", *PPO, "run.num_steps=3")
    trained = [r for r in straight if r["step"] > 0]
    assert [r["skipped_update"] for r in trained] == [1.0, 0.0, 0.0]  # the critic's warm-up step
    for row in trained:
        assert row["vf_loss"] > 0 and 0 <= row["vf_clip_fraction"] <= 1 and row["critic_lr"] > 0
        assert {"critic_explained_variance", "critic_value_mean", "critic_return_mean"} <= set(row)
    assert trained[0]["critic_value_mean"] == 0.0 != trained[1]["critic_value_mean"]  # the value head starts at 0
    assert trained[1]["kl"] == 0.0 < trained[2]["kl"]  # the reference is the initial policy; step 2 moved it
    assert trained[2]["kl_loss"] > 0
    assert "eval_pass@2" in straight[0] and "eval_pass@2" in straight[-1]

    stopped = tmp_path / "stopped"
    run(policy, stopped, *PPO, "run.num_steps=2")
    resumed = run(policy, stopped, *PPO, "run.num_steps=3")
    assert deterministic(resumed) == deterministic(straight)


@pytest.fixture(scope="module")
def mtp_policy(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("mtp_policy")
    tokenizer = build_tokenizer(vocab_size=300)
    config = tiny_config("dense", vocab_size=len(tokenizer), num_nextn_predict_layers=1)
    save_random_model(path, config, seed=3, tokenizer=tokenizer)
    return path


@pytest.mark.timeout(300)
def test_the_mtp_draft_trains_online_and_resumes_exactly(mtp_policy, policy, tmp_path) -> None:
    """spec.mode=online: the engine drafts with the policy's MTP module and every step trains it on the rollout
    batch (a random policy's responses leave it little to learn: its loss stays near log V); the rollouts and the
    policy's own metrics are those of spec.mode=off and frozen (speculative decoding changes no token, the MTP
    loss no policy gradient), and a stopped run resumes with exactly the same steps (the draft's AdamW state
    included)."""
    online = ("spec.mode=online", "spec.optimizer.lr=1e-2", "run.eval_every=0")
    straight = run(mtp_policy, tmp_path / "straight", *online, "run.num_steps=3")
    trained = [r for r in straight if r["step"] > 0]
    assert all(r["mtp_loss"] > 0 and 0 <= r["mtp_accuracy_0"] <= 1 and r["aux_grad_norm"] > 0 for r in trained)
    assert all(r["spec_accept_length"] >= 1 and "spec_accept_rate_pos1" in r for r in trained)
    off = [r for r in run(mtp_policy, tmp_path / "off", "run.eval_every=0", "run.num_steps=3") if r["step"] > 0]
    frozen = run(mtp_policy, tmp_path / "frozen", "spec.mode=frozen", "run.eval_every=0", "run.num_steps=3")
    drafted_steps = [r for r in frozen if r["step"] > 0]
    for with_mtp, without, drafted in zip(trained, off, drafted_steps, strict=True):  # isolation, end to end
        assert with_mtp["grad_norm"] == without["grad_norm"] == drafted["grad_norm"]
        assert with_mtp["reward_mean"] == without["reward_mean"] == drafted["reward_mean"]
        assert "mtp_loss" not in drafted and "spec_accept_length" in drafted and "spec_accept_length" not in without
    stopped = tmp_path / "stopped"
    run(mtp_policy, stopped, *online, "run.num_steps=2")
    assert deterministic(run(mtp_policy, stopped, *online, "run.num_steps=3")) == deterministic(straight)
    with pytest.raises(ValueError, match="has none"):
        run(policy, tmp_path / "no_mtp", "spec.mode=online", "run.num_steps=1")


@pytest.mark.timeout(300)
def test_a_glm45_saved_by_transformers_trains_its_trunk_and_a_fresh_draft_online(tmp_path) -> None:
    """A GLM-4.5 checkpoint written by transformers declares its MTP layer in config.json and holds none of it:
    spec.mode=off trains the trunk, without a draft; online gives it a fresh MTP module, which drafts in the engine
    and trains on the rollouts from step 1."""
    tokenizer = build_tokenizer(vocab_size=300)
    config = tiny_config("glm", vocab_size=len(tokenizer), num_nextn_predict_layers=1)
    source = save_transformers_model(tmp_path / "hf", config, seed=3, tokenizer=tokenizer)
    (trunk,) = [r for r in run(source, tmp_path / "off", "run.eval_every=0", "run.num_steps=1") if r["step"] == 1]
    assert trunk["train_rollout_logprob_abs_diff"] == 0.0 and trunk["num_tokens"] > 0
    assert "mtp_loss" not in trunk and "spec_accept_length" not in trunk
    assert json.loads((tmp_path / "off" / "final" / "config.json").read_text())["num_nextn_predict_layers"] == 0
    rows = run(source, tmp_path / "online", "spec.mode=online", "run.eval_every=0", "run.num_steps=1")
    (step,) = [r for r in rows if r["step"] == 1]
    assert step["mtp_loss"] > 0 and step["aux_grad_norm"] > 0 and step["spec_accept_length"] >= 1
    assert (tmp_path / "online" / "model_with_draft" / "model-mtp.safetensors").is_file()
    final = json.loads((tmp_path / "online" / "final" / "config.json").read_text())
    assert final["num_nextn_predict_layers"] == 1  # the exported policy carries the draft it trained


@pytest.mark.timeout(400)
def test_an_eagle3_draft_trains_online_and_resumes_exactly(policy, tmp_path) -> None:
    """spec.draft=eagle3 spec.mode=online: a fresh EAGLE-3 draft (RUN_DIR/eagle3_draft) drafts in the engine and
    trains on every rollout batch on the policy's own features (the forward the step runs anyway), synced with the
    policy's weights; the policy's own metrics are those of spec.mode=off (no token changes, no policy gradient
    moves), the run exports the trained draft beside the policy (final/eagle3), which then drafts frozen, and a
    stopped run resumes with exactly the same steps (the draft's weights and AdamW state in the checkpoint)."""
    online = ("spec.mode=online", "spec.draft=eagle3", "spec.optimizer.lr=1e-2", "run.eval_every=0")
    straight = run(policy, tmp_path / "straight", *online, "run.num_steps=3")
    trained = [r for r in straight if r["step"] > 0]
    assert all(r["eagle3_loss"] > 0 and 0 <= r["eagle3_accuracy_0"] <= 1 and r["aux_grad_norm"] > 0 for r in trained)
    assert all(r["spec_accept_length"] >= 1 and r["train_rollout_logprob_abs_diff"] == 0.0 for r in trained)
    assert (tmp_path / "straight" / "eagle3_draft" / "config.json").is_file()
    off = [r for r in run(policy, tmp_path / "off", "run.eval_every=0", "run.num_steps=3") if r["step"] > 0]
    for drafted, without in zip(trained, off, strict=True):
        assert drafted["grad_norm"] == without["grad_norm"] and drafted["reward_mean"] == without["reward_mean"]
    exported = tmp_path / "straight" / "final" / "eagle3"
    fresh = load_file(tmp_path / "straight" / "eagle3_draft" / "model.safetensors")
    final = load_file(exported / "model.safetensors")
    assert final.keys() == fresh.keys() and not torch.equal(final["fc.weight"], fresh["fc.weight"])
    assert not any(name.startswith("eagle3.") for name in load_file(tmp_path / "straight" / "final" /
                                                                     "model.safetensors"))  # fmt: skip
    frozen = run(policy, tmp_path / "frozen", "spec.mode=frozen", "spec.draft=eagle3", f"spec.draft_path={exported}",
                 "run.eval_every=0", "run.num_steps=1")  # fmt: skip
    (step,) = [r for r in frozen if r["step"] == 1]
    assert "eagle3_loss" not in step and step["spec_accept_length"] >= 1 and step["grad_norm"] == off[0]["grad_norm"]
    stopped = tmp_path / "stopped"
    run(policy, stopped, *online, "run.num_steps=2")
    assert deterministic(run(policy, stopped, *online, "run.num_steps=3")) == deterministic(straight)
