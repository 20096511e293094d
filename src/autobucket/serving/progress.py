"""`Progress`: how a request's readers learn that its record changed, on any thread or event loop.

The engine's loop thread changes a request under `condition` and calls `changed()` (a new token) or
`changed(final=True)` (it ended); a thread waits on a condition, a coroutine on a future resolved through
its own event loop (`call_soon_threadsafe`), so awaiting a request never holds a thread of the caller's loop.

Two kinds of waiter: a stream's reader wakes at every change, a result's waiter only at the end. Waking a
result's waiter for every token cost the engine's thread a thread-safe call (a write to the event loop's
wake-up pipe, giving up the interpreter lock to the loop's thread) per token of every request in flight."""

from __future__ import annotations

import asyncio
import threading


class Progress:
    """A change counter with thread and asyncio waiters, for every change or for the final one."""

    def __init__(self) -> None:
        lock = threading.RLock()
        self.condition = threading.Condition(lock)
        self._ended = threading.Condition(lock)  # the same lock: readers hold `condition` to read the record
        self.changes = 0
        self.final = False
        self._futures: list[tuple[asyncio.AbstractEventLoop, asyncio.Future]] = []
        self._final_futures: list[tuple[asyncio.AbstractEventLoop, asyncio.Future]] = []

    def changed(self, final: bool = False) -> None:
        """Wake the waiters for any change, and with `final` those for the end (call with `condition` held)."""
        self.changes += 1
        self.condition.notify_all()
        futures, self._futures = self._futures, []
        if final:
            self.final = True
            self._ended.notify_all()
            futures, self._final_futures = futures + self._final_futures, []
        for loop, future in futures:
            if not loop.is_closed():
                loop.call_soon_threadsafe(_resolve, future)

    def wait(self, seen: int, timeout: float | None) -> bool:
        """Block until the counter passes `seen` (False: `timeout` seconds passed first)."""
        with self.condition:
            return self.condition.wait_for(lambda: self.changes != seen, timeout)

    def wait_final(self, timeout: float | None) -> bool:
        """Block until the final change (False: `timeout` seconds passed first)."""
        with self.condition:
            return self._ended.wait_for(lambda: self.final, timeout)

    async def wait_async(self, seen: int) -> None:
        """Return once the counter passes `seen`, without blocking the running loop."""
        loop = asyncio.get_running_loop()
        with self.condition:
            if self.changes != seen:
                return
            future = loop.create_future()
            self._futures.append((loop, future))
        await future

    async def wait_final_async(self) -> None:
        """Return once the final change has happened, without blocking the running loop."""
        loop = asyncio.get_running_loop()
        with self.condition:
            if self.final:
                return
            future = loop.create_future()
            self._final_futures.append((loop, future))
        await future


def _resolve(future: asyncio.Future) -> None:
    if not future.done():
        future.set_result(None)
