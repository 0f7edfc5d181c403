"""CPU tier (one process, no Ray, no network): the metric trackers of `miles-orchestrator run` (trackers.py), read
back with each tool's own reader. One tiny run on the local cluster with every tracker on -- W&B offline, MLflow in
its default store in the run dir, TensorBoard -- killed after step 3 and resumed to step 4, is checked against its
metrics.jsonl: every numeric metric at every step, the resolved config, the summary plot, the same tracker runs
continued by the resume with no step logged twice (not even step 3, which the resume redoes). W&B's offline run
files have no reader in wandb itself: their records are read here with wandb's protobuf definitions and the LevelDB
log framing they are stored in.
"""

from __future__ import annotations

import json
import struct
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from miles_orchestrator.cli import main
from miles_orchestrator.config import load_config
from miles_orchestrator.run_dir import RunDir
from miles_orchestrator.trackers import RUN_IDS, default_mlflow_uri, mlflow_key, mlflow_params

SMALL = [  # test_local_cluster.py's tiny run
    "run.cluster=local", "rollout.num_prompts_per_step=4", "rollout.n_samples_per_prompt=4",
    "trainer.global_batch_size=16", "rollout.max_new_tokens=6", "filter.dynamic_sampling=false",
    "data.num_eval_prompts=8", "reward.num_workers=1", "rollout.engine.num_kv_pages=128", "run.num_threads=1",
]  # fmt: skip
TRACKERS = ["run.log.wandb=true", "run.log.mlflow=true", "run.log.tensorboard=true"]


def isolate(patch: pytest.MonkeyPatch, root: Path) -> None:
    """No network, no user settings: W&B offline through the environment (run.log.wandb_mode is null, so wandb's
    own default applies), its config and caches under `root`; MLflow without a tracking URI from the environment."""
    patch.setenv("WANDB_MODE", "offline")
    patch.setenv("WANDB_SILENT", "true")
    for name in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR", "WANDB_ARTIFACT_DIR"):
        patch.setenv(name, str(root / name.lower()))
    for name in ("WANDB_API_KEY", "WANDB_DIR", "WANDB_ENTITY", "WANDB_PROJECT", "WANDB_RUN_ID", "MLFLOW_TRACKING_URI"):
        patch.delenv(name, raising=False)
    patch.setenv("MLFLOW_DISABLE_TELEMETRY", "true")


