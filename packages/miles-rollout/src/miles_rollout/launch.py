"""Start `miles-rollout serve` as a subprocess and wait until it answers: for tests, benchmarks and callers
that run engines out of process. The server log goes to a file, shown in the error if start-up fails."""

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
) -> Iterator[str]:
    """Run `miles-rollout serve --model-path DIR --port PORT FLAGS...`; yield its base URL; stop it on exit."""
    port = port or free_port()
    log = Path(log_path) if log_path else Path(model_dir).parent / f"miles-rollout-{port}.log"
    command = [sys.executable, "-m", "miles_rollout.cli", "serve", "--model-path", str(model_dir), "--port", str(port),
               *flags]  # fmt: skip
    with open(log, "w") as out:
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})})
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
