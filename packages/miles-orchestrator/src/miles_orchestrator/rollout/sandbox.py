"""Worker processes for user code: the reward functions (reward/pool.py) and the environments of agentic rollouts
(env_pool.py) run in processes the orchestrator can kill, so a crash or a hang costs one call, never the run.
Messages cross the pipe as JSON bytes (`send_bytes` / `recv_bytes`), never as pickles.

A worker's target gets its end of the pipe, sends `{"ready": true}` once it has imported what it runs (or
`{"error": ...}` if it cannot), then answers requests until the pipe closes. Two ways to start one:

- `spawn_worker`: a multiprocessing child with the driver's environment (the reward pool: a reward may need the
  driver's keys, as an LLM judge does).
- `spawn_sandboxed`: a fresh interpreter with an allow-listed environment (`ALLOWED_ENV`, plus the names
  `Limits.env_passthrough` gives) and rlimits (`Limits`) set before it imports user code (the environment pool:
  its tools run what a model asks for).

Either way a worker leads its own process group, and `stop_worker` (on a timeout, a crash, or the pool's close)
kills the whole group: the processes a tool started (a `subprocess.Popen`, a shell's background job) die with it.
This is fault isolation, not a security boundary: the worker runs as the driver's user (docs/agentic.md, "Sandbox
and failures").
"""

from __future__ import annotations

import contextlib
import json
import math
import multiprocessing
import os
import resource
import signal
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from importlib import import_module
from multiprocessing.connection import Connection
from multiprocessing.context import ForkServerContext, SpawnContext
from multiprocessing.process import BaseProcess
from typing import Any, Literal

STARTUP_TIMEOUT_S = 120.0  # a spawned worker imports pydantic and the user's module before it is ready
GiB = 1 << 30
# What a sandboxed worker sees of the driver's environment (and every LC_*): enough to find programs, a home, a
# locale, a temporary folder and the driver's Python packages; never its keys and tokens.
ALLOWED_ENV = ("PATH", "HOME", "USER", "LOGNAME", "LANG", "TZ", "TMPDIR", "PYTHONPATH", "VIRTUAL_ENV")


@dataclass(frozen=True)
class Limits:
    """What a sandboxed worker may use. The defaults are far beyond what a tool call needs: they stop a runaway
    tool (a memory hog, a CPU runaway, a file-descriptor leak), not a normal one."""

    cpu_s_per_call: float | None = None
    """CPU seconds (all threads) one call may use, RLIMIT_CPU renewed before every call; past it the kernel kills
    the worker (SIGXCPU). None: the call's timeout x the machine's cores, which no call reaches before its
    wall-clock timeout; it still bounds a process that escapes the kill (one that left the process group)."""
    address_space_bytes: int = 16 * GiB
    """RLIMIT_AS: an allocation past it raises MemoryError in the tool (importing torch alone maps about 3 GiB)."""
    num_open_files: int = 1024
    """RLIMIT_NOFILE."""
    env_passthrough: tuple[str, ...] = ()
    """Names of the driver's environment variables a worker sees besides ALLOWED_ENV (e.g. HF_HOME)."""

    def __post_init__(self) -> None:
        if self.cpu_s_per_call is not None and self.cpu_s_per_call <= 0:
            raise ValueError(f"cpu_s_per_call={self.cpu_s_per_call}: must be positive (or None for the default)")
        if self.address_space_bytes < GiB or self.num_open_files < 64:
            raise ValueError(
                f"address_space_bytes={self.address_space_bytes}, num_open_files={self.num_open_files}: a Python "
                "worker needs at least 1 GiB and 64 files"
            )
        bad = [name for name in self.env_passthrough if not name or "=" in name]
        if bad:
            raise ValueError(f"env_passthrough={list(self.env_passthrough)}: {bad} are not variable names")

    def cpu_s(self, timeout_s: float) -> float:
        """The CPU seconds a call under `timeout_s` may use."""
        return self.cpu_s_per_call if self.cpu_s_per_call is not None else timeout_s * (os.cpu_count() or 1)

    def environment(self) -> dict[str, str]:
        """The driver's environment, cut to what a sandboxed worker sees."""
        names = {*ALLOWED_ENV, *self.env_passthrough}
        return {k: v for k, v in os.environ.items() if k in names or k.startswith("LC_")}


@dataclass
class Worker:
    """One worker process (the leader of its own process group) and the parent's end of its pipe."""

    process: BaseProcess | subprocess.Popen[bytes]
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
    process = context.Process(target=_in_own_session, args=(child, target, *args), name=name, daemon=True)
    process.start()
    child.close()
    return Worker(process, parent)


