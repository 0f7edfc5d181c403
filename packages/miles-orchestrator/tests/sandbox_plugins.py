"""The plug-ins test_sandbox.py runs in sandboxed workers (loaded by path, with this folder on `sys.path`): a tool
environment whose tools report what the worker sees, or misbehave as runaway tools do."""

from __future__ import annotations

import json
import os
import resource
import subprocess
import time
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any

from miles_orchestrator.rollout.environments import ToolEnv

RLIMITS = {"cpu": resource.RLIMIT_CPU, "as": resource.RLIMIT_AS, "nofile": resource.RLIMIT_NOFILE,
           "core": resource.RLIMIT_CORE}  # fmt: skip


def environ() -> str:
    """The worker's environment: os.environ, and the block the kernel keeps (/proc/self/environ)."""
    with open("/proc/self/environ", "rb") as f:
        block = f.read().decode(errors="replace")
    return json.dumps({"os_environ": dict(os.environ), "proc_environ": block})


def rlimits() -> str:
    """The worker's (soft, hard) limits, and the CPU seconds it has used."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    limits = {name: resource.getrlimit(kind) for name, kind in RLIMITS.items()}
    return json.dumps({**limits, "cpu_used_s": usage.ru_utime + usage.ru_stime})


def start_sleeper(pid_file: str, how: str) -> int:
    """Start `sleep 1000` as the worker's child ("popen") or as a shell's background job, whose shell then exits
    ("shell": the sleep is an orphan, no longer the worker's child); write its pid to `pid_file`."""
    if how == "popen":
        pid = subprocess.Popen(["sleep", "1000"]).pid
        with open(pid_file, "w") as f:
            f.write(str(pid))
    else:
        subprocess.run(f"sleep 1000 & echo $! > {pid_file}", shell=True, check=True)
    return int(open(pid_file).read())


def start_sleeper_and_hang(pid_file: str, how: str) -> None:
    start_sleeper(pid_file, how)
    time.sleep(3600)


def allocate(gib: int) -> int:
    """Ask for `gib` GiB at once (zero pages: without a limit, nothing is touched, so nothing is used)."""
    return len(bytes(gib << 30))


def burn_cpu(seconds: float) -> float:
    """Spin until this process has used `seconds` more CPU seconds (forever when negative)."""
    start = time.process_time()
    while seconds < 0 or time.process_time() - start < seconds:
        pass
    return time.process_time() - start


class ProbeEnv(ToolEnv):
    """A ToolEnv whose tools are the functions above (the schemas do not matter: the tests call `step` directly)."""

    def functions(self) -> dict[str, Callable[..., Any]]:
        return {f.__name__: f for f in (environ, rlimits, start_sleeper, start_sleeper_and_hang, allocate, burn_cpu)}


def reward_worker_that_starts_a_sleeper(conn: Connection, pid_file: str) -> None:
    """A `spawn_worker` target (as the reward pool's): says it is ready, starts a sleeper, then hangs."""
    conn.send_bytes(b'{"ready": true}')
    start_sleeper(pid_file, "popen")
    time.sleep(3600)
