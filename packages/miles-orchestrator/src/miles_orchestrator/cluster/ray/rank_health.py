"""Trainer rank failures (docs/fault-tolerance.md): `collective` runs one collective call on every trainer rank
actor and turns a rank that dies or hangs into a `TrainerRankFailed` naming it, within seconds.

- A rank that dies (SIGKILL, a segfault, the OOM killer) fails its own call at once (Ray's `RayActorError`); its
  peers' collectives fail too (gloo's connection closes, or `memory.collective_timeout_s` passes).
- A rank that hangs (SIGSTOP, a deadlock) is found by a heartbeat: while the call runs, every `hang_timeout_s / 2`
  seconds each rank is pinged in its own concurrency group (`HEALTH_GROUP`, answered beside the work); a rank
  whose ping has not answered within `hang_timeout_s / 2` is hung. A single rank has no peer to time out: the
  heartbeat is what stops it.
After any failure every rank is pinged once more, so the error names the ranks that died or hung, not the peers
whose collectives failed because of them. The driver then shuts the cluster down; the last checkpoint resumes the
run (`miles-orchestrator run --resume RUN_DIR`), bitwise as after a SIGKILL of the whole run.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
from typing import Any

from ray.exceptions import RayActorError

HEALTH_GROUP = "health"  # the trainer actors' concurrency group of `ping` (one thread beside the work's)
MAX_ERROR_CHARS = 600


class TrainerRankFailed(RuntimeError):
    """A trainer rank died or hung: the run stops (its last checkpoint resumes it)."""


async def collective(
    trainers: list[Any], method: str, refs: list[Any], hang_timeout_s: float, resume_hint: str
) -> list[Any]:
    """The ranks' results of `refs` (one call of `method` per rank, in rank order); a `TrainerRankFailed` naming
    the ranks that died or hung, or the call's own error when every rank is alive."""
    gathered: asyncio.Future[Any] = asyncio.gather(*refs)
    gathered.add_done_callback(_consume)  # its error, once the failure is reported, is not news
    watchdog: asyncio.Future[Any] | None = None
    if hang_timeout_s > 0:
        watchdog = asyncio.get_running_loop().create_task(_watch(trainers, method, hang_timeout_s, resume_hint))
    try:
        if watchdog is None:
            return list(await gathered)
        done, _ = await asyncio.wait({gathered, watchdog}, return_when=asyncio.FIRST_COMPLETED)
        if gathered in done:
            return list(gathered.result())
        watchdog.result()  # raises the hung rank's failure
        raise AssertionError("the heartbeat ends only with a failure")
    except TrainerRankFailed:
        raise
    except Exception as error:
        failure = await diagnose(trainers, method, max(hang_timeout_s / 2, 5.0), resume_hint, error)
        if failure is None:
            raise
        raise failure from error
    finally:
        if watchdog is not None:
            watchdog.cancel()
            with contextlib.suppress(BaseException):
                await watchdog


async def diagnose(
    trainers: list[Any], method: str, timeout_s: float, resume_hint: str, error: BaseException | None = None
) -> TrainerRankFailed | None:
    """Ping every rank (at most `timeout_s` each, all at once): a failure naming the dead and hung ones, or None."""
    pings = [asyncio.wait_for(_ping(t), timeout_s) for t in trainers]
    answers = await asyncio.gather(*pings, return_exceptions=True)
    parts = []
    for rank, answer in enumerate(answers):
        if isinstance(answer, RayActorError):
            parts.append(f"trainer rank {rank} died ({_death(answer)})")
        elif isinstance(answer, TimeoutError):
            parts.append(f"trainer rank {rank} is hung (no answer to a heartbeat within {timeout_s:g} s)")
    if not parts:
        return None
    cause = ""
    if error is not None and not isinstance(error, RayActorError):  # a peer's error, e.g. its collective's timeout
        cause = f"; the call failed with {type(error).__name__}: {_short(error)}"
    return TrainerRankFailed(f"{'; '.join(parts)} during {method}{cause}. The run stops; {resume_hint}")


async def _watch(trainers: list[Any], method: str, hang_timeout_s: float, resume_hint: str) -> None:
    while True:
        await asyncio.sleep(hang_timeout_s / 2)
        failure = await diagnose(trainers, method, hang_timeout_s / 2, resume_hint)
        if failure is not None:
            raise failure


async def _ping(trainer: Any) -> Any:
    return await trainer.ping.options(concurrency_group=HEALTH_GROUP).remote()


def _death(error: RayActorError) -> str:
    """Ray's long account of a dead actor, in a few words: its process and how it exited."""
    text = str(error)
    pid = re.search(r"\bpid: (\d+)", text)
    exit_type = re.search(r"Worker exit type: (\w+)", text)
    how = "killed, crashed or out of memory" if exit_type is None else f"Ray: {exit_type.group(1)}"
    return f"its process{f' {pid.group(1)}' if pid else ''} exited: {how}"


def _short(error: BaseException) -> str:
    text = " ".join(str(error).split())
    return text if len(text) <= MAX_ERROR_CHARS else text[: MAX_ERROR_CHARS - 3] + "..."


def _consume(future: asyncio.Future[Any]) -> None:
    if not future.cancelled():
        future.exception()
