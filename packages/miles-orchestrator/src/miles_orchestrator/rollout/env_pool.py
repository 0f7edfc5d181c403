"""The sandbox of agentic rollouts' environments: `EnvPool` runs every episode's environment in one of
`rollout.agent.num_workers` worker processes (sandbox.py, `spawn_sandboxed`), each call (`reset`, `step`) under
`rollout.agent.timeout_s`, as rewards run (reward/pool.py). A worker sees an allow-listed environment (none of the
driver's keys and tokens) and runs under rlimits (`Limits`: CPU seconds per call, address space, open files, no core
dumps); it leads its own process group, which is killed whole, so what a tool started dies with its worker.

An episode lives in one worker for its whole life (its state is a Python object there). A call that raises fails
its episode only; a call that hangs past the timeout or kills its worker gets the worker killed and replaced, which
fails that episode and the other episodes the worker held (their state died with it), never the run; so does a call
past its CPU limit (the kernel kills the worker), while one that allocates past its address space raises
MemoryError, which fails its episode only. Samples and messages cross as JSON, never as pickles.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import itertools
import json
import signal
import traceback
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

from miles_contracts import AgentMessage, ChatMessage, Environment, Sample, StepResult, load_plugin
from miles_orchestrator.rollout.environments import BUILTIN_ENVS
from miles_orchestrator.rollout.sandbox import (
    Limits,
    Worker,
    exit_code,
    renew_cpu_limit,
    spawn_sandboxed,
    stop_worker,
    wait_ready,
)


class EnvError(RuntimeError):
    """An environment call failed (raised, timed out, or its worker died): the episode's sample fails."""


def resolve_env(name: str) -> type:
    """The environment class `name` names: a built-in (`calculator`) or a `module:Class` checked against
    `Environment`."""
    if name in BUILTIN_ENVS:
        return BUILTIN_ENVS[name]
    if ":" not in name:
        raise ValueError(f"environment {name!r}: use one of {sorted(BUILTIN_ENVS)} or a 'module:Class' path")
    return load_plugin(name, Environment)  # type: ignore[type-abstract, return-value]


@dataclass(frozen=True)
class Episode:
    """One episode's handle: its id, the worker holding its state, and that worker's incarnation."""

    id: int
    worker: int
    generation: int


@dataclass(frozen=True)
class Opened:
    """What `reset` gave: the episode, the opening messages (None: the sample's prompt) and the tools' schemas."""

    episode: Episode
    messages: list[ChatMessage] | None
    tools: list[dict[str, Any]] | None


class EnvPool:
    """Runs `Env(**env_args)` episodes in `num_workers` worker processes, each call under `timeout_s`, each worker
    under `limits` (sandbox.py: rlimits and the environment variables it sees; None: the defaults).

    `open(sample)` resets a new episode, `step(episode, message)` plays a turn, `close(episode)` frees it; every
    failure is an `EnvError`. Use as a context manager (or `close_pool()`)."""

    def __init__(
        self, name: str, env_args: dict[str, Any], *, timeout_s: float, num_workers: int, limits: Limits | None = None
    ) -> None:
        if timeout_s <= 0 or num_workers < 1:
            raise ValueError(f"timeout_s={timeout_s}, num_workers={num_workers}: both must be positive")
        resolve_env(name)  # fail here, in the caller, on a bad name
        self.name, self.env_args, self.timeout_s = name, env_args, timeout_s
        self.limits = limits or Limits()
        self._cpu_s = self.limits.cpu_s(timeout_s)
        self.num_restarts = 0
        self._ids = itertools.count()
        self._generations = [0] * num_workers
        self._threads = [ThreadPoolExecutor(1, thread_name_prefix=f"env{i}") for i in range(num_workers)]
        pending = [self._spawn() for _ in range(num_workers)]
        try:
            self._workers = [self._wait_ready(w) for w in pending]
        except Exception:
            for worker in pending:
                stop_worker(worker)
            raise

    async def open(self, sample: Sample) -> Opened:
        episode_id = next(self._ids)
        index = episode_id % len(self._workers)
        episode = Episode(episode_id, index, self._generations[index])
        reply = await self._request(episode, {"op": "reset", "sample": sample.model_dump(mode="json")})
        messages = reply.get("messages")
        opening = None if messages is None else [ChatMessage.model_validate(m) for m in messages]
        return Opened(episode, opening, reply.get("tools"))

    async def step(self, episode: Episode, message: AgentMessage) -> StepResult:
        reply = await self._request(episode, {"op": "step", "message": message.model_dump(mode="json")})
        return StepResult.model_validate(reply["result"])

    async def close(self, episode: Episode) -> None:
        """Free the episode's state (nothing to do when its worker was restarted: the state is gone)."""
        if episode.generation == self._generations[episode.worker]:
            with contextlib.suppress(EnvError):  # the episode is over either way
                await self._request(episode, {"op": "close"})

    async def _request(self, episode: Episode, request: dict[str, Any]) -> dict[str, Any]:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._threads[episode.worker], self._call, episode, request)

    def _call(self, episode: Episode, request: dict[str, Any]) -> dict[str, Any]:
        """One call on the episode's worker (runs on that worker's one thread, so calls to a worker are serial)."""
        index = episode.worker
        if episode.generation != self._generations[index]:
            raise EnvError(
                f"environment {self.name!r}: the worker holding this episode was restarted (another episode on it "
                "hung or crashed), and the episode's state went with it"
            )
        worker = self._workers[index]
        op = request["op"]
        try:
            worker.conn.send_bytes(json.dumps({"id": episode.id, **request}).encode())
            if not worker.conn.poll(self.timeout_s):
                self._replace(index)
                raise EnvError(f"environment {self.name!r}: {op} timed out after {self.timeout_s:g}s (worker killed)")
            reply: dict[str, Any] = json.loads(worker.conn.recv_bytes())
        except (EOFError, OSError):
            code = exit_code(worker)
            self._replace(index)
            why = f"; SIGXCPU: past its CPU limit of {self._cpu_s:g}s" if code == -signal.SIGXCPU else ""
            raise EnvError(f"environment {self.name!r}: its worker died (exit code {code}{why}) during {op}") from None
        if "error" in reply:
            raise EnvError(f"environment {self.name!r}: {op} raised {reply['error']}")
        return reply

    def _replace(self, index: int) -> None:
        stop_worker(self._workers[index])
        self._generations[index] += 1
        self.num_restarts += 1
        self._workers[index] = self._wait_ready(self._spawn())

    def _spawn(self) -> Worker:
        args = (self.name, self.env_args, self._cpu_s)
        return spawn_sandboxed(_worker_main, args, "miles-env", self.limits, self._cpu_s)

    def _wait_ready(self, worker: Worker) -> Worker:
        return wait_ready(worker, f"environment worker for {self.name!r}")

    def close_pool(self) -> None:
        """Stop every worker (idempotent)."""
        for threads in self._threads:
            threads.shutdown(wait=True)
        for worker in self._workers:
            stop_worker(worker)
        self._workers = []

    def __enter__(self) -> EnvPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close_pool()


