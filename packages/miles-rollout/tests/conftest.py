"""Shared fixtures for miles-rollout tests: small random models (with a tokenizer) and real server processes."""

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
import pytest

from miles_kernels import build_tokenizer, save_random_model, tiny_config

TEST_PAGE_SIZE = "16"


def make_model(directory: Path, kind: str, seed: int = 0) -> Path:
    tokenizer = build_tokenizer(save_dir=directory)
    config = tiny_config(kind, vocab_size=512, max_position_embeddings=512)
    save_random_model(directory, config, seed=seed, tokenizer=tokenizer)
    return directory


@pytest.fixture(scope="session")
def dense_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_model(tmp_path_factory.mktemp("dense"), "dense")


@pytest.fixture(scope="session")
def moe_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_model(tmp_path_factory.mktemp("moe"), "moe")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@contextlib.contextmanager
def running_server(model_dir: Path, *extra: str, startup_timeout: float = 180.0) -> Iterator[str]:
    """Start `miles-rollout serve` in a subprocess; yield its base URL; stop it (and show its log on failure)."""
    port = free_port()
    log = model_dir.parent / f"server-{port}.log"
    command = [sys.executable, "-m", "miles_rollout.cli", "serve", "--model", str(model_dir), "--port", str(port),
               "--page-size", TEST_PAGE_SIZE, "--kv-pages", "512", *extra]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    with open(log, "w") as out:
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + startup_timeout
    try:
        while True:
            if process.poll() is not None:
                raise RuntimeError(f"server exited with {process.returncode}:\n{log.read_text()}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{url}/health", timeout=1.0).status_code in (200, 401):  # 401: up, needs a key
                    break
            if time.monotonic() > deadline:
                raise RuntimeError(f"server did not become healthy in {startup_timeout}s:\n{log.read_text()}")
            time.sleep(0.3)
        yield url
    finally:
        process.terminate()
        try:
            process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            process.kill()


@pytest.fixture(scope="module")
def dense_server(dense_dir: Path) -> Iterator[str]:
    with running_server(dense_dir, "--deterministic") as url:
        yield url


@pytest.fixture(scope="session")
def start_server():
    """The `running_server` context manager, for tests that need a server with their own flags."""
    return running_server
