"""Worker processes for user code: the reward functions (rewards.py) and the environments of agentic rollouts
(env_pool.py) run in spawned processes the orchestrator can kill, so a crash or a hang costs one call, never the
run. Messages cross the pipe as JSON bytes (`send_bytes` / `recv_bytes`), never as pickles.

A worker's target gets its end of the pipe, sends `{"ready": true}` once it has imported what it runs (or
`{"error": ...}` if it cannot), then answers requests until the pipe closes.
"""

from __future__ import annotations

import json
import multiprocessing
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection
from multiprocessing.context import ForkServerContext, SpawnContext
from multiprocessing.process import BaseProcess
from typing import Any, Literal

STARTUP_TIMEOUT_S = 120.0  # a spawned worker imports pydantic and the user's module before it is ready


@dataclass
class Worker:
    """One worker process and the parent's end of its pipe."""

    process: BaseProcess
    conn: Connection


StartMethod = Literal["spawn", "forkserver"]


def spawn_worker(
    target: Callable[..., None], args: tuple[Any, ...], name: str, start_method: StartMethod = "spawn"
) -> Worker:
    """Start `target(conn, *args)` in a fresh process (not yet waited for: start several, then `wait_ready` each,
    so their imports overlap)."""
    context: SpawnContext | ForkServerContext = (
        multiprocessing.get_context("spawn") if start_method == "spawn" else multiprocessing.get_context("forkserver")
    )
    parent, child = context.Pipe()
    process = context.Process(target=target, args=(child, *args), name=name, daemon=True)
    process.start()
    child.close()
    return Worker(process, parent)


def wait_ready(worker: Worker, what: str) -> Worker:
    """The worker once it said it is ready; a RuntimeError (the worker stopped) if it failed to start."""
    ready = worker.conn.poll(STARTUP_TIMEOUT_S)
    try:
        reply = json.loads(worker.conn.recv_bytes()) if ready else {"error": "no answer"}
    except (EOFError, OSError):
        reply = {"error": f"exited with code {worker.process.exitcode}"}
    if "error" in reply:
        stop_worker(worker)
        raise RuntimeError(f"{what} failed to start: {reply['error']}")
    return worker


def stop_worker(worker: Worker) -> None:
    """Close the pipe (a waiting worker sees EOF and exits) and kill the worker if it is still busy."""
    worker.conn.close()
    worker.process.join(timeout=0.5)
    if worker.process.is_alive():
        worker.process.kill()
        worker.process.join(timeout=5)


def exit_code(worker: Worker) -> int | None:
    """The exit code of a worker whose pipe just closed (the pipe closes a moment before the code is known)."""
    worker.process.join(timeout=1.0)
    return worker.process.exitcode
