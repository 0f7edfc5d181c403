"""Where `RayCluster`'s actors run: a local Ray started for the run (or an existing cluster), the placement groups and
each actor's bundle, and the CPUs each actor is pinned to (`run.pin_cpus`)."""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import ray
from ray.util.placement_group import placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from miles_orchestrator.config import RunConfig

RAY_TEMP_MAX_CHARS = 40


def start_ray(address: str | None, run_dir: Path, num_cpus: int, bind_host: str = "127.0.0.1") -> None:
    """Connect to `address`, or start a local Ray for this run (dashboard off, temp files in a short dir) whose head,
    raylet and workers listen on `bind_host` (run.bind_host) only."""
    if ray.is_initialized():
        return
    if address:
        ray.init(address=address, log_to_driver=False)
        return
    # Ray's unix sockets (TEMP/session_<date>_<time>_<us>_<pid>/sockets/plasma_store, at most 107 bytes) need a
    # short path: keep its temp dir under the run dir only when that leaves room for the ~62 bytes Ray appends.
    temp = run_dir.resolve() / "ray"
    if len(str(temp)) > RAY_TEMP_MAX_CHARS:
        temp = Path(tempfile.mkdtemp(prefix="miles-ray-"))
    with _loopback_allowed(ipaddress.ip_address(bind_host).is_loopback):
        ray.init(num_cpus=num_cpus, include_dashboard=False, _temp_dir=str(temp), log_to_driver=False,
                 configure_logging=False, _node_ip_address=bind_host)  # fmt: skip


@contextlib.contextmanager
def _loopback_allowed(is_loopback: bool) -> Iterator[None]:
    """Let ray.init keep a loopback node address. Ray replaces one by the node's routable IP unless it runs as a
    one-machine cluster (`ray_constants.ENABLE_RAY_CLUSTER` false: its default on macOS and Windows); that is read
    while the node starts, and its processes are then given the address, so the switch is needed only meanwhile."""
    if not is_loopback:
        yield
        return
    from ray._private import ray_constants

    enabled = ray_constants.ENABLE_RAY_CLUSTER
    ray_constants.ENABLE_RAY_CLUSTER = False
    try:
        yield
    finally:
        ray_constants.ENABLE_RAY_CLUSTER = enabled


async def place(
    groups: list[Any], colocate: bool, rank_bundles: list[dict[str, float]], engine_bundles: list[dict[str, float]]
) -> list[PlacementGroupSchedulingStrategy]:
    """Placement groups, and the scheduling strategy of each actor (ranks first, then engines): colocated, all
        bundles in one group; disaggregated, the ranks in one and the engines in another, so that they can land on
        different nodes (`trainer.rank_resources`, `rollout.engine_resources`). The groups are added to `groups` before
    they are waited for, so that the caller frees them whatever happens."""
    parts = [rank_bundles + engine_bundles] if colocate else [rank_bundles, engine_bundles]
    groups += [placement_group(bundles, strategy="PACK") for bundles in parts]
    try:
        await asyncio.wait_for(asyncio.gather(*(group.ready() for group in groups)), timeout=120)
    except TimeoutError:
        offered = ray.cluster_resources()  # type: ignore[no-untyped-call]
        raise RuntimeError(
            f"Ray could not place the trainer ranks {rank_bundles} and engines {engine_bundles} within 120 s: the "
            f"cluster offers {offered}; lower trainer.rank_resources / rollout.engine_resources "
            "or the counts, or add nodes"
        ) from None
    strategies = []
    for group, bundles in zip(groups, parts, strict=True):
        strategies += [PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=i)
                       for i in range(len(bundles))]  # fmt: skip
    return strategies


async def where(actor: Any) -> dict[str, Any]:
    """A live actor's process id and Ray node."""
    return {"pid": await actor.pid.remote(), "node": await actor.node_id.remote()}


def actor_class(
    cls: type, bundle: dict[str, float], strategy: Any, concurrency_groups: dict[str, int] | None = None
) -> Any:
    """`cls` as a Ray actor class placed by `strategy` with `bundle`'s resources (and `concurrency_groups`: threads
    for methods called beside the others, e.g. a heartbeat)."""
    remote: Any = ray.remote(cls)
    if concurrency_groups:
        remote = ray.remote(concurrency_groups=concurrency_groups)(cls)  # type: ignore[call-overload]
    return remote.options(
        num_cpus=bundle.get("CPU", 0), num_gpus=bundle.get("GPU", 0), scheduling_strategy=strategy,
        resources={k: v for k, v in bundle.items() if k not in ("CPU", "GPU")},
    )  # fmt: skip


def cpu_sets(cfg: RunConfig, threads: int) -> list[list[int]]:
    """`run.pin_cpus`: the CPUs of each actor, ranks first then engines, each its own consecutive block of the
    cores this process may use (a block of `run.num_threads`, or of one core each when they are not enough)."""
    if hasattr(os, "sched_getaffinity"):
        available = sorted(os.sched_getaffinity(0))
    else:
        available = list(range(os.cpu_count() or 1))
    num_actors = cfg.trainer.num_ranks + cfg.rollout.num_engines
    if len(available) < num_actors:
        raise ValueError(
            f"run.pin_cpus gives each of {num_actors} actors (trainer ranks and engines) cores of its own, but only "
            f"{len(available)} are available; set run.pin_cpus=false or use fewer ranks / engines"
        )
    width = max(1, min(threads, len(available) // num_actors))
    return [available[i * width : (i + 1) * width] for i in range(num_actors)]
