"""Rewards: step 3 of the RL data path, between the rollout (which fills `response`) and the filters.

- Built-ins, by name: `exact_match` (normalized string compare), `math` (`math-verify`), `task` (the built-in
  arithmetic task's verifier), `env` (the reward an agentic rollout's environment gave the episode). Anything else
  is a `module:function` `RewardFn` (or `GroupRewardFn` with `is_group`), checked at start-up with
  `miles_contracts.load_plugin`. `http` asks a reward server instead (http.py: no worker processes, the
  same failure semantics).
- `RewardPool` scores `exact_match`, `task` and `env` in the driver (`DriverScorer`: Miles' own functions, whose time
  is bounded by the response's length; no process, no JSON round trip) and runs every other reward (`math`, whose
  sympy can run long, and user code) in spawned worker processes (rollout/sandbox.py), one call per sample (or per
  prompt group), each with a timeout; a step's calls reach each worker as one chunk and the replies stream back one
  by one. Samples cross to a worker as JSON (`Sample.model_dump(mode="json")` over a pipe's raw bytes), never as
  pickles. A call that raises, returns a non-finite or non-numeric value, kills its worker, or runs past the timeout
  marks its sample(s) `failed` (`status=FAILED`, `error` says why) with `reward = 0.0`, so a group's advantages stay
  computable and a failure counts as a wrong answer; the loop may drop such groups by status. A hung or dead worker
  is killed and replaced; the pool keeps working and the run never crashes on user code.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import math
import queue
import re
import signal
import threading
import traceback
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import Any, Literal, Protocol

from miles_contracts import GroupRewardFn, RewardFn, Sample, SampleStatus, load_plugin
from miles_kernels import KernelConfig
from miles_orchestrator.config import HTTP_REWARD, RewardSection
from miles_orchestrator.config.reward import JUDGE_REWARD, REWARD_MODEL
from miles_orchestrator.data import task
from miles_orchestrator.reward.http import CallResult, HttpReward
from miles_orchestrator.rollout.sandbox import Worker, exit_code, spawn_worker, stop_worker, wait_ready

__all__ = [
    "BUILTIN_REWARDS",
    "DRIVER_SCORED_REWARDS",
    "DriverScorer",
    "RewardPool",
    "RewardStats",
    "check_reward",
    "env_reward",
    "exact_match",
    "math_reward",
    "resolve_reward",
    "task_reward",
]

_MAX_ERRORS_KEPT = 5


def _normalize(text: str) -> str:
    return re.sub(r"\s+", " ", text).strip().rstrip(".").strip().casefold()


def exact_match(sample: Sample) -> float:
    """1.0 when the response equals the label (or one of a list of labels) after trimming, case folding and
    collapsing whitespace (a trailing period is ignored), else 0.0."""
    if sample.label is None:
        raise ValueError("exact_match needs a label; set data.label_key to the column that holds the answer")
    labels = sample.label if isinstance(sample.label, list) else [sample.label]
    return 1.0 if any(_normalize(sample.response) == _normalize(str(label)) for label in labels) else 0.0


def math_reward(sample: Sample) -> float:
    """1.0 when `math-verify` finds the response's final answer equal to the label (LaTeX or plain), else 0.0."""
    from math_verify import parse, verify  # lazy: sympy / latex2sympy take a second to import

    if sample.label is None:
        raise ValueError("the math reward needs a label; set data.label_key to the column that holds the answer")
    label = str(sample.label)
    # math-verify's own timeouts use SIGALRM, which works only on the main thread; the pool enforces its own.
    timeout = 5 if threading.current_thread() is threading.main_thread() else None
    gold = parse(label if "$" in label or "\\boxed" in label else f"${label}$", parsing_timeout=timeout)  # type: ignore[arg-type]
    if not gold:
        raise ValueError(f"math-verify cannot parse the label {label!r}; write it as a number or LaTeX expression")
    answer = parse(sample.response, parsing_timeout=timeout)  # type: ignore[arg-type]
    return 1.0 if verify(gold, answer, timeout_seconds=timeout) else 0.0


def task_reward(sample: Sample) -> float:
    """The built-in arithmetic task's verifier: 1.0 when the last integer of the response is the answer."""
    return task.verify(sample.response, sample.label)


def env_reward(sample: Sample) -> float:
    """The reward an agentic rollout's environment gave the episode: the sum of its steps' rewards
    (`sample.metadata["agent"]["reward"]`, written by miles_orchestrator.rollout.agentic)."""
    agent = sample.metadata.get("agent")
    if not isinstance(agent, dict) or not isinstance(agent.get("reward"), int | float):
        raise ValueError(
            "the env reward reads the episode's environment reward, but this sample has none; set rollout.agent.env "
            "(a multi-turn rollout) or choose another reward.name"
        )
    return float(agent["reward"])  # type: ignore[arg-type]


