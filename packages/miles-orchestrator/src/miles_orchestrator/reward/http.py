"""The built-in remote reward (`reward.name=http`): step 3 of the RL data path, scored by a server over HTTP.

`RewardPool` (pool.py) hands its calls here instead of to worker processes; the results go back through the
pool's own bookkeeping, so a failed call means what it means for a local reward: its sample(s) `failed`, reward
0.0, `error` saying why, the run going on.

The wire format (JSON both ways; nothing is ever unpickled):

- one sample (`reward.is_group=false`): `POST reward.url` `{"sample": SAMPLE}` → `{"reward": 1.0}`;
- a prompt group (`reward.is_group=true`): `{"samples": [SAMPLE, ...]}` → `{"rewards": [1.0, 0.0, ...]}`, one per
  sample, in order;

where SAMPLE is `Sample.model_dump(mode="json")`: every field (`prompt`, `response`, `label`, `metadata`, the
token ids, ...). A reward must be a finite number of magnitude at most `MAX_ABS_REWARD` (`true` / `false` count
1 / 0, as for a local reward).

The server is another party: nothing it answers ends the run. An answer is read up to `MAX_REPLY_BYTES` (a longer
one fails the call unread), and whatever else goes wrong with an answer (a number too large for a float, nesting
too deep for the JSON parser, any exception) fails its call like a malformed answer.

Each attempt runs under `reward.timeout_s`; a connection error, a timeout, a 5xx or a 429 is retried up to
`reward.max_retries` times after `reward.backoff_s`, doubling, at most `reward.max_backoff_s`; any other 4xx or a
malformed answer fails the call at once (asking again would get the same answer). At most
`reward.max_concurrency` requests are in flight. At start-up `check_reachable` GETs `reward.health_url` (a 2xx
is required) or else `reward.url` itself (any answer but 404: a POST-only route answers 405), so a wrong or
unreachable server is a ValueError naming the field before any rollout.
"""

from __future__ import annotations

import asyncio
import json
import os
import reprlib
import time
from collections.abc import Sequence
from typing import Any, NamedTuple

import httpx

from miles_contracts import Sample
from miles_orchestrator.config import RewardSection

__all__ = ["CallResult", "HttpReward"]

CallResult = tuple[list[float] | None, str | None, bool]  # (rewards, error, timed out): one reward call's outcome
MAX_REPLY_BYTES = 1 << 20  # an answer is {"rewards": [...]}: ~25 bytes a sample; anything past this is refused
MAX_ABS_REWARD = 1e6  # a larger reward is a broken (or hostile) server, not a score: it would swamp the advantages
_MAX_BODY_SHOWN = 200  # characters of an error answer kept in the sample's error


class _Retryable(Exception):
    """An attempt that may succeed if made again (connection error, timeout, 5xx, 429)."""

    def __init__(self, message: str, *, timed_out: bool = False) -> None:
        super().__init__(message)
        self.timed_out = timed_out


class _Answer(NamedTuple):
    """A server's answer, its body read up to `MAX_REPLY_BYTES`."""

    status: int
    body: bytes

    def excerpt(self) -> str:
        return repr(_cut(self.body.decode(errors="replace").strip()))


