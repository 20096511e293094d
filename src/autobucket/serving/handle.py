"""`RequestHandle`: what `AsyncEngine.submit` returns. Await the result, iterate the tokens as they are
made (from a thread or a coroutine), or abort the request; every reader sees the one request record."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Generator, Iterator
from typing import Any

from autobucket.serving.request import Request, RequestOutput, StreamChunk


class RequestHandle:
    """One submitted request. `result()` blocks a thread; `await handle` suspends a coroutine."""

    def __init__(self, request: Request, abort: Callable[[str], None]) -> None:
        self._request = request
        self._abort = abort

    @property
    def request_id(self) -> str:
        return self._request.request_id

    def done(self) -> bool:
        with self._request.progress.condition:
            return self._request.done

    def snapshot(self) -> RequestOutput:
        """What it has made so far (`finish_reason` None while it runs)."""
        with self._request.progress.condition:
            return self._request.output()

    def abort(self) -> None:
        """Stop it at the engine's next step: its row is freed and the tokens so far are its result, with
        finish reason "abort" (a request already finished keeps its result)."""
        self._abort(self.request_id)

    def result(self, timeout: float | None = None) -> RequestOutput:
        """Block until it finishes; the model's error, if one stopped it, is raised here."""
        progress = self._request.progress
        with progress.condition:
            if not progress.wait_final(timeout):
                raise TimeoutError(f"request {self.request_id!r} did not finish within {timeout} s")
            return self._finished()

    async def wait(self) -> RequestOutput:
        """The result, awaited without blocking the event loop (woken once, when it ends)."""
        await self._request.progress.wait_final_async()
        with self._request.progress.condition:
            return self._finished()

    def __await__(self) -> Generator[Any, None, RequestOutput]:
        return self.wait().__await__()

    def stream(self, timeout: float | None = None) -> Iterator[StreamChunk]:
        """Chunks of new tokens as they are made, from a thread; the last carries the finish reason.
        `timeout`: the most seconds to wait for any one chunk (TimeoutError after)."""
        start = 0
        while True:
            with self._request.progress.condition:
                chunk, seen = self._chunk(start), self._request.progress.changes
            if chunk is not None:
                start += len(chunk.tokens)
                yield chunk
                if chunk.finish_reason is not None:
                    return
            elif not self._request.progress.wait(seen, timeout):
                raise TimeoutError(f"request {self.request_id!r} made nothing within {timeout} s")

    async def __aiter__(self) -> AsyncIterator[StreamChunk]:
        start = 0
        while True:
            with self._request.progress.condition:
                chunk, seen = self._chunk(start), self._request.progress.changes
            if chunk is not None:
                start += len(chunk.tokens)
                yield chunk
                if chunk.finish_reason is not None:
                    return
            else:
                await self._request.progress.wait_async(seen)

    def _chunk(self, start: int) -> StreamChunk | None:
        """New tokens from `start`, or the end; None when there is nothing new (condition held)."""
        request = self._request
        if request.error is not None:
            raise request.error
        if len(request.tokens) > start or request.finish_reason is not None:
            return request.chunk_from(start)
        return None

    def _finished(self) -> RequestOutput:
        if self._request.error is not None:
            raise self._request.error
        return self._request.output()