# Named in the run config (`reward.name`); the keys are the config's names (config/sections.py, checked there without
# importing rewards); a test holds the two equal.
BUILTIN_REWARDS: dict[str, RewardFn] = {
    "exact_match": exact_match,
    "math": math_reward,
    "task": task_reward,
    "env": env_reward,
}


# The built-ins scored in the driver: string and integer comparisons of Miles' own, linear in the response's length
# (Python's int() refuses a string of more than 4300 digits), that never block; `math` is not one (sympy can run for
# seconds on a hostile answer), nor is any user code: those run in worker processes with a timeout.
DRIVER_SCORED_REWARDS = ("exact_match", "task", "env")


def resolve_reward(name: str, *, is_group: bool = False) -> RewardFn | GroupRewardFn:
    """The reward function `name` names: a built-in or a `module:function` path checked against its Protocol."""
    if name in BUILTIN_REWARDS:
        if is_group:
            raise ValueError(f"reward {name!r} scores one sample; set reward.is_group=false")
        return BUILTIN_REWARDS[name]
    if name == HTTP_REWARD:
        raise ValueError("the http reward is a server, not a function; build it with RewardPool.from_config")
    if ":" not in name:
        raise ValueError(f"reward {name!r}: use one of {sorted(BUILTIN_REWARDS)} or a 'module:function' path")
    if is_group:
        return load_plugin(name, GroupRewardFn)  # type: ignore[type-abstract]
    return load_plugin(name, RewardFn)  # type: ignore[type-abstract]


def check_reward(cfg: RewardSection) -> None:
    """The start-up check of `reward`: a plug-in imports and fits its Protocol; the http reward's or the judge's
    server answers; the reward model's directory is a sequence-classification checkpoint."""
    if cfg.name == HTTP_REWARD:
        HttpReward(cfg).check_reachable()
    elif cfg.name == JUDGE_REWARD:
        from miles_orchestrator.reward.judge import JudgeReward

        JudgeReward(cfg).check_reachable()
    elif cfg.name == REWARD_MODEL:
        from miles_kernels import read_reward_model_config

        read_reward_model_config(cfg.model_path or "")
    else:
        resolve_reward(cfg.name, is_group=cfg.is_group)


@dataclass
class RewardStats:
    """What one `RewardPool.score` call did."""

    num_samples: int = 0
    num_failed: int = 0
    num_timeouts: int = 0
    mean_reward: float = 0.0  # over all samples, failed ones counting 0.0
    errors: list[str] = field(default_factory=list)  # the first few distinct failure messages

    def as_metrics(self) -> dict[str, float]:
        return {
            "reward/mean": self.mean_reward,
            "reward/num_failed": float(self.num_failed),
            "reward/num_timeouts": float(self.num_timeouts),
        }


class RemoteScorer(Protocol):
    """What scores a pool's calls instead of its worker processes: the http reward, the judge, the reward model, the
    built-ins scored in the driver."""

    def check_reachable(self) -> None: ...

    async def score_calls(self, calls: Sequence[list[Sample]]) -> list[CallResult]: ...

    def close(self) -> None: ...


class DriverScorer:
    """Scores a built-in of `DRIVER_SCORED_REWARDS` in the driver, on one thread beside the event loop, with a worker's
    failure rules: a call that raises or returns a non-finite value fails alone, with the same message."""

    def __init__(self, name: str) -> None:
        if name not in DRIVER_SCORED_REWARDS:
            raise ValueError(f"reward {name!r} runs in worker processes; the driver scores {DRIVER_SCORED_REWARDS}")
        self.name, self.fn = name, BUILTIN_REWARDS[name]

    def check_reachable(self) -> None:
        """Nothing to reach: the function is here."""

    async def score_calls(self, calls: Sequence[list[Sample]]) -> list[CallResult]:
        return await asyncio.to_thread(self._score, calls)

    def _score(self, calls: Sequence[list[Sample]]) -> list[CallResult]:
        results: list[CallResult] = []
        for call in calls:
            try:
                results.append((_call_reward(self.fn, call, False, None), None, False))
            except Exception as error:
                results.append((None, _raised(self.name, error), False))
        return results

    def close(self) -> None:
        """Nothing to stop."""