@pytest.fixture(scope="module")
def tracked(policy: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """A tracked run of 3 steps (checkpoints at 2 and 3), killed after step 3's metrics line and before its
    checkpoint was committed, resumed to 4: it redoes step 3. The run dir; `rows`: the metric lines the trackers
    hold (step 3 as first logged); the tracker run ids after each part."""
    root = tmp_path_factory.mktemp("tracked")
    run_dir = root / "run"
    metrics = run_dir / "metrics.jsonl"
    with pytest.MonkeyPatch.context() as patch:
        isolate(patch, root)
        first = ["run", "--quiet", *SMALL, f"model.path={policy}", f"run.run_dir={run_dir}", "run.num_steps=3",
                 "run.checkpoint_every=2", "run.eval_every=2", *TRACKERS]  # fmt: skip
        assert main(first) == 0
        run = RunDir(run_dir, quiet=True)
        run.checkpoint_dir(3).rename(run.pending_checkpoint_dir(3))  # the state a kill before the commit leaves
        first_rows = [json.loads(line) for line in metrics.read_text().splitlines()]
        first_ids = json.loads((run_dir / RUN_IDS).read_text())
        assert main(["run", "--quiet", "--resume", str(run_dir), "run.num_steps=4"]) == 0
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [row["step"] for row in rows] == [0, 1, 2, 3, 4] and "resuming from" in (run_dir / "run.log").read_text()
    rows = first_rows + rows[len(first_rows) :]
    return {"dir": run_dir, "rows": rows, "first_ids": first_ids, "ids": json.loads((run_dir / RUN_IDS).read_text())}


def numeric_metrics(row: dict[str, Any]) -> dict[str, float]:
    """What a metrics line hands the trackers: its numbers, less the line's own step and time."""
    return {k: float(v) for k, v in row.items() if isinstance(v, (int, float)) and k not in ("step", "time")}


def wandb_records(path: Path) -> list[Any]:
    """The records of a .wandb file: a 7-byte W&B header, then LevelDB log records (a 7-byte header -- checksum,
    length, kind: 1 full, 2 first, 3 middle, 4 last -- in 32 KiB blocks, a block's tail under 7 bytes left as
    padding), each a `Record` protobuf."""
    from wandb.proto.wandb_internal_pb2 import Record

    data, block = path.read_bytes(), 32768
    assert data[:4] == b":W&B", path
    records, chunks, position = [], [], 7
    while position + 7 <= len(data):
        if block - position % block < 7:
            position += block - position % block
            continue
        length, kind = struct.unpack_from("<HB", data, position + 4)
        if position + 7 + length > len(data):
            break  # a record the service is still writing
        chunks.append(data[position + 7 : position + 7 + length])
        position += 7 + length
        if kind in (1, 4):
            record = Record()
            record.ParseFromString(b"".join(chunks))
            records.append(record)
            chunks = []
    return records


def wandb_runs(run_dir: Path, *, wait_s: float = 60.0) -> list[list[Any]]:
    """The records of each W&B offline run in the run dir (one per `miles-orchestrator run`), oldest first. `finish`
    returns once wandb-core has handled the run's exit, but the service closes the run's file (its last block, the
    exit record) after that, on its own: each file is read again until it holds its exit record, for `wait_s` at
    most (a file that never gets one is returned as it is, and the test's own assertion fails on it)."""
    runs = []
    for directory in sorted((run_dir / "wandb").glob("offline-run-*")):
        path, deadline = next(directory.glob("*.wandb")), time.monotonic() + wait_s
        records = wandb_records(path)
        while not any(r.HasField("exit") for r in records) and time.monotonic() < deadline:
            time.sleep(0.2)
            records = wandb_records(path)
        runs.append(records)
    return runs


def item_key(item: Any) -> str:
    return "/".join(item.nested_key) if item.nested_key else item.key


def test_wandb_holds_every_metric_at_its_step_the_resolved_config_and_the_summary_plot(tracked) -> None:
    runs = wandb_runs(tracked["dir"])
    assert len(runs) == 2  # the run, then its resume
    history: list[tuple[int, dict[str, Any]]] = []
    for records in runs:
        (run,) = [r.run for r in records if r.HasField("run")]
        assert run.run_id == tracked["ids"]["wandb"] == tracked["first_ids"]["wandb"], "the resume started a new run"
        assert run.project == "miles" and run.display_name == tracked["dir"].name
        for record in records:
            if record.HasField("history"):
                row = {item_key(i): json.loads(i.value_json) for i in record.history.item}
                history.append((row["_step"], row))
        (exit_record,) = [r.exit for r in records if r.HasField("exit")]
        assert exit_record.exit_code == 0
    steps = [step for step, _ in history]
    assert steps == [row["step"] for row in tracked["rows"]] == [0, 1, 2, 3, 4], "a step missing or logged twice"
    for (_, logged), row in zip(history, tracked["rows"], strict=True):
        wanted = numeric_metrics(row)
        assert wanted and {k: logged.get(k) for k in wanted} == wanted, row["step"]
    for records, num_steps in zip(runs, (3, 4), strict=True):  # the resolved config of each part (the resume's own)
        config = {}
        for record in records:
            updates = record.config.update if record.HasField("config") else ()
            config |= {item_key(u): json.loads(u.value_json) for u in updates}
        assert config["run"]["num_steps"] == num_steps
        assert config["trainer"]["loss"]["max_response_len"] == 6  # derived from rollout.max_new_tokens: resolved
    images = [(step, row) for step, row in history if row.get("plots/summary/_type") == "image-file"]
    assert [step for step, _ in images] == [3, 4]  # each part's summary.png, at its last step
    for records_dir, (_, row) in zip(sorted((tracked["dir"] / "wandb").glob("offline-run-*")), images, strict=True):
        assert (records_dir / "files" / row["plots/summary/path"]).is_file()


def test_mlflow_holds_every_metric_per_step_the_params_and_the_artifacts(tracked) -> None:
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=default_mlflow_uri(tracked["dir"]))
    experiment = client.get_experiment_by_name("miles")
    assert experiment is not None
    (run,) = client.search_runs([experiment.experiment_id])  # the resume continued it
    assert run.info.run_id == tracked["ids"]["mlflow"] == tracked["first_ids"]["mlflow"]
    assert run.info.status == "FINISHED" and run.info.run_name == tracked["dir"].name
    keys = {key for row in tracked["rows"] for key in numeric_metrics(row)}
    assert "eval_pass@1" in keys and mlflow_key("eval_pass@1") in run.data.metrics
    for key in keys:
        logged = sorted((m.step, m.value) for m in client.get_metric_history(run.info.run_id, mlflow_key(key)))
        wanted = [(row["step"], numeric_metrics(row)[key]) for row in tracked["rows"] if key in numeric_metrics(row)]
        assert logged == wanted, key  # every step once, the value of metrics.jsonl

    first = load_config(str(tracked["dir"] / "config.yaml"), ["run.num_steps=3"]).model_dump(mode="json")
    assert run.data.params == mlflow_params(first)  # MLflow keeps a run's first params...
    assert run.data.params["trainer.loss.max_response_len"] == "6" and run.data.params["run.num_steps"] == "3"
    (warning,) = [line for line in (tracked["dir"] / "run.log").read_text().splitlines() if "MLflow keeps" in line]
    assert "run.num_steps, " in warning and "trainer.optimizer.total_steps " in warning  # ...and the resume says so
    artifacts = {a.path for a in client.list_artifacts(run.info.run_id)}
    assert {"summary.png", "config.yaml"} <= artifacts
    stored = tracked["dir"] / "mlartifacts" / run.info.run_id / "artifacts"  # the default store keeps them here
    assert (stored / "summary.png").read_bytes() == (tracked["dir"] / "summary.png").read_bytes()


