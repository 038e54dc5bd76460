"""One request's outputs as the client hands them out: to threads or to an asyncio loop."""

from __future__ import annotations

import asyncio
import contextlib
import queue
from collections.abc import AsyncIterator, Iterator
from typing import Any

from engine.core import RequestOutput


class RequestStream:
    """Outputs of one request, in order, ending with a finished one.

    Created inside a running asyncio loop, it is awaited (``aget``, ``async for``); created
    elsewhere, it is read from threads (``get``, ``for``). Errors arrive as exceptions:
    RequestRejectedError (the engine refused it) or EngineDeadError.
    """

    def __init__(self, request_id: str) -> None:
        self.request_id = request_id
        try:
            self._loop: asyncio.AbstractEventLoop | None = asyncio.get_running_loop()
        except RuntimeError:
            self._loop = None
        self._queue: Any = asyncio.Queue() if self._loop else queue.Queue()
        self.finished = False

    def put(self, item: RequestOutput | Exception) -> None:
        """Called by the client's reader thread (``deliver`` hands over many at once)."""
        deliver([(self, item)])

    def _unwrap(self, item: RequestOutput | Exception) -> RequestOutput:
        if isinstance(item, Exception):
            self.finished = True
            raise item
        self.finished = item.finished
        return item

    def get(self, timeout: float | None = None) -> RequestOutput:
        if self._loop is not None:
            raise RuntimeError("this stream belongs to an asyncio loop: use aget()")
        return self._unwrap(self._queue.get(timeout=timeout))

    async def aget(self) -> RequestOutput:
        if self._loop is None:
            raise RuntimeError("this stream was made outside asyncio: use get()")
        return self._unwrap(await self._queue.get())

    def __iter__(self) -> Iterator[RequestOutput]:
        while not self.finished:
            yield self.get()

    async def __aiter__(self) -> AsyncIterator[RequestOutput]:
        while not self.finished:
            yield await self.aget()


def deliver(deliveries: list[tuple[RequestStream, RequestOutput | Exception]]) -> None:
    """Hand each item to its stream, waking each event loop once for all of its streams:
    one iteration's outputs for N requests cost one wake-up of the frontend's loop, not N."""
    by_loop: dict[asyncio.AbstractEventLoop, list] = {}
    for stream, item in deliveries:
        if stream._loop is None:
            stream._queue.put(item)
        else:
            by_loop.setdefault(stream._loop, []).append((stream._queue, item))
    for loop, items in by_loop.items():
        with contextlib.suppress(RuntimeError):  # the loop is closed: nobody is listening
            loop.call_soon_threadsafe(_put_all, items)


def _put_all(items: list[tuple[asyncio.Queue, RequestOutput | Exception]]) -> None:
    for stream_queue, item in items:
        stream_queue.put_nowait(item)
