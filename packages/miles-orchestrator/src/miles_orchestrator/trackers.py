"""Metric trackers: where a run's metrics go besides RUN_DIR/metrics.jsonl, which `MetricsLog` (run_dir.py) writes
first and then hands to each of these. One class per tracker, each behind `Tracker`: the resolved config once at the
start, every step's numeric metrics, the run's plots (summary.png) at the end, then closed.

    run.log.tensorboard  TensorBoard events in RUN_DIR/tensorboard
    run.log.wandb        Weights & Biases: streamed (online), or files for a later `wandb sync` (offline)
    run.log.mlflow       MLflow: a tracking server, or by default a SQLite file in the run dir

A resumed run (`--resume RUN_DIR`) continues the same W&B and MLflow runs, whose ids RUN_DIR/trackers.json keeps.
Each tracker is imported only when enabled; a missing package fails at start-up naming the extra that installs it.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import re
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol
from urllib.parse import urlsplit

if TYPE_CHECKING:
    from miles_orchestrator.config.sections import LogSection

RUN_IDS = "trackers.json"  # in RUN_DIR: {"wandb": run id, "mlflow": run id}, read back by a resumed run
# The packages each tracker imports; the extra of miles-orchestrator that installs them has the tracker's name.
PACKAGES = {"tensorboard": ("tensorboard",), "wandb": ("wandb",), "mlflow": ("mlflow",)}
MLFLOW_DATABASE_PACKAGES = ("sqlalchemy", "alembic")  # MLflow's SQL stores (its default: SQLite) beyond mlflow-skinny
# MLflow's limits (mlflow.utils.validation): key length, param value length, entries per log_batch call.
MLFLOW_MAX_KEY, MLFLOW_MAX_VALUE, MLFLOW_MAX_PARAMS, MLFLOW_MAX_METRICS = 250, 6000, 100, 1000
MLFLOW_DATABASES = ("sqlite", "postgresql", "mysql", "mssql")  # tracking URI schemes MLflow stores through SQLAlchemy


class Tracker(Protocol):
    """A metric sink besides metrics.jsonl."""

    @property
    def run_id(self) -> str | None:
        """The tracker's run, which `--resume` continues (None: nothing to continue)."""

    def log_config(self, config: dict[str, Any]) -> None: ...

    def log_metrics(self, step: int, metrics: dict[str, float]) -> None: ...

    def finish(self, artifacts: Sequence[Path], *, is_success: bool) -> None:
        """Log `artifacts` (the run's PNG plots) and close; `is_success` false: the run failed."""


def open_trackers(
    log: LogSection, run_dir: Path, config: dict[str, Any], *, is_resumed: bool, warn: Callable[[str], None] = print
) -> list[Tracker]:
    """The trackers `log` enables, started and given `config`; with `is_resumed`, the W&B and MLflow runs that
    RUN_DIR/trackers.json names are continued. A missing package, or a tracker that cannot start (no W&B API key
    online, an unreachable MLflow server), is a ValueError naming the setting, raised before the run starts and
    after closing the trackers already started."""
    names = [name for name in PACKAGES if getattr(log, name)]
    for name in names:
        is_database = name == "mlflow" and is_database_uri(mlflow_tracking_uri(log, run_dir))
        for module in PACKAGES[name] + (MLFLOW_DATABASE_PACKAGES if is_database else ()):
            _require(module, name)
    ids_file = run_dir / RUN_IDS
    run_ids: dict[str, str] = json.loads(ids_file.read_text()) if is_resumed and ids_file.is_file() else {}
    trackers: list[Tracker] = []
    for name in names:
        try:
            if name == "tensorboard":
                tracker: Tracker = TensorBoardTracker(run_dir / "tensorboard")
            elif name == "wandb":
                tracker = WandbTracker(log, run_dir, run_ids.get("wandb"))
            else:
                tracker = MlflowTracker(log, run_dir, run_ids.get("mlflow"), warn)
            tracker.log_config(config)
        except Exception as error:
            for started in trackers:
                with contextlib.suppress(Exception):  # the error to report is the one above
                    started.finish([], is_success=False)
            raise ValueError(
                f"run.log.{name}=true: the tracker did not start ({type(error).__name__}: {error})"
            ) from error
        trackers.append(tracker)
        if tracker.run_id is not None:
            run_ids[name] = tracker.run_id
    if run_ids:  # replaced whole: a crash leaves the old ids or the new ones
        staging = ids_file.with_name(f".{RUN_IDS}.tmp")
        staging.write_text(json.dumps(run_ids, indent=1) + "\n")
        os.replace(staging, ids_file)
    else:  # a new run without trackers: a later --resume must not continue an earlier run's
        ids_file.unlink(missing_ok=True)
    return trackers


