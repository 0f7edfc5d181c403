"""The cluster `run.cluster` names, started."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from miles_orchestrator.cluster.protocol import Cluster
from miles_orchestrator.config import RunConfig


async def start_cluster(cfg: RunConfig, model_dir: str, run_dir: Path, log: Callable[[str], None] = print) -> Cluster:
    """The cluster `run.cluster` names, started: engine up, trainer ranks set up; `log` gets its events (engine
    restarts)."""
    if cfg.run.cluster == "local":
        from miles_orchestrator.cluster.local import LocalCluster

        return await LocalCluster.start(cfg, model_dir, run_dir)
    from miles_orchestrator.cluster.ray.cluster import RayCluster

    return await RayCluster.start(cfg, model_dir, run_dir, log)
