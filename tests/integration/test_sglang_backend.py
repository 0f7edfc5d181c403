"""Integration tier: `rollout.backend=sglang` on a real Ray cluster on this machine, SGLang replaced by a stand-in
(sglang_as_miles.py) that reads the config file Miles writes for `sglang.launch_server` and becomes `miles-rollout
serve`, the drop-in SGLang server (SGLang itself needs a GPU; the mapping is checked against SGLang's own parser in
miles-rollout's test_sglang_launch.py).

A colocated GRPO run launches its engine through the SGLang path (config file for this user only, the ServerArgs
the run's settings give), checks the version-0 sync by the served weight version, releases and resumes the engine's
memory around each training step (SGLang's memory saver is asked for), trains with recomputed old log-probs and TIS
(kernel.mode=fast), and stops the server with the run.

An async run with the engine on GPUs of its own (run.colocate=false) syncs by broadcast
(run.sync_transport=distributed), generation paused around each sync:
the engine joins trainer rank 0's weight-update group (gloo from this CPU trainer; NCCL from a CUDA one), each sync
speaks SGLang's protocol (`/update_weights_from_distributed` per bucket, the version on the last one; no
`/begin_weight_update`, whose SGLang route is for quantized weights), and with fault tolerance on each sync also
writes the weight file a restarted engine would load.
"""

from __future__ import annotations

import json
import socket
import stat
import sys
from pathlib import Path

import pytest
from orchestrator_runs import SMALL, cli, history, policy_dir

STAND_IN = Path(__file__).with_name("sglang_as_miles.py")


@pytest.mark.timeout(900)
def test_a_run_launches_sglang_engines_and_trains(cold_run, tmp_path) -> None:
    _, cache = cold_run
    run_dir = tmp_path / "sglang"
    result = cli(
        f"model.path={policy_dir(cache)}", *SMALL, "run.num_steps=1", "run.eval_every=0", f"run.run_dir={run_dir}",
        "rollout.backend=sglang", "kernel.mode=fast", "trainer.loss.is_mode=truncate",
        f"rollout.sglang.launch_command=[{sys.executable}, {STAND_IN}]", "rollout.sglang.mem_fraction_static=0.5",
        cache=cache,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    rows = history(run_dir)
    assert [r["step"] for r in rows] == [1]
    assert rows[0]["train_rollout_logprob_abs_diff"] < 0.05 and "is_weight_mean" in rows[0]
    (config,) = (run_dir / "engines").glob("sglang-*.yaml")
    assert stat.S_IMODE(config.stat().st_mode) == 0o600  # it holds the admin key
    launched = json.loads(config.with_suffix(".launched.json").read_text())
    args = launched["server_args"]
    assert launched["argv"] == ["--config", str(config)]
    assert args["model_path"] == str(policy_dir(cache)) and args["host"] == "127.0.0.1"
    assert args["enable_memory_saver"] is True and args["mem_fraction_static"] == 0.5  # colocated
    assert len(args["admin_api_key"]) == 32 and args["admin_api_key"] not in (run_dir / "run.log").read_text()
    assert (args["tp_size"], args["dtype"], args["weight_version"]) == (1, "float32", "0")
    log = (run_dir / "run.log").read_text()
    assert "the SGLang engines serve v0" in log
    with socket.socket() as sock:  # the server stopped with the run
        assert sock.connect_ex(("127.0.0.1", args["port"])) != 0


@pytest.mark.timeout(900)
def test_a_disaggregated_run_broadcasts_weights_to_sglang_engines(cold_run, tmp_path) -> None:
    _, cache = cold_run
    run_dir = tmp_path / "sglang-broadcast"
    result = cli(
        f"model.path={policy_dir(cache)}", *SMALL, "run.num_steps=2", "run.eval_every=0", f"run.run_dir={run_dir}",
        "rollout.backend=sglang", "kernel.mode=fast", "trainer.loss.is_mode=mask", "run.colocate=false",
        "run.sync_transport=distributed", "rollout.fault_tolerance.enabled=true", "rollout.sglang.log_level=info",
        "run.mode=async",
        f"rollout.sglang.launch_command=[{sys.executable}, {STAND_IN}]",
        cache=cache,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    rows = history(run_dir)
    assert [r["step"] for r in rows] == [1, 2]
    # the broadcast v0 generated step 1 (step 2's samples are one version stale: no mismatch is measured on them)
    assert rows[0]["staleness_max"] == 0 and rows[0]["train_rollout_logprob_abs_diff"] < 0.05
    log = (run_dir / "run.log").read_text()
    assert "weights v0 synced via a gloo broadcast from trainer rank 0" in log and "the SGLang engines serve v0" in log
    (config,) = (run_dir / "engines").glob("sglang-*.yaml")
    args = json.loads(config.with_suffix(".launched.json").read_text())["server_args"]
    assert "enable_memory_saver" not in args  # not colocated
    calls = config.with_suffix(".log").read_text()
    assert calls.count("POST /init_weights_update_group") == 1
    assert calls.count("POST /update_weights_from_distributed") >= 3  # v0, v1, v2: a bucket or more each
    assert "/begin_weight_update" not in calls and "/end_weight_update" not in calls
    # async: each sync after the first pauses generation (rollout.pause_mode=retract) and continues it after
    assert calls.count("POST /pause_generation") >= 2 and calls.count("POST /continue_generation") >= 2
    assert (run_dir / "sync" / "model.safetensors").is_file()  # what a restarted engine would load
