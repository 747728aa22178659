"""Server-sent events as OpenAI clients read them: ``data: <json>\\n\\n`` per chunk, then
``data: [DONE]``; a failure mid-stream is one ``data: {"error": {...}}`` event and no [DONE].

Headers go out with the first event, so a request that fails before its first token still gets
a real HTTP status. A write to a client that went away raises ``ConnectionResetError``
(aiohttp's ``ClientConnectionResetError`` derives from it); the handler turns that into an abort.
"""

from __future__ import annotations

import logging
from typing import Any

import msgspec
from aiohttp import web

from tetri_server.api.errors import APIError

log = logging.getLogger(__name__)

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

    async def _open(self) -> None:
        if not self.opened:
            await self.response.prepare(self._request)
            for obj in self._first:
                await self._write(obj)

    async def send(self, obj: dict[str, Any]) -> None:
        await self._open()
        await self._write(obj)

    async def done(self) -> None:
        await self._open()
        await self.response.write(b"data: [DONE]\n\n")
        await self.response.write_eof()

    async def fail(self, err: APIError) -> None:
        """Send the error event and end the stream (best effort: the client may be gone)."""
        try:
            await self._write(err.body())
            await self.response.write_eof()
        except ConnectionResetError:
            log.debug("client gone before the error event could be sent: %s", err.message)
