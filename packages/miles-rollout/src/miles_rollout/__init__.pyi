"""Types of the lazily loaded public API (lazy_loader reads the imports below; see __init__.py)."""

from .batching import CoalescingClient
from .client import Client, RolloutClientError
from .config import EngineConfig, ServeConfig
from .engine import Engine
from .engine_error import EngineError
from .in_process import InProcessClient
from .launch import ROUTER_POLICIES, free_port, launch_server, router_command
from .profiling import ProfileRequest, TraceRecorder
from .server import KEEP_ALIVE_S, create_app
from .sglang_launch import SGLangServer, launch_command, require_cuda, sglang_server_args, write_server_config

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
    "ProfileRequest",
    "RolloutClientError",
    "SGLangServer",
    "ServeConfig",
    "TraceRecorder",
    "create_app",
    "free_port",
    "launch_command",
    "launch_server",
    "require_cuda",
    "router_command",
    "sglang_server_args",
    "write_server_config",
]