def test_tensorboard_holds_every_metric_once_per_step_the_config_and_the_plot(tracked) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(tracked["dir"] / "tensorboard"), size_guidance={"scalars": 0, "images": 0})
    events.Reload()
    tags = events.Tags()
    keys = {key for row in tracked["rows"] for key in numeric_metrics(row)}
    assert keys <= set(tags["scalars"])
    for key in ("reward_mean", "eval_pass@1"):
        logged = [(e.step, e.value) for e in events.Scalars(key)]
        wanted = [(row["step"], pytest.approx(row[key])) for row in tracked["rows"] if key in row]
        assert logged == wanted, key
    assert "summary" in tags["images"] and "config/text_summary" in tags["tensors"]


def test_a_run_dir_holding_a_run_is_refused_before_any_tracker_starts(tracked, policy, tmp_path) -> None:
    """Without --resume the command stops at start-up, and the run's tracker ids (what a later --resume continues)
    are left as they are."""
    with pytest.MonkeyPatch.context() as patch:
        isolate(patch, tmp_path)
        command = ["run", "--quiet", *SMALL, f"model.path={policy}", f"run.run_dir={tracked['dir']}", *TRACKERS]
        assert main(command) == 2
    assert json.loads((tracked["dir"] / RUN_IDS).read_text()) == tracked["ids"]
    assert len(wandb_runs(tracked["dir"])) == 2


@pytest.mark.parametrize(
    ("module", "tracker"),
    [("wandb", "wandb"), ("mlflow", "mlflow"), ("sqlalchemy", "mlflow"), ("tensorboard", "tensorboard")],
)
def test_a_missing_package_fails_at_start_up_naming_the_extra(module, tracker, tmp_path, monkeypatch, capsys) -> None:
    monkeypatch.setitem(sys.modules, module, None)  # `import module` raises ImportError
    run_dir = tmp_path / "run"
    assert main(["run", "--quiet", "run.cluster=local", f"run.run_dir={run_dir}", f"run.log.{tracker}=true"]) == 2
    error = capsys.readouterr().err
    assert f"run.log.{tracker}=true needs {module}" in error, error
    assert f"pip install 'miles-orchestrator[{tracker}]'" in error and f"--extra {tracker}" in error, error
    assert not (run_dir / RUN_IDS).exists() and not (run_dir / "wandb").exists()


def test_a_tracker_that_cannot_start_is_a_start_up_error_and_closes_those_started(tmp_path) -> None:
    """W&B starts, then MLflow refuses its tracking URI: the command exits 2 naming run.log.mlflow, and the W&B run
    is closed as failed."""
    run_dir = tmp_path / "run"
    with pytest.MonkeyPatch.context() as patch:
        isolate(patch, tmp_path)
        command = ["run", "--quiet", "run.cluster=local", f"run.run_dir={run_dir}", "run.log.wandb=true",
                   "run.log.mlflow=true", "run.log.mlflow_tracking_uri=nosuchscheme://x"]  # fmt: skip
        assert main(command) == 2
    (records,) = wandb_runs(run_dir)
    (exit_record,) = [r.exit for r in records if r.HasField("exit")]
    assert exit_record.exit_code == 1


def test_a_failed_run_is_marked_failed(tmp_path) -> None:
    """The model passes the start-up check (a config.json) but the run cannot load it: MLflow's run ends FAILED."""
    from mlflow.tracking import MlflowClient

    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    run_dir = tmp_path / "run"
    with pytest.MonkeyPatch.context() as patch:
        isolate(patch, tmp_path)
        assert main(["run", "--quiet", "run.cluster=local", f"model.path={model}", f"run.run_dir={run_dir}",
                     "run.log.mlflow=true"]) == 1  # fmt: skip
    run_id = json.loads((run_dir / RUN_IDS).read_text())["mlflow"]
    assert MlflowClient(tracking_uri=default_mlflow_uri(run_dir)).get_run(run_id).info.status == "FAILED"


def test_mlflow_names_and_params_fit_mlflows_limits() -> None:
    """Checked with MLflow's own validation: every param of a default config, a pass@k metric, and a value over
    MLflow's 6000 characters (cut, marked)."""
    from mlflow.utils.validation import _validate_metric_name, _validate_param

    assert mlflow_key("eval_pass@1") == "eval_pass_at_1" and mlflow_key("mem_gpu/peak GiB") == "mem_gpu/peak GiB"
    _validate_metric_name(mlflow_key("eval_pass@1"))
    config = load_config(None, []).model_dump(mode="json")
    params = mlflow_params(config | {"notes": {"long": "x" * 7000, "none": None, "empty": {}, "list": [1, "a"]}})
    for key, value in params.items():
        _validate_param(key, value)
    assert params["trainer.optimizer.lr"] == "0.0002" and params["run.run_dir"] == "runs/miles"
    assert params["notes.none"] == "null" and params["notes.empty"] == "{}" and params["notes.list"] == '[1, "a"]'
    assert len(params["notes.long"]) == 6000 and params["notes.long"].endswith("(truncated)")