def _require(module: str, tracker: str) -> None:
    try:
        importlib.import_module(module)
    except ImportError as error:
        raise ValueError(
            f"run.log.{tracker}=true needs {module}, which is not installed ({error}); install the {tracker} extra: "
            f"pip install 'miles-orchestrator[{tracker}]', or in a checkout uv sync --all-packages --extra {tracker}"
        ) from error


class TensorBoardTracker:
    """Scalars per step, the config as text, the plots as images, in `directory`."""

    run_id = None

    def __init__(self, directory: Path) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self._writer = SummaryWriter(str(directory))

    def log_config(self, config: dict[str, Any]) -> None:
        self._writer.add_text("config", "```json\n" + json.dumps(config, indent=1) + "\n```")

    def log_metrics(self, step: int, metrics: dict[str, float]) -> None:
        for key, value in metrics.items():
            self._writer.add_scalar(key, value, step)
        self._writer.flush()

    def finish(self, artifacts: Sequence[Path], *, is_success: bool) -> None:
        import matplotlib.image

        for path in artifacts:
            self._writer.add_image(path.stem, matplotlib.image.imread(path)[..., :3], dataformats="HWC")
        self._writer.close()


class WandbTracker:
    """A W&B run: metrics at their step, the config in `wandb.config`, each plot a `wandb.Image`."""

    def __init__(self, log: LogSection, run_dir: Path, run_id: str | None) -> None:
        import wandb

        directory = Path(log.wandb_dir or run_dir)
        directory.mkdir(parents=True, exist_ok=True)
        self._wandb = wandb
        self._run: Any = wandb.init(
            project=log.wandb_project, entity=log.wandb_entity, name=log.wandb_name or run_dir.resolve().name,
            group=log.wandb_group, mode=log.wandb_mode, dir=str(directory),
            id=run_id, resume="allow" if run_id is not None else None,
        )  # fmt: skip
        self.run_id: str = self._run.id

    def log_config(self, config: dict[str, Any]) -> None:
        self._run.config.update(config, allow_val_change=True)  # a resumed run may override settings

    def log_metrics(self, step: int, metrics: dict[str, float]) -> None:
        self._run.log(metrics, step=step)

    def finish(self, artifacts: Sequence[Path], *, is_success: bool) -> None:
        if artifacts:
            self._run.log({f"plots/{path.stem}": self._wandb.Image(str(path)) for path in artifacts})
        self._run.finish(exit_code=0 if is_success else 1)


