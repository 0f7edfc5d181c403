"""`EngineConfig` (how the engine runs: the `miles-rollout serve` flags) and `EngineError` (a request the
engine refuses, with the HTTP status the server answers)."""

from __future__ import annotations

from dataclasses import dataclass, field

from miles_kernels import KernelConfig


class EngineError(Exception):
    """A request the engine cannot serve; `status_code` is the HTTP status the server answers with."""

    def __init__(self, message: str, status_code: int = 400) -> None:
        super().__init__(message)
        self.message = message
        self.status_code = status_code


@dataclass(frozen=True)
class EngineConfig:
    """How the engine runs (the `miles-rollout serve` flags)."""

    model_path: str
    kernel: KernelConfig = field(default_factory=KernelConfig)
    num_kv_pages: int = 1024
    max_running_requests: int = 256
    max_prefill_tokens: int = 2048
    context_length: int | None = None
    device: str = "cpu"
    seed: int = 0
