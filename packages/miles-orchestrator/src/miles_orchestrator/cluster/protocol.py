"""The cluster interface the loop talks to (`Cluster`, the engine client it hands out) and the data that crosses it."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from miles_contracts import Sample, WeightVersion


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
        """How weights reach the engine, for the log: its `WeightTransport`'s description (transport/)."""

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
    async def start_profile(self, directory: Path) -> None:
        """torch.profiler traces of the trainer ranks and the engines into `directory`, until `stop_profile`."""

    async def stop_profile(self) -> None: ...
    async def trainer_digests(self) -> dict[str, str]:
        """{HF name: sha256} of each of the trainer's weights in its own dtype (`WeightSender.digests`)."""

    async def offload_trainer(self, room_for: int | None = None) -> int: ...
    async def onload_trainer(self) -> int: ...
    async def save(self, directory: Path, extra: dict[str, Any]) -> None: ...
    async def load(self, directory: Path) -> dict[str, Any]: ...
    async def export(self, directory: Path, tokenizer_dir: str) -> None: ...
    async def shutdown(self) -> None: ...
    def fault_metrics(self) -> dict[str, float]:
        """Engine restarts since the last call (`engine_restarts`, `engine_recovery_s`, `engine_calls_reissued`;
        cluster/ray/engine_health.py)."""


@dataclass(frozen=True)
class CriticTargets:
    """What trains PPO's critic on a batch: GAE's returns and the values the critic gave (one list per sample)."""

    returns: list[list[float]]
    old_values: list[list[float]]

    def part(self, rows: slice) -> CriticTargets:
        return CriticTargets(self.returns[rows], self.old_values[rows])


class EngineFailed(RuntimeError):
    """The engines failed more often than the run allows, or a restart itself failed: the run stops."""
