"""Streaming a request's samples from the engine thread to the request's event loop (`Engine.generate_stream`).

The engine thread hands over only what each sample gained per token (a `StreamDelta`: new ids, their log-prob
entries, new text; sequence.py), then each sample's final response. A `StreamChannel` carries them without ever
blocking the engine thread and without growing with a reader that lags: past `MAX_QUEUED_EVENTS` queued events, a
sample's new delta is merged into the one of it still waiting, so the channel holds at most that many events plus
two per sample, and no more tokens than the final responses will. A lagging reader therefore gets fewer, larger
events (as SGLang's tokenizer manager coalesces a stream's pending outputs).

The wire formats are assembled on the loop from those events: OpenAI's stream sends the deltas as they are;
SGLang's native `/generate` stream sends each sample's response so far (`ResponseSoFar`), SGLang's default.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections import deque
from dataclasses import dataclass
from typing import Any

from miles_contracts import GenerateResponse, MetaInfo
from miles_rollout.sequence import StreamDelta

MAX_QUEUED_EVENTS = 64


@dataclass(frozen=True)
class StreamEvent:
    """Sample `index` (over the request's samples, prompt-major) gained `delta`, or finished with `final` (its last
    event: the whole response, as `Engine.generate` returns it)."""

    index: int
    delta: StreamDelta | None = None
    final: GenerateResponse | None = None


class StreamChannel:
    """A streamed request's events, from the engine thread (`push`) to its loop (`take`)."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._lock = threading.Lock()
        self._events: deque[StreamEvent] = deque()
        self._waiting: dict[int, StreamDelta] = {}  # each sample's newest delta still in `_events`
        self._ready = asyncio.Event()
        self._is_wakeup_scheduled = False
        self._error: BaseException | None = None

    def push(self, index: int, payload: StreamDelta | GenerateResponse, is_last: bool) -> None:
        """Engine thread: sample `index` gained a delta, or finished (`is_last`, its final response). Never blocks."""
        with self._lock:
            if is_last:
                assert isinstance(payload, GenerateResponse)
                self._waiting.pop(index, None)
                self._events.append(StreamEvent(index, final=payload))
            else:
                assert isinstance(payload, StreamDelta)
                waiting = self._waiting.get(index)
                if waiting is not None and len(self._events) >= MAX_QUEUED_EVENTS:
                    waiting.merge(payload)
                else:
                    self._waiting[index] = payload
                    self._events.append(StreamEvent(index, delta=payload))
            if self._is_wakeup_scheduled:
                return
            self._is_wakeup_scheduled = True
        with contextlib.suppress(RuntimeError):  # the request's loop is closed: nobody reads any more
            self._loop.call_soon_threadsafe(self._ready.set)

    def fail(self, error: BaseException) -> None:
        """Loop thread: the engine failed the request; `take` raises `error` once the events before it are read."""
        self._error = error
        self._ready.set()

    async def take(self) -> list[StreamEvent]:
        """Loop thread: every event pushed since the last call, waiting for one if there is none."""
        while True:
            with self._lock:
                events = list(self._events)
                self._events.clear()
                self._waiting.clear()
                self._is_wakeup_scheduled = False
            if events:
                return events
            if self._error is not None:
                raise self._error
            await self._ready.wait()
            self._ready.clear()


class ResponseSoFar:
    """A sample's response so far, built on the loop from its deltas: what each event of SGLang's native stream
    sends (text and ids so far, `meta_info` with the log-prob entries so far)."""

    def __init__(self) -> None:
        self.text = ""
        self.output_ids: list[int] = []
        self.lists: dict[str, list[Any]] = {}  # the log-prob lists so far
        self.meta: dict[str, Any] = {}

    def add(self, delta: StreamDelta) -> GenerateResponse:
        self.text += delta.text
        self.output_ids += delta.output_ids
        self.meta = delta.meta
        for name in ("output_token_logprobs", "output_top_logprobs", "input_token_logprobs", "input_top_logprobs"):
            entries = getattr(delta, name)
            if entries is not None:
                self.lists.setdefault(name, []).extend(entries)
        meta: dict[str, Any] = {**self.meta, **self.lists}
        return GenerateResponse(text=self.text, output_ids=list(self.output_ids), meta_info=MetaInfo(**meta))
