"""Integration tier: the scale-out runs of docs/scale-out.md on a real Ray cluster on this machine.

- two engines behind sglang-router, disaggregated from the trainer, training fully async with partial rollouts
  (pause_mode=retract): every step honours run.max_staleness (the metrics show the histogram), syncs pause
  generations in flight and the engines continue them under the new weights (tokens keep their versions), weights
  reach both engines over a gloo broadcast, and the mismatch is exactly 0 wherever the trained version generated
  tokens (pause_mode=abort's continuation is tested against a real engine in miles-orchestrator's test_partial.py);
- the two-node layout: a Ray head offering `trainer_node` and a second `ray start --address` node offering
  `rollout_node`; the engines land on the second node, the trainer on the head, and the run trains true on-policy
  with the weights broadcast across nodes.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from orchestrator_runs import SMALL, cli, history, policy_dir

RAY = str(Path(sys.executable).parent / "ray")


@pytest.mark.timeout(900)
def test_two_engines_behind_the_router_train_async_within_the_staleness_bound(cold_run, tmp_path) -> None:
    _, cache = cold_run
    run_dir = tmp_path / "async"
    result = cli(
        f"model.path={policy_dir(cache)}", *SMALL, "run.num_steps=6", "run.eval_every=0", f"run.run_dir={run_dir}",
        "run.colocate=false", "rollout.num_engines=2", "run.mode=async", "run.max_staleness=4",
        "rollout.pause_mode=retract", "run.sync_transport=distributed",
        # long rollouts (64 tokens past EOS each) and a staleness bound of 4: the producer runs up to 4 batches
        # ahead, so the first weight syncs land on generations in flight even where a training step outlasts a
        # rollout (on 2 shared cores it does; with a bound of 2 the syncs sometimes all found the engines idle)
        "rollout.rollout_fn=long_rollouts:past_eos", "rollout.max_new_tokens=64",
        "rollout.engine.max_running_requests=8",
        cache=cache,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    rows = history(run_dir)
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5, 6]
    assert all(r["staleness_max"] <= 4 and r["num_stale_groups_dropped"] == 0 for r in rows)
    assert all(abs(sum(v for k, v in r.items() if k.startswith("staleness_frac_")) - 1) < 1e-9 for r in rows)
    assert rows[0]["staleness_max"] == 0 and all(r["staleness_mean"] > 0 for r in rows[1:]), "no overlap"
    assert sum(r["num_paused_requests"] for r in rows) > 0, "no weight sync landed on a generation in flight"
    assert sum(r["num_partial_samples"] for r in rows) > 0, "no paused generation was continued"
    assert all(r["train_rollout_logprob_abs_diff_max"] == 0.0 for r in rows if "num_onpolicy_tokens" in r or
               r["staleness_max"] == 0)  # fmt: skip
    log = (run_dir / "run.log").read_text()
    assert "gloo broadcast from trainer rank 0" in log and "to 2 engines" in log and "verified" in log
    assert (run_dir / "router.log").is_file() and (run_dir / "final" / "config.json").is_file()


@pytest.fixture
def two_nodes(tmp_path):
    """A Ray head (the trainer's node) and a second node (the engines'), both on this machine, token auth on."""
    env = {**os.environ, "RAY_AUTH_MODE": "token", "RAY_ENABLE_UV_RUN_RUNTIME_ENV": "0"}
    port = "6391"
    temp = Path(f"/tmp/miles-2n-{os.getpid()}")
    head = [RAY, "start", "--head", "--port", port, "--num-cpus", "2", "--resources", '{"trainer_node": 1}',
            "--include-dashboard=false", "--temp-dir", str(temp)]  # fmt: skip
    worker = [RAY, "start", "--address", f"127.0.0.1:{port}", "--num-cpus", "2", "--resources", '{"rollout_node": 2}']
    try:
        for command in (head, worker):
            started = subprocess.run(command, env=env, capture_output=True, text=True, timeout=180)
            assert started.returncode == 0, started.stdout[-2000:] + started.stderr[-2000:]
        yield f"127.0.0.1:{port}", env
    finally:
        subprocess.run([RAY, "stop", "--force"], env=env, capture_output=True, timeout=120)


@pytest.mark.timeout(900)
def test_the_two_node_layout_puts_engines_and_trainer_on_their_nodes(cold_run, two_nodes, tmp_path) -> None:
    _, cache = cold_run
    address, env = two_nodes
    run_dir = tmp_path / "two_nodes"
    result = cli(
        f"model.path={policy_dir(cache)}", *SMALL, "run.num_steps=2", "run.eval_every=0", f"run.run_dir={run_dir}",
        f"run.ray_address={address}", "run.colocate=false", "rollout.num_engines=2", "run.mode=one_step_off",
        "trainer.rank_resources={CPU: 1, trainer_node: 1}", "rollout.engine_resources={CPU: 1, rollout_node: 1}",
        cache=cache, env_extra=env,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    (line,) = [line for line in (run_dir / "run.log").read_text().splitlines() if "weights v0 synced" in line]
    trainer_node = line.split("(Ray node ")[1][:8]
    engine_nodes = line.split("(Ray nodes ")[1].split(")")[0].split(", ")
    assert len(engine_nodes) == 2 and len(set(engine_nodes)) == 1 and trainer_node not in engine_nodes, line
    assert "gloo broadcast" in line  # auto: several engines on another node
    rows = history(run_dir)
    assert [r["step"] for r in rows] == [1, 2] and rows[0]["train_rollout_logprob_abs_diff_max"] == 0.0
    assert rows[1]["staleness_frac_1"] == 1.0