def spawn_sandboxed(
    target: Callable[..., None], args: tuple[Any, ...], name: str, limits: Limits, cpu_s: float
) -> Worker:
    """Start `target(conn, *args)` (a module-level function; `args` JSON values) in a fresh interpreter in a new
    session, with `limits.environment()` and `limits`' rlimits (`cpu_s` CPU seconds until the target renews them
    with `renew_cpu_limit`). Not yet waited for, as `spawn_worker`."""
    # Everything but the pipe's number goes over the pipe, not the command line (which `ps` shows): env_args may
    # hold a tool's settings. Encoded first: arguments that are not JSON fail here, before a process starts.
    start = json.dumps({
        "sys_path": sys.path,  # the driver's, as multiprocessing gives a spawned child: the user's modules import
        "target": f"{target.__module__}:{target.__qualname__}",
        "args": list(args),
        "rlimits": {"cpu_s": cpu_s, "address_space_bytes": limits.address_space_bytes,
                    "num_open_files": limits.num_open_files},
    }).encode()  # fmt: skip
    parent, child = multiprocessing.Pipe()
    process = subprocess.Popen(
        [sys.executable, "-c", _BOOTSTRAP, str(child.fileno()), name],  # the name shows in `ps`
        env=limits.environment(), pass_fds=[child.fileno()], stdin=subprocess.DEVNULL, start_new_session=True,
    )  # fmt: skip
    child.close()
    with contextlib.suppress(OSError):  # a child that died at once: wait_ready reports its exit code
        parent.send_bytes(start)
    return Worker(process, parent)


def wait_ready(worker: Worker, what: str) -> Worker:
    """The worker once it said it is ready; a RuntimeError (the worker stopped) if it failed to start."""
    ready = worker.conn.poll(STARTUP_TIMEOUT_S)
    try:
        reply = json.loads(worker.conn.recv_bytes()) if ready else {"error": "no answer"}
    except (EOFError, OSError):
        reply = {"error": f"exited with code {exit_code(worker)}"}
    if "error" in reply:
        stop_worker(worker)
        raise RuntimeError(f"{what} failed to start: {reply['error']}")
    return worker


def stop_worker(worker: Worker) -> None:
    """Close the pipe (a waiting worker sees EOF and exits), then kill the worker's process group: the worker if it
    is still busy, and whatever it started, even after it exited itself."""
    worker.conn.close()
    _join(worker, 0.5)
    pid = worker.process.pid
    assert pid is not None, "a started process has a pid"
    try:
        os.killpg(pid, signal.SIGKILL)
    except ProcessLookupError:  # the group is empty, or a spawn_worker child had not made its own yet
        worker.process.kill()  # a no-op once the worker was reaped: never signals a reused pid
    except PermissionError:  # only members that changed user are left (a setuid program)
        pass
    _join(worker, 5)


def exit_code(worker: Worker) -> int | None:
    """The exit code of a worker whose pipe just closed (the pipe closes a moment before the code is known);
    minus the signal's number when a signal killed it (-24: SIGXCPU, past its CPU limit)."""
    return _join(worker, 1.0)


def renew_cpu_limit(cpu_s: float) -> None:
    """Let the calling process use `cpu_s` more CPU seconds. RLIMIT_CPU caps a process's lifetime total, so a
    long-lived worker renews it before each call; the hard limit stays, so it can."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    soft = math.ceil(usage.ru_utime + usage.ru_stime + cpu_s)
    _, hard = resource.getrlimit(resource.RLIMIT_CPU)
    resource.setrlimit(resource.RLIMIT_CPU, (soft if hard == resource.RLIM_INFINITY else min(soft, hard), hard))


def _join(worker: Worker, timeout: float) -> int | None:
    process = worker.process
    if isinstance(process, subprocess.Popen):
        with contextlib.suppress(subprocess.TimeoutExpired):
            process.wait(timeout)
        return process.returncode
    process.join(timeout)
    return process.exitcode


def _in_own_session(conn: Connection, target: Callable[..., None], *args: Any) -> None:
    """A spawn_worker child: lead a new session (and process group) before running the target."""
    os.setsid()
    target(conn, *args)


# A sandboxed child's first lines, standard library only: the driver's sys.path comes first, then this module.
_BOOTSTRAP = """\
import json, sys
from multiprocessing.connection import Connection
conn = Connection(int(sys.argv[1]))
start = json.loads(conn.recv_bytes())
sys.path[:] = start["sys_path"]
from miles_orchestrator.rollout.sandbox import _sandboxed_main
_sandboxed_main(conn, start)
"""


def _sandboxed_main(conn: Connection, start: dict[str, Any]) -> None:
    """A spawn_sandboxed child: set the rlimits, then import and run the target (user code only runs after). The
    child sets them itself, not a `preexec_fn`, which is unsafe in the threaded driver that starts workers."""
    rlimits = start["rlimits"]
    renew_cpu_limit(rlimits["cpu_s"])
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    for kind, value in ((resource.RLIMIT_AS, rlimits["address_space_bytes"]),
                        (resource.RLIMIT_NOFILE, rlimits["num_open_files"])):  # fmt: skip
        _, hard = resource.getrlimit(kind)
        value = value if hard == resource.RLIM_INFINITY else min(value, hard)
        resource.setrlimit(kind, (value, value))  # the hard limit too: the tool cannot raise it back
    module, _, qualname = start["target"].partition(":")
    getattr(import_module(module), qualname)(conn, *start["args"])
