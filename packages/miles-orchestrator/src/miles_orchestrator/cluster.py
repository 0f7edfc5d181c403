"""The cluster interface: where the rollout engine and the trainer ranks run, and the calls the loop makes on them.

`run_training` (loop.py) talks to a `Cluster` and never knows which one it runs on (docs/architecture.md, "Cluster"):
- `RayCluster` (ray_cluster.py, `run.cluster=ray`, the default): the engine and each trainer rank are Ray actors
  in one placement group, on a local Ray or an existing cluster; the loop reaches the engine over HTTP with
  `miles_rollout.Client`, exactly as it would a standalone `miles-rollout serve` or an SGLang server.
- `LocalCluster` (local_cluster.py, `run.cluster=local`): the engine and one trainer rank in the driver process,
  no Ray and no HTTP; the loop reaches the engine with `miles_rollout.InProcessClient`.

Colocated (`run.colocate`, the default): engine and trainer take turns. While the trainer works the engine has
released its KV cache and weights (`release_memory_occupation`); while the engine works the trainer has offloaded
parameters and optimizer state (`FSDP2Backend.offload`). Every trainer call goes to all ranks at once.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from miles_contracts import Sample, WeightVersion
from miles_kernels.config import KernelConfig
from miles_memory.config import MemoryConfig
from miles_orchestrator.config import RunConfig
from miles_spec.config import SpecConfig
from miles_trainer.config import BackendConfig, CriticConfig, OptimizerConfig, PolicyLossConfig


class EngineClient(Protocol):
    """What the loop asks of the engine: `miles_rollout.Client` over HTTP, or `InProcessClient`."""

    async def generate(self, request: Any) -> Any: ...
    async def release_memory_occupation(self, tags: list[str] | None = None) -> dict[str, Any]: ...
    async def resume_memory_occupation(self, tags: list[str] | None = None) -> dict[str, Any]: ...
    async def get_server_info(self) -> dict[str, Any]: ...
    async def weights_checksum(self) -> str: ...
    async def get_weight_version(self) -> WeightVersion: ...
    async def pause_generation(self, mode: str) -> Any: ...
    async def continue_generation(self) -> Any: ...


class Cluster(Protocol):
    """The engine (through `engine`, the loop's one client of it) and the trainer ranks (collective calls)."""

    @property
    def engine(self) -> EngineClient: ...
    @property
    def trainer_fingerprint(self) -> str:
        """The trainer's `KernelConfig.fingerprint` on its device."""

    @property
    def sync_method(self) -> str:
        """How weights reach the engine, for the log."""

    async def train(
        self, samples: list[Sample], advantages: list[list[float]], old_logprobs: list[list[float]] | None,
        measure: bool, critic: CriticTargets | None = None,
    ) -> dict[str, float]:  # fmt: skip
        """One optimizer step on `samples` (rank r takes samples r, r + R, ...); metrics are global. `critic`:
        PPO's value targets, which train the critic in the same call."""

    async def compute_logprobs(self, samples: list[Sample]) -> list[list[float]]:
        """The trainer's log-probs of each sample's response tokens (fast mode's old log-probs)."""

    async def compute_values(self, samples: list[Sample]) -> list[list[float]]:
        """The critic's value of each sample's response tokens (PPO)."""

    async def sync_weights(self, version: int, bucket_bytes: int) -> dict[str, Any]:
        """The trainer's weights to the engine as `version` (the engine's memory must be resumed)."""

    async def trainer_checksum(self) -> str: ...
    async def offload_trainer(self, room_for: int | None = None) -> int: ...
    async def onload_trainer(self) -> int: ...
    async def save(self, directory: Path, extra: dict[str, Any]) -> None: ...
    async def load(self, directory: Path) -> dict[str, Any]: ...
    async def export(self, directory: Path, tokenizer_dir: str) -> None: ...
    async def shutdown(self) -> None: ...
    def fault_metrics(self) -> dict[str, float]:
        """Engine restarts since the last call (`engine_restarts`, `engine_recovery_s`, `engine_calls_reissued`;
        engine_health.py)."""


@dataclass(frozen=True)
class CriticTargets:
    """What trains PPO's critic on a batch: GAE's returns and the values the critic gave (one list per sample)."""

    returns: list[list[float]]
    old_values: list[list[float]]

    def part(self, rows: slice) -> CriticTargets:
        return CriticTargets(self.returns[rows], self.old_values[rows])


@dataclass(frozen=True)
class TrainerSettings:
    """Everything a trainer rank is built from, resolved from the run config (the same on every cluster)."""

    kernel: KernelConfig
    optimizer: OptimizerConfig
    loss: PolicyLossConfig
    backend: BackendConfig
    offload_dir: str
    critic: CriticConfig | None = None
    spec: SpecConfig | None = None  # the MTP draft trains online (spec.mode=online)
    keep_reference: bool = False  # trainer.log_kl: the initial policy stays, for the kl metric
    memory: MemoryConfig = field(default_factory=MemoryConfig)  # offload target, budget, OOM handling
    routing_replay: bool = False  # trainer.routing_replay=rollout: MoE layers route as the engine recorded


def trainer_settings(cfg: RunConfig, run_dir: Path) -> TrainerSettings:
    """The trainer's models from the run config; an optimizer with no `total_steps` spans the whole run."""
    total = cfg.run.num_steps * cfg.trainer.steps_per_rollout

    def spanning(optimizer: OptimizerConfig) -> OptimizerConfig:
        return optimizer if optimizer.total_steps is not None else optimizer.model_copy(update={"total_steps": total})

    critic = None
    if cfg.trainer.uses_critic:
        critic = cfg.trainer.critic.model_copy(update={"optimizer": spanning(cfg.trainer.critic.optimizer)})
    spec = None
    if cfg.spec.mode == "online":
        spec = cfg.spec.model_copy(update={"optimizer": spanning(cfg.spec.optimizer)})
    return TrainerSettings(cfg.kernel, spanning(cfg.trainer.optimizer), cfg.trainer.loss, cfg.trainer.backend,
                           str(run_dir / "offload"), critic, spec, cfg.trainer.log_kl, cfg.memory,
                           cfg.trainer.routing_replay == "rollout")  # fmt: skip


def num_threads(cfg: RunConfig) -> int:
    """torch threads of the engine and of the trainer (`run.num_threads`, else the machine's CPU count)."""
    return cfg.run.num_threads or os.cpu_count() or 1


async def start_cluster(cfg: RunConfig, model_dir: str, run_dir: Path, log: Callable[[str], None] = print) -> Cluster:
    """The cluster `run.cluster` names, started: engine up, trainer ranks set up; `log` gets its events (engine
    restarts)."""
    if cfg.run.cluster == "local":
        from miles_orchestrator.local_cluster import LocalCluster

        return await LocalCluster.start(cfg, model_dir, run_dir)
    from miles_orchestrator.ray_cluster import RayCluster

    return await RayCluster.start(cfg, model_dir, run_dir, log)
