"""Types of the lazily loaded public API (lazy_loader reads the imports below; see __init__.py)."""

from .batching import CoalescingClient
from .client import Client, RolloutClientError
from .config import EngineConfig, ServeConfig
from .engine import Engine
from .engine_error import EngineError
from .in_process import InProcessClient
from .launch import ROUTER_POLICIES, free_port, launch_server, router_command
from .server import KEEP_ALIVE_S, create_app

__version__: str

__all__ = [
    "KEEP_ALIVE_S",
    "ROUTER_POLICIES",
    "Client",
    "CoalescingClient",
    "Engine",
    "EngineConfig",
    "EngineError",
    "InProcessClient",
    "RolloutClientError",
    "ServeConfig",
    "create_app",
    "free_port",
    "launch_server",
    "router_command",
]
