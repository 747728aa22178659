"""Server-sent events as OpenAI clients read them: ``data: <json>\\n\\n`` per chunk, then
``data: [DONE]``; a failure mid-stream is one ``data: {"error": {...}}`` event and no [DONE].

Headers go out with the first event, so a request that fails before its first token still gets
a real HTTP status. A write to a client that went away raises ``ConnectionResetError``
(aiohttp's ``ClientConnectionResetError`` derives from it); the handler turns that into an abort.
The writes that end a stream (usage, [DONE], an error event) come after the request's deadline
and wait at most ``TAIL_TIMEOUT_S`` for a client that stopped reading: then its connection is
closed (``ConnectionResetError``), never a handler waiting on it for good.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Any

import msgspec
from aiohttp import web

from tetri_server.api.errors import APIError

log = logging.getLogger(__name__)

TAIL_TIMEOUT_S = 30.0

HEADERS = {
    "Content-Type": "text/event-stream; charset=utf-8",
    "Cache-Control": "no-cache",
    "X-Accel-Buffering": "no",
}


class EventStream:
    """One SSE response, opened (headers sent) just before its first event."""

    def __init__(self, request: web.Request, first: list[dict[str, Any]] | None = None) -> None:
        self.response = web.StreamResponse(status=200, headers=HEADERS)
        self._request = request
        self._first = first or []  # sent right after the headers (the chat role chunks)
        self._encoder = msgspec.json.Encoder()

    @property
    def opened(self) -> bool:
        return self.response.prepared

    async def _write(self, obj: dict[str, Any]) -> None:
        await self.response.write(b"data: " + self._encoder.encode(obj) + b"\n\n")

    async def open(self) -> None:
        """Send the headers and the first chunks (the chat role), if not sent yet."""
        await self._open()

    async def _open(self) -> None:
        if not self.opened:
            await self.response.prepare(self._request)
            for obj in self._first:
                await self._write(obj)

    async def send(self, obj: dict[str, Any]) -> None:
        await self._open()
        await self._write(obj)

    async def done(self, last: dict[str, Any] | None = None) -> None:
        """``last`` (the usage chunk), then [DONE], and the end of the stream."""

        async def write() -> None:
            await self._open()
            if last is not None:
                await self._write(last)
            await self.response.write(b"data: [DONE]\n\n")
            await self.response.write_eof()

        await self._bounded(write)

    async def fail(self, err: APIError) -> None:
        """Send the error event and end the stream (best effort: the client may be gone)."""

        async def write() -> None:
            await self._write(err.body())
            await self.response.write_eof()

        try:
            await self._bounded(write)
        except ConnectionResetError:
            log.debug("client gone before the error event could be sent: %s", err.message)

    async def _bounded(self, write: Callable[[], Awaitable[None]]) -> None:
        """``write()`` within ``TAIL_TIMEOUT_S``, else close the connection."""
        try:
            async with asyncio.timeout(TAIL_TIMEOUT_S):
                await write()
        except TimeoutError:
            self._abort_connection()
            raise ConnectionResetError("the client stopped reading") from None
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if task is not None and task.cancelling():
                raise  # the handler itself is cancelled (the client went away)
            # aiohttp keeps the drain waiter a timeout cancelled mid-write: every later write
            # raises its CancelledError at once. The connection cannot be written to again.
            self._abort_connection()
            raise ConnectionResetError("the stream was cut mid-write") from None

    def _abort_connection(self) -> None:
        transport = self._request.transport
        if transport is not None:
            transport.abort()
