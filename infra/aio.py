"""A private asyncio loop on a daemon thread, so synchronous code (Prefect tasks) can drive async clients.

An httpx.AsyncClient belongs to the loop it was created on; one long-lived loop lets a run keep one client
(and its connection pool) across all stages instead of a new loop per `asyncio.run`.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")


class BackgroundLoop:
    def __init__(self, name: str = "sluiceway-aio"):
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name=name, daemon=True)
        self._thread.start()

    def run(self, coro: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
        """Run `coro` on the loop and wait for its result (exceptions propagate to the caller)."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def close(self) -> None:
        if self.loop.is_closed():
            return
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=10)
        self.loop.close()

    def __enter__(self) -> BackgroundLoop:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
