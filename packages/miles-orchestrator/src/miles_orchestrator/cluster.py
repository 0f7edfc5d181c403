"""Ray placement for a run: a local Ray (or an existing cluster), one placement group holding the trainer ranks
and the rollout engine, and the calls the loop makes on them.

Colocated (the default on one machine): the engine and the trainer share the machine and take turns. While the
trainer works the engine has released its KV cache and weights (`/release_memory_occupation`); while the engine
works the trainer has offloaded parameters, gradients and optimizer state (`FSDP2Backend.offload`). Every call to
the trainer goes to all ranks at once (their work is collective).
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import secrets
import shutil
import tempfile
from pathlib import Path
from typing import Any

# Under `uv run`, Ray would rebuild the uv environment for every worker from the current directory (and refuse to
# start outside the project). Workers run the driver's own interpreter and venv instead. Read when ray is imported.
os.environ.setdefault("RAY_ENABLE_UV_RUN_RUNTIME_ENV", "0")

import ray
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from miles_contracts import Sample
from miles_orchestrator.actors import RolloutEngineActor, TrainerRankActor
from miles_orchestrator.config import RunConfig


def start_ray(address: str | None, run_dir: Path, num_cpus: int) -> None:
    """Connect to `address`, or start a local Ray for this run (dashboard off, temp files in a short dir)."""
    if ray.is_initialized():
        return
    if address:
        ray.init(address=address, log_to_driver=False)
        return
    # Ray's unix sockets need a short path: keep its temp dir under the run dir only when that is short.
    temp = run_dir.resolve() / "ray"
    if len(str(temp)) > 60:
        temp = Path(tempfile.mkdtemp(prefix="miles-ray-"))
    ray.init(num_cpus=num_cpus, include_dashboard=False, _temp_dir=str(temp), log_to_driver=False,
             configure_logging=False)  # fmt: skip


class Cluster:
    """The engine actor, the trainer rank actors and their placement group."""

    def __init__(self, cfg: RunConfig, model_dir: str, run_dir: Path) -> None:
        num_ranks = cfg.trainer.num_ranks
        num_cpus = cfg.run.num_threads or os.cpu_count() or 1
        start_ray(cfg.run.ray_address, run_dir, max(num_cpus, num_ranks + 1))
        self.admin_key = secrets.token_hex(16)
        self.group = placement_group([{"CPU": 1}] * (num_ranks + 1), strategy="PACK")
        ray.get(self.group.ready(), timeout=120)
        kernel = _kernel(cfg)

        def place(index: int) -> PlacementGroupSchedulingStrategy:
            return PlacementGroupSchedulingStrategy(self.group, placement_group_bundle_index=index)

        engine_options = {
            "num_kv_pages": cfg.rollout.num_kv_pages,
            "max_running_requests": cfg.rollout.max_running_requests,
            "seed": cfg.run.seed,
        }
        self.engine: Any = (
            ray.remote(RolloutEngineActor)
            .options(num_cpus=1, scheduling_strategy=place(num_ranks))
            .remote(model_dir, kernel, engine_options, self.admin_key, num_cpus)
        )
        self.trainers: list[Any] = [
            ray.remote(TrainerRankActor)
            .options(num_cpus=1, scheduling_strategy=place(rank))
            .remote(rank, num_ranks, max(1, num_cpus // num_ranks))
            for rank in range(num_ranks)
        ]
        master = ray.get(self.trainers[0].address.remote())
        options = _trainer_options(cfg, run_dir)
        fingerprints = self._all("setup", master, model_dir, kernel, options)
        self.trainer_fingerprint = fingerprints[0]
        self.url = str(ray.get(self.engine.get_url.remote()))  # type: ignore[attr-defined]
        engine_node = ray.get(self.engine.node_id.remote())  # type: ignore[attr-defined]
        same_node = engine_node == ray.get(self.trainers[0].node_id.remote())
        self.sync_dir = shared_sync_dir(cfg.run.sync_transport, run_dir, same_node, _checkpoint_bytes(model_dir))

    def _all(self, method: str, *args: Any) -> list[Any]:
        return ray.get([getattr(t, method).remote(*args) for t in self.trainers])

    def train(
        self,
        samples: list[Sample],
        advantages: list[list[float]],
        old_logprobs: list[list[float]] | None,
        measure: bool,
    ) -> dict[str, float]:
        """One optimizer step on `samples` (rank r takes samples r, r + R, ...); metrics are global."""
        world = len(self.trainers)
        refs = [
            trainer.train.remote(
                [s.model_dump(mode="json") for s in samples[rank::world]],
                advantages[rank::world],
                None if old_logprobs is None else old_logprobs[rank::world],
                measure,
            )
            for rank, trainer in enumerate(self.trainers)
        ]
        result: dict[str, float] = ray.get(refs)[0]
        return result

    def compute_logprobs(self, samples: list[Sample]) -> list[list[float]]:
        world = len(self.trainers)
        shares = self._all_sharded("compute_logprobs", [[s.model_dump(mode="json") for s in samples[r::world]]
                                                        for r in range(world)])  # fmt: skip
        out: list[list[float]] = [[] for _ in samples]
        for rank, share in enumerate(shares):
            out[rank::world] = share
        return out

    def _all_sharded(self, method: str, per_rank: list[Any]) -> list[Any]:
        return ray.get([getattr(t, method).remote(arg) for t, arg in zip(self.trainers, per_rank, strict=True)])

    def sync_weights(self, version: int, bucket_bytes: int) -> dict[str, Any]:
        directory = None if self.sync_dir is None else str(self.sync_dir)
        results = self._all("sync_weights", self.url, self.admin_key, version, bucket_bytes, directory)
        result: dict[str, Any] = results[0]
        return result

    def trainer_checksum(self) -> str:
        result: str = self._all("weights_checksum")[0]
        return result

    def offload_trainer(self) -> int:
        return sum(self._all("offload"))

    def onload_trainer(self) -> int:
        return sum(self._all("onload"))

    def save(self, directory: Path, extra: dict[str, Any]) -> None:
        self._all("save", str(directory), extra)

    def load(self, directory: Path) -> dict[str, Any]:
        result: dict[str, Any] = self._all("load", str(directory))[0]
        return result

    def export(self, directory: Path, tokenizer_dir: str) -> None:
        self._all("export", str(directory), tokenizer_dir)

    def shutdown(self) -> None:
        with contextlib.suppress(Exception):  # the engine may be gone already; never mask the run's own error
            ray.get(self.engine.shutdown.remote(), timeout=30)
        for actor in [self.engine, *self.trainers]:
            ray.kill(actor)
        remove_placement_group(self.group)
        if self.sync_dir is not None:
            shutil.rmtree(self.sync_dir, ignore_errors=True)


SHARED_MEMORY = Path("/dev/shm")
SHM_SYNC_MAX_BYTES = 1 << 30  # `auto` syncs through shared memory up to this checkpoint size (one copy in RAM)


def shared_sync_dir(transport: str, run_dir: Path, same_node: bool, weight_bytes: int) -> Path | None:
    """Where weight syncs go through shared memory, or None for buckets over HTTP (`run.sync_transport`).

    The directory is named after the run dir, so a resumed run reuses (and a finished run removes) the same one.
    """
    usable = same_node and SHARED_MEMORY.is_dir() and os.access(SHARED_MEMORY, os.W_OK)
    if transport == "shm" and not usable:
        raise ValueError(
            "run.sync_transport=shm needs the engine on trainer rank 0's node and a writable /dev/shm; "
            "use run.sync_transport=http (or auto)"
        )
    if transport == "http" or (transport == "auto" and (not usable or weight_bytes > SHM_SYNC_MAX_BYTES)):
        return None
    directory = SHARED_MEMORY / f"miles-sync-{hashlib.sha256(str(run_dir.resolve()).encode()).hexdigest()[:16]}"
    directory.mkdir(exist_ok=True)
    return directory


def _checkpoint_bytes(model_dir: str) -> int:
    return sum(f.stat().st_size for f in Path(model_dir).glob("*.safetensors"))


def _kernel(cfg: RunConfig) -> dict[str, Any]:
    return {"mode": "deterministic" if cfg.rollout.deterministic else "fast", "dtype": cfg.trainer.dtype}


def _trainer_options(cfg: RunConfig, run_dir: Path) -> dict[str, Any]:
    t = cfg.trainer
    return {
        "optimizer": {"lr": t.lr, "weight_decay": t.weight_decay, "warmup_steps": t.warmup_steps,
                      "schedule": t.lr_schedule, "max_grad_norm": t.max_grad_norm,
                      "total_steps": cfg.run.num_steps * t.steps_per_rollout},
        "loss": {"clip_low": t.clip_low, "clip_high": t.clip_high, "dual_clip": t.dual_clip,
                 "ratio_type": t.ratio_type, "agg_mode": t.agg_mode, "temperature": cfg.rollout.temperature,
                 "entropy_coef": t.entropy_coef, "kl_coef": t.kl_coef, "kl_estimator": t.kl_estimator,
                 "is_mode": t.is_mode, "loss_fn": t.loss_fn},
        "max_tokens_per_micro_batch": t.max_tokens_per_micro_batch,
        "activation_checkpointing": t.activation_checkpointing,
        "offload_dir": str(run_dir / "offload"),
    }  # fmt: skip
