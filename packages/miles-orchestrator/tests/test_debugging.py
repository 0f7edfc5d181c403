"""CPU tier (one process, no Ray): the debugging commands on real local-cluster runs of a tiny random policy whose
reward (`orchestrator_plugins:even_tokens`) differs between samples, so every step updates the weights.

- the saved rollouts hold every `Sample` field, read back equal;
- `replay` of a saved step reproduces the run's update bitwise (its weight digests and training metrics), from a
  checkpoint or from the start, and names what differs when the replay trains differently (an entropy bonus);
- `mismatch` over a low-precision rollout's step agrees with the step's own measured mismatch, and `--layers` finds no
  layer apart under deterministic kernels and the one deliberately perturbed layer otherwise;
- `inspect` shows a step and a sample;
- `run.profile_steps` writes a Chrome / Perfetto trace of the engine's and the trainer's ops, and every step's
  phases are on the timeline.
The Ray cluster's replay is tested by the integration tier (tests/integration/test_debugging.py).
"""

from __future__ import annotations

import asyncio
import base64
import json
from pathlib import Path

import numpy as np
import pytest
import torch

from miles_contracts import ChatMessage, Sample, SampleStatus
from miles_orchestrator.cli import main
from miles_orchestrator.config import load_config
from miles_orchestrator.rollout_dump import RolloutDump, load_step, saved_steps

SMALL = [
    "run.cluster=local", "rollout.num_prompts_per_step=4", "rollout.n_samples_per_prompt=4",
    "trainer.global_batch_size=16", "rollout.max_new_tokens=6", "filter.dynamic_sampling=false",
    "reward.num_workers=1", "rollout.engine.num_kv_pages=128", "run.num_threads=1", "run.eval_every=0",
    "reward.name=orchestrator_plugins:even_tokens", "trainer.optimizer.lr=1e-2", "run.save_rollouts=true",
]  # fmt: skip


def run(policy: Path, run_dir: Path, *overrides: str) -> Path:
    assert main(["run", "--quiet", *SMALL, f"model.path={policy}", f"run.run_dir={run_dir}", *overrides]) == 0
    return run_dir


@pytest.fixture(scope="module")
def saved_run(policy, tmp_path_factory, plugins_on_path) -> Path:
    """4 deterministic steps, every batch saved, a checkpoint every 2 steps, step 2 profiled."""
    return run(
        policy,
        tmp_path_factory.mktemp("saved") / "run",
        "run.num_steps=4",
        "run.checkpoint_every=2",
        "run.profile_steps=[2]",
    )


def test_saved_rollouts_hold_every_sample_field(tmp_path) -> None:
    experts = base64.b64encode(np.arange(24, dtype=np.int32).tobytes()).decode()
    samples = [
        Sample(index=7, group_index=1, prompt=[ChatMessage(role="user", content="2+2? [/INST]")], label={"a": [4]},
               prompt_tokens=[5, 6, 7], response_tokens=[8, 9], response="4 ⏎", rollout_logprobs=[-0.1 / 3, -2e-9],
               teacher_logprobs=[-0.5, -0.25], teacher_top_logprobs=[[(8, -0.1)], [(9, -0.2), (3, -1.5)]],
               loss_mask=[1, 0], reward=0.75, status=SampleStatus.COMPLETED, finish_reason="stop",
               weight_versions=[3, 4], weight_version=4, routed_experts=experts, metadata={"spec": {"verify_ct": 2}}),
        Sample(index=8, group_index=1, prompt="plain", prompt_tokens=[5], response_tokens=[1],
               rollout_logprobs=[-1.0], reward=None, status=SampleStatus.FAILED, error="timed out"),
    ]  # fmt: skip
    dump = RolloutDump(tmp_path, every=1, max_bytes=0)
    dump.write_batch(3, samples, [[0.5, -1 / 3], [0.0]], [[-0.1, -2.5e-9], [-0.9]], trained_version=2)
    saved = load_step(tmp_path, 3)
    assert saved.samples == samples and saved.trained_version == 2 and saved.outcome is None
    assert saved.advantages == [[0.5, -1 / 3], [0.0]] and saved.trainer_logprobs == [[-0.1, -2.5e-9], [-0.9]]
    dump.write_outcome(3, {"loss": 0.25}, {"w": "0" * 64})
    assert load_step(tmp_path, 3).outcome == {"step": 3, "metrics": {"loss": 0.25}, "digests": {"w": "0" * 64}}
    with pytest.raises(ValueError, match=r"holds the rollouts of steps 3\.\.3"):
        load_step(tmp_path, 4)


def test_the_size_bound_drops_the_oldest_steps(tmp_path) -> None:
    sample = Sample(index=0, group_index=0, prompt="p", prompt_tokens=list(range(500)), response_tokens=[1])
    logs: list[str] = []
    dump = RolloutDump(tmp_path, every=1, max_bytes=1, log=logs.append)  # every older step is over the bound
    for step in (1, 2, 3):
        dump.write_batch(step, [sample], [[0.0]], None, trained_version=step - 1)
    assert saved_steps(tmp_path) == [3] and len(logs) == 2 and "run.save_rollouts_max_bytes" in logs[0]