def _worker_main(conn: Connection, name: str, env_args: dict[str, Any], cpu_s: float) -> None:
    """A worker process: resolve the environment class, then run episodes' calls until the pipe closes."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle; it stops the workers
    try:
        env_class = resolve_env(name)
    except Exception as error:
        conn.send_bytes(json.dumps({"error": f"{type(error).__name__}: {error}"}).encode())
        return
    conn.send_bytes(b'{"ready": true}')
    episodes: dict[int, Any] = {}
    loop = asyncio.new_event_loop()  # async environments share one loop per worker
    while True:
        try:
            request = json.loads(conn.recv_bytes())
        except (EOFError, OSError):
            return
        renew_cpu_limit(cpu_s)  # the CPU limit is per call
        try:
            reply = _serve(request, episodes, env_class, env_args, loop)
        except Exception as error:
            where = traceback.extract_tb(error.__traceback__)[-1]
            reply = {"error": f"{type(error).__name__}: {error} ({where.filename}:{where.lineno})"}
            episodes.pop(request["id"], None)  # a failed episode is over
        conn.send_bytes(json.dumps(reply).encode())


def _serve(
    request: dict[str, Any], episodes: dict[int, Any], env_class: type, env_args: dict[str, Any],
    loop: asyncio.AbstractEventLoop,
) -> dict[str, Any]:  # fmt: skip
    episode_id, op = request["id"], request["op"]
    if op == "close":
        episodes.pop(episode_id, None)
        return {}
    if op == "reset":
        env = episodes[episode_id] = env_class(**env_args)
        opening = _await(env.reset(Sample.model_validate(request["sample"])), loop)
        messages = None if opening is None else _opening_messages(opening)
        return {"messages": messages, "tools": getattr(env, "tools", None) or None}
    result = _await(episodes[episode_id].step(AgentMessage.model_validate(request["message"])), loop)
    if isinstance(result, dict):
        result = StepResult.model_validate(result)
    if not isinstance(result, StepResult):
        raise TypeError(f"step must return a miles_contracts.StepResult (or its dict), got {type(result).__name__}")
    return {"result": result.model_dump(mode="json")}


def _opening_messages(opening: Any) -> list[dict[str, Any]]:
    if isinstance(opening, str):
        return [{"role": "user", "content": opening}]
    if isinstance(opening, list):
        return [ChatMessage.model_validate(m).model_dump() for m in opening]
    raise TypeError(f"reset must return None, a string or a list of chat messages, got {type(opening).__name__}")


def _await(value: Any, loop: asyncio.AbstractEventLoop) -> Any:
    return loop.run_until_complete(value) if inspect.isawaitable(value) else value
