"""Trainer rank 0's clients of the engines, for the transports whose rank 0 talks to them itself (http, distributed).

A trainer rank's calls are synchronous (a Ray actor method); the clients are asyncio ones. They are kept across syncs
on one event loop of the rank's own, which every call runs to completion: a new connection per sync costs ~30 ms.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Coroutine, Iterable
from typing import Any, TypeVar

from miles_rollout import Client

T = TypeVar("T")


class EngineClients:
    """A client of every engine (`clients`, engine order; rank 0 only: the other ranks hold none) on one event loop."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.clients: list[Client] = []

    def connect(self, urls: list[str], admin_key: str) -> None:
        """Clients of the engines at `urls` (at start-up, and after engine restarts: new URLs)."""
        self.clients = [Client(url, api_key=admin_key, admin_key=admin_key, timeout=600) for url in urls]

    def run(self, coroutine: Coroutine[Any, Any, T]) -> T:
        """`coroutine` run to completion on the loop."""
        return self.loop.run_until_complete(coroutine)

    def gather(self, calls: Iterable[Awaitable[T]]) -> list[T]:
        """`calls` (one per engine) run at once on the loop; the replies in their order."""
        return self.run(_together(*calls))


async def _together(*calls: Awaitable[T]) -> list[T]:
    """`asyncio.gather` inside a coroutine, so that it runs on the loop that runs the coroutine."""
    return list(await asyncio.gather(*calls))