@pytest.mark.timeout(600)
def test_replay_reproduces_each_saved_step_bitwise(saved_run, capsys) -> None:
    assert saved_steps(saved_run) == [1, 2, 3, 4]
    outcomes = [load_step(saved_run, s).outcome for s in (1, 2, 3, 4)]
    assert all(o is not None and o["metrics"]["grad_norm"] > 0 for o in outcomes), "the steps must update"
    assert len({json.dumps(o["digests"], sort_keys=True) for o in outcomes if o}) == 4, "each step changes weights"
    assert main(["replay", str(saved_run), "--step", "3", "--quiet"]) == 0  # from the step-2 checkpoint
    assert main(["replay", str(saved_run), "--step", "2", "--quiet"]) == 0  # from the policy: steps 1 and 2
    out = capsys.readouterr().out
    assert out.count("bitwise the same update") == 3
    report = json.loads((saved_run / "replay" / "step_000002" / "replay.json").read_text())
    assert report["start_checkpoint"] == 0 and [s["step"] for s in report["steps"]] == [1, 2]
    assert all(s["is_identical"] for s in report["steps"])


@pytest.mark.timeout(600)
def test_a_replay_that_trains_differently_names_the_weights_and_metrics(saved_run, capsys) -> None:
    # the learning rate would not do: the checkpoint's optimizer and scheduler state bring the run's back
    assert main(["replay", str(saved_run), "--step", "3", "--quiet", "trainer.loss.entropy_coef=0.5"]) == 1
    (step,) = json.loads((saved_run / "replay" / "step_000003" / "replay.json").read_text())["steps"]
    assert not step["is_identical"] and "model.layers.0.mlp.down_proj.weight" in step["differing_tensors"]
    assert {"loss", "grad_norm"} <= set(step["differing_metrics"]) and not step["differing_inputs"]
    assert "DIFFERS" in capsys.readouterr().out


def test_a_replay_without_the_steps_it_needs_is_refused(saved_run, tmp_path, capsys) -> None:
    partial = tmp_path / "partial"
    partial.mkdir()
    (partial / "config.yaml").write_text((saved_run / "config.yaml").read_text())
    for name in ("step_000001.parquet", "step_000001.json"):
        (partial / "rollouts").mkdir(exist_ok=True)
        (partial / "rollouts" / name).write_bytes((saved_run / "rollouts" / name).read_bytes())
    assert main(["replay", str(partial), "--step", "3"]) == 2
    assert "lacks steps [2, 3]" in capsys.readouterr().err


def test_inspect_shows_a_step_and_a_sample(saved_run, capsys) -> None:
    assert main(["inspect", str(saved_run), "--step", "2"]) == 0
    out = capsys.readouterr().out
    assert "step 2: 16 samples" in out and "grad_norm" in out
    assert main(["inspect", str(saved_run), "--step", "2", "--sample", "3"]) == 0
    out = capsys.readouterr().out
    saved = load_step(saved_run, 2).samples[3]
    assert f"index {saved.index}" in out and "response tokens" in out
    assert f"{saved.rollout_logprobs[0]:.6g}" in out
    assert main(["inspect", str(saved_run), "--step", "2", "--sample", "16"]) == 2
    assert "has samples 0..15" in capsys.readouterr().err


@pytest.mark.timeout(600)
def test_the_token_mismatch_of_a_low_precision_step_is_the_measured_one(policy, tmp_path, plugins_on_path) -> None:
    # an FP8 engine without QAT: the trainer recomputes π_old (on this CPU, fast mode alone agrees bit for bit)
    run_dir = run(policy, tmp_path / "fp8", "run.num_steps=2", "rollout.engine.weight_dtype=fp8_block")
    assert main(["mismatch", str(run_dir), "--step", "2"]) == 0
    report = json.loads((run_dir / "mismatch" / "step_000002.json").read_text())["tokens"]
    saved = load_step(run_dir, 2)
    assert saved.trainer_logprobs is not None and saved.outcome is not None
    measured = saved.outcome["metrics"]
    assert report["max"] == pytest.approx(measured["train_rollout_logprob_abs_diff_max"], rel=1e-6)
    assert report["mean"] == pytest.approx(measured["train_rollout_logprob_abs_diff"], rel=1e-6)
    assert report["num_tokens"] == sum(len(s.response_tokens) for s in saved.samples)
    quantiles = list(report["quantiles"].values())
    assert quantiles == sorted(quantiles) and quantiles[-1] <= report["max"]
    worst = [w["abs_diff"] for w in report["worst_tokens"]]
    assert worst == sorted(worst, reverse=True) and worst[0] == report["max"]
    assert sum(b["count"] for b in report["by_position"]) == report["num_tokens"]
    assert (run_dir / "mismatch" / "step_000002.png").stat().st_size > 10_000


