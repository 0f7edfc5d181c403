"""miles-rollout: the embedded rollout engine, its SGLang-compatible HTTP server and the client for both.

- `Engine` / `EngineConfig`: continuous batching over the miles-kernels model, paged KV cache with a radix
  prefix cache, deterministic mode, weight updates and memory release.
- `create_app`: the FastAPI server (`miles-rollout serve`).
- `Client`: async HTTP client for this server or SGLang; `InProcessClient`: the same interface over an
  `Engine` in this process; `CoalescingClient`: either one, with concurrent `/generate` calls sent as one batch.
"""

from miles_rollout.batching import CoalescingClient
from miles_rollout.client import Client, RolloutClientError
from miles_rollout.engine import Engine
from miles_rollout.engine_config import EngineConfig, EngineError
from miles_rollout.in_process import InProcessClient
from miles_rollout.launch import free_port, launch_server
from miles_rollout.server import KEEP_ALIVE_S, create_app

__version__ = "0.1.0"

__all__ = [
    "KEEP_ALIVE_S",
    "Client",
    "CoalescingClient",
    "Engine",
    "EngineConfig",
    "EngineError",
    "InProcessClient",
    "RolloutClientError",
    "create_app",
    "free_port",
    "launch_server",
]