class HttpReward:
    """Scores reward calls by POSTing them to `reward.url` (see the module docstring for the contract)."""

    label, url_field, health_field = "http reward", "reward.url", "reward.health_url"  # what errors name

    def __init__(self, cfg: RewardSection, url: str | None = None, health_url: str | None = None) -> None:
        """`url` / `health_url`: another endpoint than reward.url / reward.health_url (the judge's)."""
        url, health_url = url or cfg.url, health_url or cfg.health_url
        assert url is not None, "RewardSection requires reward.url for reward.name=http"
        self.url, self.health_url, self.is_group = url, health_url, cfg.is_group
        self.timeout_s, self.max_retries, self.max_concurrency = cfg.timeout_s, cfg.max_retries, cfg.max_concurrency
        self.backoff_s, self.max_backoff_s = cfg.backoff_s, cfg.max_backoff_s
        self.headers: dict[str, str] = {}
        if cfg.api_key_env is not None:
            key = os.environ.get(cfg.api_key_env, "")
            if not key:
                raise ValueError(
                    f"reward.api_key_env={cfg.api_key_env!r}: that environment variable is not set (or empty); "
                    f"export {cfg.api_key_env}=YOUR_KEY, or set reward.api_key_env=null"
                )
            self.headers["Authorization"] = f"Bearer {key}"

    def backoff(self, retry: int) -> float:
        """Seconds to wait before retry number `retry` (1, 2, ...): backoff_s doubling, capped at max_backoff_s."""
        return float(min(self.max_backoff_s, self.backoff_s * 2 ** (retry - 1)))

    def check_reachable(self) -> None:
        """Raise ValueError naming reward.url (or reward.health_url) unless the server answers (see the module
        docstring); connection errors and timeouts are retried like a reward call."""
        field, url = (self.health_field, self.health_url) if self.health_url else (self.url_field, self.url)
        for attempt in range(self.max_retries + 1):
            if attempt:
                time.sleep(self.backoff(attempt))
            try:
                with httpx.stream("GET", url, headers=self.headers, timeout=self.timeout_s) as response:
                    break  # the status is all it needs: the body is never read
            except httpx.HTTPError as error:
                problem = f"{type(error).__name__}: {error}"
        else:
            raise ValueError(
                f"{field}={url!r}: no reward server answers there ({problem}; {self.max_retries + 1} attempt(s)); "
                "start it, or fix the host and port"
            )
        if self.health_url and not response.is_success:
            raise ValueError(
                f"{self.health_field}={url!r} answered {response.status_code} {response.reason_phrase}, not 2xx; "
                "is the reward server healthy?"
            )
        if response.status_code == 404:
            raise ValueError(
                f"{self.url_field}={url!r}: the server answers 404 Not Found there; fix the path of the scoring "
                "endpoint"
            )

    def close(self) -> None:
        """Nothing held between steps: each `score_calls` opens and closes its own connections."""

    async def score_calls(self, calls: Sequence[list[Sample]]) -> list[CallResult]:
        """One result per call (one sample, or one prompt group), in order; never raises for a failed call."""
        # One client (one connection pool) and one limit per batch: the loop scores one batch at a time.
        limit = asyncio.Semaphore(self.max_concurrency)
        limits = httpx.Limits(max_connections=self.max_concurrency)
        async with httpx.AsyncClient(headers=self.headers, timeout=self.timeout_s, limits=limits) as client:
            return list(await asyncio.gather(*(self._call(client, limit, call) for call in calls)))

    async def _call(self, client: httpx.AsyncClient, limit: asyncio.Semaphore, call: list[Sample]) -> CallResult:
        try:
            return await self._attempts(client, limit, call)
        except Exception as error:  # e.g. OverflowError, RecursionError: whatever an answer provokes fails its call
            return None, f"{self.label} at {self.url}: {_cut(f'{type(error).__name__}: {error}')}", False

    def _body(self, call: list[Sample]) -> dict[str, Any]:
        """The JSON a call POSTs (see the module docstring)."""
        samples = [s.model_dump(mode="json") for s in call]
        return {"samples": samples} if self.is_group else {"sample": samples[0]}

    async def _attempts(self, client: httpx.AsyncClient, limit: asyncio.Semaphore, call: list[Sample]) -> CallResult:
        body = self._body(call)
        failure = _Retryable("no attempt made")
        for attempt in range(self.max_retries + 1):
            if attempt:
                await asyncio.sleep(self.backoff(attempt))  # outside the limit: a waiting call holds no slot
            try:
                async with limit:
                    answer = await self._post(client, body)
                return self._rewards(answer, len(call)), None, False
            except _Retryable as retryable:
                failure = retryable
            except ValueError as error:  # a 4xx or a malformed answer: asking again gets the same
                return None, f"{self.label} at {self.url}: {error}", False
        attempts = f"{self.max_retries + 1} attempt(s)"
        return None, f"{self.label} at {self.url}: {failure} ({attempts})", failure.timed_out

    async def _post(self, client: httpx.AsyncClient, body: dict[str, Any]) -> _Answer:
        try:
            async with asyncio.timeout(self.timeout_s):  # the whole attempt, body included, not each phase of it
                async with client.stream("POST", self.url, json=body) as response:
                    answer = _Answer(response.status_code, await _read_capped(response))
        except (TimeoutError, httpx.TimeoutException) as error:
            raise _Retryable(f"timed out after {self.timeout_s:g}s", timed_out=True) from error
        except httpx.HTTPError as error:
            raise _Retryable(f"request failed ({type(error).__name__}: {error})") from error
        if answer.status >= 500 or answer.status == 429:
            raise _Retryable(f"the server answered {answer.status}: {answer.excerpt()}")
        return answer

    def _rewards(self, answer: _Answer, num_samples: int) -> list[float]:
        if answer.status >= 400:
            raise ValueError(f"the server answered {answer.status}: {answer.excerpt()}")
        try:
            reply = json.loads(answer.body)
        except ValueError as error:
            raise ValueError(f"the answer is not JSON ({answer.excerpt()})") from error
        key = "rewards" if self.is_group else "reward"
        if not isinstance(reply, dict) or key not in reply:
            raise ValueError(f'expected a JSON object {{"{key}": ...}}, got {answer.excerpt()}')
        values = reply[key] if self.is_group else [reply[key]]
        if not isinstance(values, list) or len(values) != num_samples:
            raise ValueError(
                f'"rewards" must be a list of {num_samples} numbers, one per sample, got {_REPR.repr(values)}'
            )
        for value in values:
            # bool is an int, as locally; an int is compared exactly, so a 400-digit one is refused, not converted
            if not isinstance(value, int | float) or not abs(value) <= MAX_ABS_REWARD:
                raise ValueError(f"a reward must be a finite number of magnitude at most {MAX_ABS_REWARD:g}, got "
                                 f"{_REPR.repr(value)}")  # fmt: skip
        return [float(v) for v in values]


async def _read_capped(response: httpx.Response) -> bytes:
    """The body, or ValueError once it is longer than `MAX_REPLY_BYTES` (said up front or found while reading)."""
    too_large = f"the answer is longer than {MAX_REPLY_BYTES} bytes"
    if int(response.headers.get("Content-Length") or 0) > MAX_REPLY_BYTES:
        raise ValueError(too_large)
    body = bytearray()
    async for chunk in response.aiter_bytes():
        body += chunk
        if len(body) > MAX_REPLY_BYTES:
            raise ValueError(too_large)
    return bytes(body)


def _cut(text: str) -> str:
    return text[:_MAX_BODY_SHOWN] + ("..." if len(text) > _MAX_BODY_SHOWN else "")


_REPR = reprlib.Repr()  # a value from an answer, shown in an error: bounded in length and depth whatever it is
_REPR.maxlevel, _REPR.maxlist, _REPR.maxlong, _REPR.maxstring, _REPR.maxother = 3, 8, 40, 60, 60