@pytest.mark.timeout(600)
def test_the_layer_comparison_finds_the_perturbed_layer(saved_run) -> None:
    from miles_orchestrator.cluster.local import LocalCluster
    from miles_orchestrator.mismatch import layer_divergence
    from miles_orchestrator.replay import train_to
    from miles_orchestrator.run_dir import RunDir

    cfg = load_config(str(saved_run / "config.yaml"), [f"run.run_dir={saved_run}"])
    samples = load_step(saved_run, 4).samples[:3]

    async def compare(perturbed: int | None) -> dict:
        scratch = RunDir(saved_run / "layers", quiet=True)
        cluster = await LocalCluster.start(cfg, str(RunDir(saved_run).policy()), scratch.path)
        try:
            await train_to(cfg, cluster, RunDir(saved_run, quiet=True), 3, scratch, checkpoint_before=4)
            await cluster.engine.resume_memory_occupation()
            await cluster.sync_weights(3, cfg.run.sync_bucket_bytes)
            if perturbed is not None:
                with torch.no_grad():
                    cluster.engine_model.model.layers[perturbed].mlp.down_proj.weight.mul_(1.01)
            return await layer_divergence(cluster, samples)
        finally:
            await cluster.shutdown()

    exact = asyncio.run(compare(None))
    assert exact["first_inexact_layer"] is None and exact["first_divergent_layer"] is None
    assert exact["layers"]["layer_0"]["num_rows"] > 0
    off = asyncio.run(compare(1))
    assert off["first_inexact_layer"] == "layer_1" == off["first_divergent_layer"]
    assert off["layers"]["layer_0"]["max_abs_diff"] == 0.0 and off["layers"]["norm"]["max_abs_diff"] > 0


@pytest.mark.timeout(600)
def test_the_mismatch_command_compares_layers(saved_run, capsys) -> None:
    assert main(["mismatch", str(saved_run), "--step", "3", "--layers", "--num-samples", "2"]) == 0
    report = json.loads((saved_run / "mismatch" / "step_000003.json").read_text())
    assert report["tokens"]["max"] == 0.0 and report["tokens"]["fraction_exact"] == 1.0  # true on-policy
    assert report["layers"]["first_inexact_layer"] is None and report["layers"]["num_samples"] == 2
    assert "first inexact None" in capsys.readouterr().out


def test_a_profiled_step_has_a_trace_and_every_step_its_phases(saved_run) -> None:
    (trace,) = (saved_run / "profiles" / "step_000002").glob("*.trace.json")
    events = json.loads(trace.read_text())["traceEvents"]  # the Chrome trace format Perfetto opens
    ops = [e for e in events if e.get("ph") == "X" and e.get("name", "").startswith(("aten::", "native::"))]
    assert all({"ts", "dur", "pid", "tid"} <= set(e) for e in ops)
    names = {e["name"] for e in ops}
    assert "aten::embedding" in names, "the forwards (engine and trainer)"
    assert names & {"aten::mm", "native::native_linear"}, "their GEMMs (the torch or the native kernels)"
    assert any("Backward" in e.get("name", "") for e in events), "the trainer's backward"
    assert not (saved_run / "profiles" / "step_000001").exists()
    spans = [json.loads(line) for line in (saved_run / "timeline.jsonl").read_text().splitlines()]
    for step in (1, 2, 3, 4):
        mine = {s["phase"]: s for s in spans if s["step"] == step}
        assert set(mine) == {"rollout", "reward", "train", "checkpoint", "sync"}, step
        assert mine["rollout"]["start"] <= mine["reward"]["start"] <= mine["reward"]["end"] <= mine["rollout"]["end"]
        assert mine["rollout"]["end"] <= mine["train"]["start"] <= mine["train"]["end"] <= mine["sync"]["start"]
    assert (saved_run / "timeline.png").stat().st_size > 10_000


def test_a_profile_that_cannot_start_or_stop_is_logged_and_the_step_goes_on(tmp_path) -> None:
    from miles_orchestrator.profiles import StepProfiler
    from miles_orchestrator.run_dir import RunDir

    class Cluster:  # an engine restarted mid-step is not recording: its /stop_profile is a 400
        def __init__(self, fails_at: str) -> None:
            self.fails_at = fails_at

        async def start_profile(self, directory: Path) -> None:
            if self.fails_at == "start":
                raise RuntimeError("engine 0 is restarting")

        async def stop_profile(self) -> None:
            if self.fails_at == "stop":
                raise RuntimeError("no profile is recording; start one first")

    cfg = load_config(None, ["run.profile_steps=[1]", "run.num_steps=2"])
    run = RunDir(tmp_path, quiet=True)

    async def steps(cluster: Cluster) -> list[int]:
        profiler, done = StepProfiler(cfg, cluster, run), []  # type: ignore[arg-type]
        for step in (1, 2):
            async with profiler.step(step):
                done.append(step)
        return done

    assert asyncio.run(steps(Cluster("start"))) == [1, 2]
    assert asyncio.run(steps(Cluster("stop"))) == [1, 2]
    log = (tmp_path / "run.log").read_text()
    assert "step 1 not profiled: RuntimeError: engine 0 is restarting" in log
    assert "the profile of step 1 is incomplete" in log
    assert (tmp_path / "profiles" / "step_000001" / "driver.trace.json").is_file()  # the driver's part is written
