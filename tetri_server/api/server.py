"""Serving the app: bind with handler cancellation on, bound connections, drain on shutdown.

Handler cancellation matters: without it aiohttp lets a handler run on after its client
disconnected, so a non-streaming request (or a streaming one between tokens) would keep its KV
blocks until it finished on its own. With it, the handler is cancelled and its ``finally``
aborts the request.

Connections: one idle (or still sending its request head) for ``server.keepalive_timeout_s`` is
closed; beyond ``server.max_connections`` open ones a new connection is answered 503 with
Retry-After and closed, without reaching the app.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Callable
from typing import cast

from aiohttp import web

from tetri_server.api.app import CONFIG, STATE
from tetri_server.api.errors import error_body
from tetri_server.hostinfo import listen_addresses

log = logging.getLogger(__name__)

MAX_REFUSED_HEAD_BYTES = 16 * 1024  # read this much of a refused request at most


async def start_site(
    app: web.Application, host: str, port: int, *, shutdown_timeout_s: float = 5.0
) -> tuple[web.AppRunner, int]:
    """Serve ``app`` (from ``build_app``) on ``host:port`` (0 = any free port); returns the
    runner and the port. Stop with ``await runner.cleanup()``."""
    cfg = app[CONFIG]
    runner = web.AppRunner(
        app,
        handler_cancellation=True,
        access_log=None,
        shutdown_timeout=shutdown_timeout_s,
        keepalive_timeout=cfg.keepalive_timeout_s,
    )
    await runner.setup()
    site = _CappedSite(runner, host, port, cfg.max_connections, cfg.keepalive_timeout_s)
    await site.start()
    bound = runner.addresses[0][1] if runner.addresses else port
    return runner, int(bound)


class _ConnectionCap:
    """Protocol factory: aiohttp's handler while fewer than ``limit`` connections are open,
    else a ``_Refusal``. Counted here, at accept, so a burst of connects cannot overshoot."""

    def __init__(self, factory: Callable[[], asyncio.Protocol], limit: int, wait_s: float):
        self.factory = factory
        self.limit = limit
        self.wait_s = wait_s
        self.num_open = 0
        body = error_body(
            f"the server is at its limit of {limit} open connections; retry later",
            503,
            code="too_many_connections",
        )
        data = json.dumps(body).encode()
        head = (
            "HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(data)}\r\nRetry-After: 1\r\nConnection: close\r\n\r\n"
        )
        self.refusal = head.encode() + data

    def __call__(self) -> asyncio.Protocol:
        if self.num_open >= self.limit:
            log.debug("refusing a connection: %d open (server.max_connections)", self.num_open)
            return _Refusal(self.refusal, self.wait_s)
        self.num_open += 1
        return _Counted(self.factory(), self)


class _Counted(asyncio.Protocol):
    """One admitted connection: forwards to aiohttp's handler, gives its slot back when lost."""

    def __init__(self, inner: asyncio.Protocol, cap: _ConnectionCap) -> None:
        self._inner = inner
        self._cap = cap

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._inner.connection_made(transport)

    def data_received(self, data: bytes) -> None:
        self._inner.data_received(data)

    def eof_received(self) -> bool | None:
        return self._inner.eof_received()

    def pause_writing(self) -> None:
        self._inner.pause_writing()

    def resume_writing(self) -> None:
        self._inner.resume_writing()

    def connection_lost(self, exc: Exception | None) -> None:
        self._cap.num_open -= 1
        self._inner.connection_lost(exc)


class _Refusal(asyncio.Protocol):
    """A connection over the limit: once its request head is in (so the client reads the
    answer rather than a reset), answer ``response`` and close; close after ``wait_s`` anyway."""

    def __init__(self, response: bytes, wait_s: float) -> None:
        self._response = response
        self._wait_s = wait_s
        self._head = b""
        self._transport: asyncio.Transport | None = None
        self._timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # (uvloop's TCPTransport is no asyncio.Transport subclass: an isinstance assert here
        # reset every connection over the cap, with a traceback each, instead of the 503)
        self._transport = cast(asyncio.Transport, transport)
        self._timer = asyncio.get_running_loop().call_later(self._wait_s, transport.close)

    def data_received(self, data: bytes) -> None:
        assert self._transport is not None
        if self._transport.is_closing():
            return
        self._head = (self._head + data)[-MAX_REFUSED_HEAD_BYTES:]
        if b"\r\n\r\n" in self._head or len(self._head) >= MAX_REFUSED_HEAD_BYTES:
            self._transport.write(self._response)
            self._transport.close()

    def connection_lost(self, exc: Exception | None) -> None:
        if self._timer is not None:
            self._timer.cancel()


class _CappedSite(web.BaseSite):
    """``web.TCPSite`` with the connection cap in front of the runner's protocol factory."""

    def __init__(
        self, runner: web.AppRunner, host: str, port: int, max_connections: int, wait_s: float
    ) -> None:
        super().__init__(runner)
        self._host = host
        self._port = port
        self._cap_args = (max_connections, wait_s)

    @property
    def name(self) -> str:
        return f"http://{self._host}:{self._port}"

    async def start(self) -> None:
        await super().start()
        server = self._runner.server
        assert server is not None
        cap = _ConnectionCap(server, *self._cap_args)
        loop = asyncio.get_running_loop()
        hosts = listen_addresses(self._host, self._port)  # not an address IPv6-off lacks
        target = self._host if hosts == [self._host] else hosts  # "" etc. as the loop reads it
        self._server = await loop.create_server(cap, target, self._port)


async def drain(app: web.Application, timeout_s: float) -> bool:
    """Refuse new requests (503, and /health reports 503) and wait up to ``timeout_s`` for the
    ones in flight. True if all finished in time."""
    state = app[STATE]
    state.draining = True
    log.info("draining: %d request(s) in flight and %d arriving, waiting up to %.0f s",
             state.in_flight, state.arriving, timeout_s)
    try:
        await asyncio.wait_for(state.idle.wait(), timeout_s)
    except TimeoutError:
        log.warning("drain timed out with %d request(s) still in flight", state.in_flight)
        return False
    return True
