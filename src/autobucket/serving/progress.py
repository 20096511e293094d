"""`Progress`: how a request's readers learn that its record changed, on any thread or event loop.

The engine's loop thread changes a request under `condition` and calls `changed()`; a thread waits on
the condition, a coroutine on a future resolved through its own event loop (`call_soon_threadsafe`), so
awaiting a request never holds a thread of the caller's loop."""

from __future__ import annotations

import asyncio
import threading


class Progress:
    """A change counter with thread and asyncio waiters."""

    def __init__(self) -> None:
        self.condition = threading.Condition()
        self.changes = 0
        self._futures: list[tuple[asyncio.AbstractEventLoop, asyncio.Future]] = []

    def changed(self) -> None:
        """Wake every waiter (call with `condition` held)."""
        self.changes += 1
        self.condition.notify_all()
        futures, self._futures = self._futures, []
        for loop, future in futures:
            if not loop.is_closed():
                loop.call_soon_threadsafe(_resolve, future)

    def wait(self, seen: int, timeout: float | None) -> bool:
        """Block until the counter passes `seen` (False: `timeout` seconds passed first)."""
        with self.condition:
            return self.condition.wait_for(lambda: self.changes != seen, timeout)

    async def wait_async(self, seen: int) -> None:
        """Return once the counter passes `seen`, without blocking the running loop."""
        loop = asyncio.get_running_loop()
        with self.condition:
            if self.changes != seen:
                return
            future = loop.create_future()
            self._futures.append((loop, future))
        await future


def _resolve(future: asyncio.Future) -> None:
    if not future.done():
        future.set_result(None)
