"""Engine failures (docs/fault-tolerance.md; docs/architecture.md, "Cluster"): `EngineSupervisor` watches every
engine of an `EngineFleet` and restarts one that dies or hangs, within a limit of restarts per hour.

- Every `check_interval_s` each engine is probed with a client of its own whose timeout is `check_timeout_s`:
  `/health_generate` (a one-token generation) while the fleet serves, `/health` while its memory is released,
  generation is paused or weights load (a probe would wait for them). A probe begun before an engine's restart is
  about the old engine and is ignored. `failure_threshold` failures in a row, and the engine is
  restarted: the cluster's `restart(engine, cause)` kills it, starts a new one on its bundle, re-syncs it and
  re-adds it to the router (cluster.py).
- A `/generate` that fails for an engine's sake (no connection, HTTP 5xx) triggers a check of every engine at once,
  whose failures restart at once; the fleet then re-issues the request unchanged (same seeds, so in deterministic
  mode the same samples, whichever engine serves it).
- Each restart is logged (engine, cause, seconds to recover) and counted in the step's metrics
  (`engine_restarts`, `engine_recovery_s`); one restart more than `max_restarts_per_hour` in any hour stops the run
  with an error naming the engines and causes. The error surfaces on the next fleet call.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from miles_orchestrator.cluster.protocol import EngineFailed
from miles_orchestrator.config.rollout import FaultToleranceSection
from miles_rollout import Client, RolloutClientError

HOUR_S = 3600.0


@dataclass(frozen=True)
class Restart:
    engine: int
    cause: str
    at: float  # time.monotonic() when the failure was acted on
    recovery_s: float


class EngineSupervisor:
    """Health checks and restarts of the engines at `urls()` (one per engine, in order; they change on restart)."""

    def __init__(
        self,
        urls: Callable[[], list[str]],
        restart: Callable[[int, str], Awaitable[None]],
        settings: FaultToleranceSection,
        log: Callable[[str], None],
        admin_key: str | None = None,
    ) -> None:
        self.urls, self.restart_engine, self.settings, self.log = urls, restart, settings, log
        self.admin_key = admin_key
        self.serving = True  # the fleet generates (else: memory released, generation paused or weights loading)
        self.restarts: list[Restart] = []
        self.failed: EngineFailed | None = None
        self._failures: dict[int, int] = {}
        self._recovering: dict[int, asyncio.Task[None]] = {}
        self._round: asyncio.Task[None] | None = None
        self._watcher: asyncio.Task[None] | None = None
        self._reported = 0

    def start(self) -> None:
        if self._watcher is None:
            self._watcher = asyncio.get_running_loop().create_task(self._watch(), name="miles-engine-health")

    async def stop(self) -> None:
        tasks = [t for t in (self._watcher, self._round, *self._recovering.values()) if t is not None]
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(BaseException):
                await task
        self._watcher = None

    def raise_if_failed(self) -> None:
        if self.failed is not None:
            raise self.failed

    async def check_now(self) -> None:
        """Probe every engine at once and restart each that fails (a generate just failed: no threshold); calls
        made together share one round. Returns once the restarts it started are done."""
        if self._round is None or self._round.done():
            self._round = asyncio.get_running_loop().create_task(self._check_all(threshold=1))
        await asyncio.shield(self._round)
        await self.wait_recovered()
        self.raise_if_failed()

    def recovering(self) -> set[int]:
        """The engines whose restart is under way."""
        return {engine for engine, task in self._recovering.items() if not task.done()}

    async def wait_recovered(self) -> None:
        """Until no restart is in progress."""
        while pending := [t for t in self._recovering.values() if not t.done()]:
            await asyncio.gather(*(asyncio.shield(t) for t in pending), return_exceptions=True)

    def take_metrics(self) -> dict[str, float]:
        """The restarts since the last call: how many, and the longest time to recover."""
        new = self.restarts[self._reported :]
        self._reported = len(self.restarts)
        if not new:
            return {}
        return {"engine_restarts": float(len(new)), "engine_recovery_s": max(r.recovery_s for r in new)}

    async def _watch(self) -> None:
        while True:
            await asyncio.sleep(self.settings.check_interval_s)
            if self.failed is not None:
                return
            await self._check_all(self.settings.failure_threshold)

    async def _check_all(self, threshold: int) -> None:
        urls, restarts_before = self.urls(), len(self.restarts)
        causes = await asyncio.gather(*(self._probe(url) for url in urls))
        stale = self.recovering() | {r.engine for r in self.restarts[restarts_before:]}
        for engine, cause in enumerate(causes):
            if engine in stale:
                continue  # restarted, or being restarted, since the probe began: it probed the old engine
            if cause is None:
                self._failures[engine] = 0
                continue
            self._failures[engine] = self._failures.get(engine, 0) + 1
            if self._failures[engine] >= threshold:
                self._failures[engine] = 0
                self._recovering[engine] = asyncio.get_running_loop().create_task(self._recover(engine, cause))

    async def _probe(self, url: str) -> str | None:
        timeout = self.settings.check_timeout_s
        async with Client(url, timeout=timeout, connect_retries=0, api_key=self.admin_key,
                          admin_key=self.admin_key) as client:  # fmt: skip
            return await client.check_health(generate=self.serving)  # the client's deadline bounds the whole probe

    async def _recover(self, engine: int, cause: str) -> None:
        began = time.monotonic()
        recent = [r for r in self.restarts if began - r.at < HOUR_S]
        if len(recent) >= self.settings.max_restarts_per_hour:
            history = "; ".join(f"engine {r.engine}: {r.cause}" for r in recent) or "none"
            self.failed = EngineFailed(
                f"rollout engine {engine} failed ({cause}) after {len(recent)} restart(s) in the last hour, the most "
                f"rollout.fault_tolerance.max_restarts_per_hour={self.settings.max_restarts_per_hour} allows "
                f"(earlier: {history}); the run stops: resume it from its last checkpoint once the engines are fixed"
            )
            self.log(f"error: {self.failed}")
            return
        self.log(f"rollout engine {engine} failed ({cause}); restarting it")
        try:
            await self.restart_engine(engine, cause)
        except Exception as error:  # any failure to restart stops the run, with its cause
            self.failed = EngineFailed(f"rollout engine {engine} failed ({cause}) and could not be restarted: {error}")
            self.log(f"error: {self.failed}")
            return
        restart = Restart(engine, cause, began, time.monotonic() - began)
        self.restarts.append(restart)
        self.log(f"rollout engine {engine} is back after {restart.recovery_s:.1f} s (restart {len(self.restarts)})")


def is_engine_failure(error: BaseException) -> bool:
    """Whether a failed engine call failed for the engine's sake (no connection, a timeout, HTTP 5xx), not for the
    request's (HTTP 4xx): such a call is worth re-issuing once the engines are healthy."""
    if not isinstance(error, RolloutClientError):
        return False
    return error.status_code is None or error.status_code >= 500
