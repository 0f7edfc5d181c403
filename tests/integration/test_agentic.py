"""Integration tier (real processes: the orchestrator, environment workers, a local Ray cluster): the agentic
example (`examples/agentic_calculator.yaml`) shortened for CI. Its full run's curve (tool use and reward rising) is
measured by `benchmarks/default_run.py` (`benchmarks/results/agentic_example.json`, docs/agentic.md)."""

from __future__ import annotations

from pathlib import Path

import pytest
from orchestrator_runs import cli, history, policy_dir

EXAMPLE = str(Path(__file__).parents[2] / "examples" / "agentic_calculator.yaml")
# A shorter bootstrap than the example's (it still opens half its answers with a tool call) and 16 episodes a step
SHORTENED = [
    "model.bootstrap_steps=50", "model.bootstrap_batch_size=16", "model.bootstrap_tool_use=0.5",
    "rollout.num_prompts_per_step=4", "rollout.n_samples_per_prompt=4", "trainer.global_batch_size=16",
    "filter.dynamic_sampling=false",
]  # fmt: skip


@pytest.fixture(scope="module")
def agentic_run(tmp_path_factory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("agentic")
    cache, run_dir = root / "cache", root / "run"
    result = cli("--config", EXAMPLE, *SHORTENED, "run.cluster=local", "run.num_steps=2", "run.eval_every=2",
                 "data.num_eval_prompts=8", f"run.run_dir={run_dir}", cache=cache)  # fmt: skip
    assert result.returncode == 0, result.stderr[-5000:]
    return run_dir, cache


@pytest.mark.timeout(600)
def test_the_agentic_example_plays_multi_turn_episodes_true_on_policy(agentic_run) -> None:
    """Episodes of two turns happen (a tool call, the calculator's answer, the final answer), the tool calls are
    counted, and the train/rollout mismatch over the model's tokens of every turn is exactly 0."""
    run_dir, _ = agentic_run
    rows = history(run_dir)
    steps = [r for r in rows if r["step"] > 0]
    assert len(steps) == 2
    assert all(r["train_rollout_logprob_abs_diff_max"] == 0.0 for r in steps)
    assert all(r["agent_tool_calls_mean"] > 0 and r["agent_turns_mean"] > 1.0 for r in steps), steps
    assert all("agent_reward_turns_2" in r and "agent_tokens_per_turn" in r for r in steps)
    assert rows[-1]["step"] == 2 and "eval_pass@1" in rows[-1] and "eval_pass@1" in rows[0]


@pytest.mark.timeout(600)
def test_agentic_episodes_in_an_async_run(agentic_run, tmp_path) -> None:
    """The same episodes with rollout overlapped with training on Ray (run.mode=async, engines apart from the
    trainer, the weight sync retracting the turns in flight): every step trains, every token's version is checked,
    and the mismatch over the tokens of the trained version is exactly 0."""
    _, cache = agentic_run
    run_dir = tmp_path / "async"
    result = cli("--config", EXAMPLE, *SHORTENED, f"model.path={policy_dir(cache)}", "run.mode=async",
                 "run.colocate=false", "run.num_steps=3", "run.eval_every=0", f"run.run_dir={run_dir}",
                 cache=cache)  # fmt: skip
    assert result.returncode == 0, result.stderr[-5000:]
    steps = history(run_dir)
    assert [r["weight_version"] for r in steps] == [1, 2, 3]
    assert all(r["num_stale_groups_dropped"] == 0 and r["agent_turns_mean"] > 1.0 for r in steps), steps
    assert all(r.get("train_rollout_logprob_abs_diff_max", 0.0) == 0.0 for r in steps)
