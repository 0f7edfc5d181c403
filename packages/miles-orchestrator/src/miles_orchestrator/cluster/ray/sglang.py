"""The Ray actor of an SGLang engine (`rollout.backend=sglang`; docs/laptop-to-cluster.md): it launches an SGLang
server on the GPUs of its placement bundle (Ray sets CUDA_VISIBLE_DEVICES for the actor; the server inherits it)
with the run's settings (`miles_rollout.sglang_launch`), waits until it answers, and stops it with the run. The
driver then talks to it over HTTP with `miles_rollout.Client`, as to an embedded engine: SGLang's API is the one
the embedded server speaks.
"""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

from miles_kernels import KernelConfig
from miles_orchestrator.cluster.ray.actors import node_address, ray_node_id
from miles_rollout import SGLangServer, free_port, launch_command, require_cuda, sglang_server_args
from miles_rollout.config import EngineConfig, SGLangConfig

PORT_ATTEMPTS = 3  # ports tried when the one picked was taken before the server bound it


def _port_taken(server: SGLangServer) -> bool:
    """Whether the server exited because its port was in use (its log says so: uvicorn's, or Python's EADDRINUSE)."""
    tail = server.log_tail().lower()
    return server.process is not None and server.process.poll() is not None and "address already in use" in tail


class SGLangEngineActor:
    """One SGLang server, launched in `__init__` (which returns once `/health` answers; on another port, up to
    `PORT_ATTEMPTS` times, when the one picked was taken before the server bound it), its log and config file in
    `run_dir/engines`. `pid()` is the server's: the process whose death is the engine's."""

    def __init__(
        self, model_dir: str, kernel: KernelConfig, engine: EngineConfig, sglang: SGLangConfig, admin_key: str,
        host: str, memory_saver: bool, run_dir: str,
    ) -> None:  # fmt: skip
        command = launch_command(sglang)
        if sglang.launch_command is None:
            require_cuda()
        for attempt in range(1, PORT_ATTEMPTS + 1):
            port = free_port()  # free when picked; another process may bind it before the server does
            args = sglang_server_args(
                model_dir, kernel, engine, sglang, host=host, port=port, admin_key=admin_key, memory_saver=memory_saver
            )
            self.server = SGLangServer(command, args, Path(run_dir) / "engines")
            self.server.start()
            try:
                asyncio.run(self.server.wait_healthy(sglang.startup_timeout_s))
                break
            except BaseException as error:
                self.server.stop(timeout=10)
                if attempt == PORT_ATTEMPTS or not isinstance(error, RuntimeError) or not _port_taken(self.server):
                    raise
        self.url = f"http://{node_address(host)}:{port}"

    def get_url(self) -> str:
        return self.url

    def pid(self) -> int:
        assert self.server.process is not None
        return self.server.process.pid

    def node_id(self) -> str:
        return ray_node_id()

    def actor_pid(self) -> int:
        return os.getpid()

    def shutdown(self) -> None:
        self.server.stop()
