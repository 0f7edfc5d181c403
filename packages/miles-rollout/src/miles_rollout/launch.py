"""Start `miles-rollout serve` as a subprocess and wait until it answers: for tests, benchmarks and callers
that run engines out of process. The server log goes to a file, shown in the error if start-up fails.
`router_command` is the sglang-router command line that `serve --dp-size` and the orchestrator put in front of
several engines."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@contextlib.contextmanager
def launch_server(
    model_dir: str | os.PathLike[str],
    *flags: str,
    port: int | None = None,
    log_path: str | os.PathLike[str] | None = None,
    env: dict[str, str] | None = None,
    startup_timeout: float = 180.0,
    api_key: str | None = None,
    admin_key: str | None = None,
) -> Iterator[str]:
    """Run `miles-rollout serve --model-path DIR --port PORT FLAGS...`; yield its base URL; stop it on exit.
    `api_key` / `admin_key` reach the server in its environment (`MILES_API_KEY`, `MILES_ADMIN_KEY`), off its
    command line."""
    port = port or free_port()
    keys = {"MILES_API_KEY": api_key, "MILES_ADMIN_KEY": admin_key}
    env = {**(env or {}), **{name: key for name, key in keys.items() if key is not None}}
    log = Path(log_path) if log_path else Path(model_dir).parent / f"miles-rollout-{port}.log"
    command = [sys.executable, "-m", "miles_rollout.cli", "serve", "--model-path", str(model_dir), "--port", str(port),
               *flags]  # fmt: skip
    with open(log, "w") as out:
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env={**os.environ, **env})
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + startup_timeout
    try:
        while True:
            if process.poll() is not None:
                raise RuntimeError(f"miles-rollout serve exited with {process.returncode}:\n{log.read_text()}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{url}/health", timeout=1.0).status_code in (200, 401):  # 401: up, needs a key
                    break
            if time.monotonic() > deadline:
                raise RuntimeError(f"miles-rollout serve not healthy after {startup_timeout}s:\n{log.read_text()}")
            time.sleep(0.3)
        yield url
    finally:
        process.terminate()
        try:
            process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            process.kill()


ROUTER_POLICIES = ("cache_aware", "round_robin", "random", "power_of_two")


def router_command(
    worker_urls: list[str], host: str, port: int, policy: str = "cache_aware", log_level: str = "warning"
) -> list[str]:
    """The command line of sglang-router (`pip install sglang-router`, the router SGLang and slime deploy) in
    front of `worker_urls`, listening on host:port with `policy` (cache_aware: a prompt goes to the engine that
    caches the longest prefix of it), its Prometheus exporter on a free loopback port."""
    if policy not in ROUTER_POLICIES:
        raise ValueError(f"unknown router policy {policy!r}; use one of {list(ROUTER_POLICIES)}")
    level = "warn" if log_level == "warning" else log_level  # the router's spelling
    return [sys.executable, "-m", "sglang_router.launch_router", "--worker-urls", *worker_urls, "--host", host,
            "--port", str(port), "--policy", policy, "--prometheus-host", "127.0.0.1",
            "--prometheus-port", str(free_port()), "--log-level", level]  # fmt: skip
