"""Request lifetime on the HTTP side: a non-streaming request whose client goes away is cancelled, which aborts it in
the engine (`Engine.generate` frees its KV pages), instead of generating to `max_new_tokens` for nobody (routers
and fleets that re-issue a timed-out request would multiply that work). Streaming responses stop the same way when
their consumer leaves (`Engine.generate_stream`)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable
from typing import TypeVar

from starlette.requests import Request

T = TypeVar("T")


class ClientGone(Exception):
    """The client disconnected before its answer was ready; nobody reads the response."""


async def _disconnected(request: Request) -> None:
    """Returns when the client disconnects (the body is read already: the next ASGI message is the disconnect)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def unless_disconnected(request: Request, work: Awaitable[T]) -> T:
    """`work`'s result; if the client disconnects first, `work` is cancelled and `ClientGone` raised."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_disconnected(request))
    try:
        done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if task in done:
            return task.result()
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await task
        raise ClientGone
    finally:
        watcher.cancel()
        if not task.done():  # the handler itself was cancelled
            task.cancel()