class RewardPool:
    """Runs a reward function in `num_workers` worker processes, each call under `timeout_s`; or, given `remote`
    (the http reward), sends each call to its server instead; a built-in of `DRIVER_SCORED_REWARDS` it scores in the
    driver (`DriverScorer`).

    Use as `async with RewardPool("task") as pool: stats = await pool.score(samples)` (or `with`, or `close()`);
    `RewardPool.from_config(cfg.reward)` builds the pool a run config's `reward` section names.
    `score` fills `reward` (and on failure `status` / `error`) of the given samples in place.
    """

    def __init__(
        self,
        name: str,
        *,
        is_group: bool = False,
        timeout_s: float = 10.0,
        num_workers: int = 2,
        start_method: Literal["spawn", "forkserver"] = "spawn",
        remote: RemoteScorer | None = None,
    ) -> None:
        if timeout_s <= 0 or num_workers < 1:
            raise ValueError(f"timeout_s={timeout_s}, num_workers={num_workers}: both must be positive")
        self.name, self.is_group, self.timeout_s, self.num_workers = name, is_group, timeout_s, num_workers
        if remote is None and name in DRIVER_SCORED_REWARDS and not is_group:
            remote = DriverScorer(name)
        self.remote = remote
        if remote is not None:
            remote.check_reachable()
        else:
            resolve_reward(name, is_group=is_group)  # fail here, in the caller, on a bad name or signature
        self._start_method = start_method
        self._idle: queue.Queue[Worker] = queue.Queue()
        self._threads = ThreadPoolExecutor(max_workers=num_workers, thread_name_prefix="reward")
        self.num_restarts = 0
        self.total_failed = 0
        self._closed = False
        # Start all, then wait: the imports overlap. The http reward has no workers: the calls go to its server.
        pending = [self._spawn() for _ in range(num_workers if remote is None else 0)]
        try:
            for worker in pending:
                self._idle.put(self._wait_ready(worker))
        except Exception:
            for worker in pending:
                self._stop(worker)
            raise

    @classmethod
    def from_config(cls, cfg: RewardSection, kernel: KernelConfig | None = None) -> RewardPool:
        """The pool that a run config's `reward` section names (a server checked, a reward model loaded on the way;
        `kernel`: the reward model's kernels, the run's)."""
        remote: RemoteScorer | None = None
        if cfg.name == HTTP_REWARD:
            remote = HttpReward(cfg)
        elif cfg.name == JUDGE_REWARD:
            from miles_orchestrator.reward.judge import JudgeReward

            remote = JudgeReward(cfg)
        elif cfg.name == REWARD_MODEL:
            from miles_orchestrator.reward.model import RewardModelScorer

            remote = RewardModelScorer(cfg, kernel or KernelConfig())
        return cls(cfg.name, is_group=cfg.is_group, timeout_s=cfg.timeout_s, num_workers=cfg.num_workers,
                   remote=remote)  # fmt: skip

    async def score(self, samples: Sequence[Sample]) -> RewardStats:
        """Score `samples` in place (per sample, or per `group_index` group when `is_group`) and summarize."""
        if self._closed:
            raise RuntimeError("this RewardPool is closed; make a new one")
        calls: list[list[Sample]] = []
        if self.is_group:
            groups: dict[int, list[Sample]] = {}
            for sample in samples:
                groups.setdefault(sample.group_index, []).append(sample)
            calls = list(groups.values())
        else:
            calls = [[sample] for sample in samples]
        results = await (self.remote.score_calls(calls) if self.remote is not None else self._score_in_workers(calls))
        stats = RewardStats(num_samples=len(samples))
        for call, (rewards, error, timed_out) in zip(calls, results, strict=True):
            if rewards is not None:
                for sample, reward in zip(call, rewards, strict=True):
                    sample.reward = reward
                continue
            assert error is not None
            stats.num_failed += len(call)
            stats.num_timeouts += len(call) if timed_out else 0
            if error not in stats.errors and len(stats.errors) < _MAX_ERRORS_KEPT:
                stats.errors.append(error)
            for sample in call:
                sample.error = error  # before status: a failed sample must say why
                sample.status = SampleStatus.FAILED
                sample.reward = 0.0
        self.total_failed += stats.num_failed
        stats.mean_reward = sum(s.reward or 0.0 for s in samples) / len(samples) if samples else 0.0
        return stats

    def close(self) -> None:
        """Stop every worker (idempotent)."""
        if self._closed:
            return
        self._closed = True
        self._threads.shutdown(wait=True)
        if self.remote is not None:
            self.remote.close()
        while not self._idle.empty():
            self._stop(self._idle.get_nowait())

    def __enter__(self) -> RewardPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    async def __aenter__(self) -> RewardPool:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await asyncio.get_running_loop().run_in_executor(None, self.close)

    async def _score_in_workers(self, calls: list[list[Sample]]) -> list[CallResult]:
        # One chunk of calls per worker: one request each way per chunk, not per sample (replies stream back, so
        # every call still has its own timeout and a failure costs only its own call).
        size = -(-len(calls) // self.num_workers) if calls else 1
        chunks = [calls[i : i + size] for i in range(0, len(calls), size)]
        loop = asyncio.get_running_loop()
        done = await asyncio.gather(*(loop.run_in_executor(self._threads, self._run_chunk, c) for c in chunks))
        return [result for chunk in done for result in chunk]

    def _run_chunk(self, calls: list[list[Sample]]) -> list[CallResult]:
        """Per call, (rewards, None, False) on success, else (None, error, timed_out). Runs on a pool thread.

        The calls go to a worker in one message; it answers each in turn. A call that times out or kills the worker
        fails alone: the worker is replaced and the calls after it are sent again to the new one."""
        results: list[CallResult] = []
        pending = list(calls)
        while pending:
            worker = self._idle.get()  # one thread per worker, so a worker is always free here
            try:
                worker.conn.send_bytes(json.dumps([[s.model_dump(mode="json") for s in c] for c in pending]).encode())
                while pending:
                    if not worker.conn.poll(self.timeout_s):
                        worker = self._replace(worker)
                        message = f"reward {self.name!r} timed out after {self.timeout_s:g}s (worker killed)"
                        results.append((None, message, True))
                        pending.pop(0)
                        break
                    reply = json.loads(worker.conn.recv_bytes())
                    pending.pop(0)
                    if "error" in reply:
                        results.append((None, str(reply["error"]), False))
                    else:
                        results.append(([float(r) for r in reply["rewards"]], None, False))
            except (EOFError, OSError):
                code = exit_code(worker)
                worker = self._replace(worker)
                results.append((None, f"reward {self.name!r} worker died (exit code {code}) while scoring", False))
                pending.pop(0)
            finally:
                self._idle.put(worker)
        return results

    def _replace(self, worker: Worker) -> Worker:
        self._stop(worker)
        self.num_restarts += 1
        return self._wait_ready(self._spawn())

    def _spawn(self) -> Worker:
        return spawn_worker(_worker_main, (self.name, self.is_group), "miles-reward", self._start_method)

    def _wait_ready(self, worker: Worker) -> Worker:
        return wait_ready(worker, f"reward worker for {self.name!r}")

    @staticmethod
    def _stop(worker: Worker) -> None:
        stop_worker(worker)


def _worker_main(conn: Connection, name: str, is_group: bool) -> None:
    """A worker process: resolve the reward, then answer JSON requests until the pipe closes."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle; it stops the workers
    try:
        fn: Any = resolve_reward(name, is_group=is_group)
    except Exception as error:
        conn.send_bytes(json.dumps({"error": f"{type(error).__name__}: {error}"}).encode())
        return
    if name == "math":
        import math_verify  # noqa: F401  # sympy takes seconds to import; not on the first call's clock

    conn.send_bytes(b'{"ready": true}')
    loop = asyncio.new_event_loop()  # async rewards share one loop per worker
    while True:
        try:
            request = conn.recv_bytes()
        except (EOFError, OSError):
            return
        for call in json.loads(request):  # a chunk of calls: one reply each, in order
            try:
                samples = [Sample.model_validate(s) for s in call]
                reply: dict[str, Any] = {"rewards": _call_reward(fn, samples, is_group, loop)}
            except Exception as error:
                reply = {"error": _raised(name, error)}
            conn.send_bytes(json.dumps(reply).encode())


def _raised(name: str, error: Exception) -> str:
    """A failed call's error: the exception and where it was raised."""
    where = traceback.extract_tb(error.__traceback__)[-1]
    return f"reward {name!r} raised {type(error).__name__}: {error} ({where.filename}:{where.lineno})"


def _call_reward(
    fn: Any, samples: list[Sample], is_group: bool, loop: asyncio.AbstractEventLoop | None
) -> list[float]:
    result = fn(samples) if is_group else fn(samples[0])
    if inspect.isawaitable(result):
        if loop is None:
            raise TypeError(f"{fn.__name__} returned an awaitable; the driver scores only plain functions")
        result = loop.run_until_complete(result)
    values = result if is_group else [result]
    if is_group and (not isinstance(values, list) or len(values) != len(samples)):
        raise ValueError(f"a group reward must return a list of {len(samples)} floats, got {values!r}")
    for value in values:
        if not isinstance(value, int | float) or not math.isfinite(value):  # bool is an int: True scores 1.0
            raise ValueError(f"a reward must be a finite float, got {value!r}")
    return [float(v) for v in values]