class MlflowTracker:
    """An MLflow run: the flattened config as params (and whole as config.yaml), metrics at their step (keys spelled
    as MLflow allows: `mlflow_key`), the plots as artifacts."""

    def __init__(self, log: LogSection, run_dir: Path, run_id: str | None, warn: Callable[[str], None]) -> None:
        from mlflow.exceptions import MlflowException
        from mlflow.tracking import MlflowClient

        self._warn = warn
        uri = mlflow_tracking_uri(log, run_dir)
        self._client = MlflowClient(tracking_uri=uri)
        if run_id is not None:
            try:
                self._client.update_run(run_id, status="RUNNING")
            except MlflowException as error:
                warn(f"warning: MLflow run {run_id} (RUN_DIR/{RUN_IDS}) is not in {uri} ({error}); starting a new one")
                run_id = None
        if run_id is None:
            experiment = self._client.get_experiment_by_name(log.mlflow_experiment)
            if experiment is not None:
                experiment_id = experiment.experiment_id
            else:  # the default store keeps its artifacts in the run dir too (MLflow's default is ./mlruns)
                is_default = uri == default_mlflow_uri(run_dir)
                artifacts = (run_dir / "mlartifacts").resolve().as_uri() if is_default else None
                experiment_id = self._client.create_experiment(log.mlflow_experiment, artifact_location=artifacts)
            name = log.mlflow_run_name or run_dir.resolve().name
            run_id = self._client.create_run(experiment_id, run_name=name).info.run_id
        self.run_id: str = run_id

    def log_config(self, config: dict[str, Any]) -> None:
        from mlflow.entities import Param

        params = mlflow_params(config)
        logged = self._client.get_run(self.run_id).data.params  # a resumed run's: MLflow refuses to change them
        changed = sorted(key for key, value in params.items() if logged.get(key, value) != value)
        if changed:
            self._warn(f"warning: MLflow keeps a run's first params, so {', '.join(changed)} keep their old values "
                       "there; the artifact config.yaml has the resumed run's")  # fmt: skip
        new = [Param(key, value) for key, value in params.items() if key not in logged]
        for start in range(0, len(new), MLFLOW_MAX_PARAMS):
            self._client.log_batch(self.run_id, params=new[start : start + MLFLOW_MAX_PARAMS])
        self._client.log_dict(self.run_id, config, "config.yaml")

    def log_metrics(self, step: int, metrics: dict[str, float]) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        entries = [Metric(mlflow_key(key), value, now, step) for key, value in metrics.items()]
        for start in range(0, len(entries), MLFLOW_MAX_METRICS):
            self._client.log_batch(self.run_id, metrics=entries[start : start + MLFLOW_MAX_METRICS])

    def finish(self, artifacts: Sequence[Path], *, is_success: bool) -> None:
        for path in artifacts:
            self._client.log_artifact(self.run_id, str(path))
        self._client.set_terminated(self.run_id, status="FINISHED" if is_success else "FAILED")


def is_database_uri(uri: str) -> bool:
    return urlsplit(uri).scheme.split("+")[0] in MLFLOW_DATABASES


def default_mlflow_uri(run_dir: Path) -> str:
    return f"sqlite:///{(run_dir / 'mlflow.db').resolve()}"


def mlflow_tracking_uri(log: LogSection, run_dir: Path) -> str:
    """`run.log.mlflow_tracking_uri`, else MLFLOW_TRACKING_URI, else a SQLite file in the run dir (MLflow's own
    default is ./mlflow.db in the working directory; its file store, ./mlruns, is in maintenance mode and refused
    unless MLFLOW_ALLOW_FILE_STORE=true)."""
    return log.mlflow_tracking_uri or os.environ.get("MLFLOW_TRACKING_URI") or default_mlflow_uri(run_dir)


def mlflow_key(name: str) -> str:
    """A metric or param name as MLflow takes it: alphanumerics, `_ - . / :` and spaces only (`eval_pass@1` is
    `eval_pass_at_1`), at most 250 characters."""
    return re.sub(r"[^\w\-./: ]", "_", name.replace("@", "_at_"))[:MLFLOW_MAX_KEY]


def mlflow_params(config: dict[str, Any], prefix: str = "") -> dict[str, str]:
    """The config as MLflow params: one per leaf, keyed by its dotted path (`trainer.optimizer.lr`), the value as
    JSON text (strings as they are), cut to MLflow's 6000 characters (config.yaml, an artifact, has it whole)."""
    params: dict[str, str] = {}
    for name, value in config.items():
        if isinstance(value, dict) and value:
            params |= mlflow_params(value, f"{prefix}{name}.")
            continue
        text = value if isinstance(value, str) else json.dumps(value)
        if len(text) > MLFLOW_MAX_VALUE:
            text = text[: MLFLOW_MAX_VALUE - 15] + "... (truncated)"
        params[mlflow_key(f"{prefix}{name}")] = text
    return params
