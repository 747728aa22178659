"""Serving the app: bind with handler cancellation on, and drain on shutdown.

Handler cancellation matters: without it aiohttp lets a handler run on after its client
disconnected, so a non-streaming request (or a streaming one between tokens) would keep its KV
blocks until it finished on its own. With it, the handler is cancelled and its ``finally``
aborts the request.
"""

from __future__ import annotations

import asyncio
import logging

from aiohttp import web

from tetri_server.api.app import STATE

log = logging.getLogger(__name__)


async def start_site(
    app: web.Application, host: str, port: int, *, shutdown_timeout_s: float = 5.0
) -> tuple[web.AppRunner, int]:
    """Serve ``app`` on ``host:port`` (0 = any free port); returns the runner and the port.
    Stop with ``await runner.cleanup()``."""
    runner = web.AppRunner(
        app, handler_cancellation=True, access_log=None, shutdown_timeout=shutdown_timeout_s
    )
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    await site.start()
    bound = runner.addresses[0][1] if runner.addresses else port
    return runner, int(bound)


async def drain(app: web.Application, timeout_s: float) -> bool:
    """Refuse new requests (503, and /health reports 503) and wait up to ``timeout_s`` for the
    ones in flight. True if all finished in time."""
    state = app[STATE]
    state.draining = True
    log.info("draining: %d request(s) in flight, waiting up to %.0f s", state.in_flight, timeout_s)
    try:
        await asyncio.wait_for(state.idle.wait(), timeout_s)
    except TimeoutError:
        log.warning("drain timed out with %d request(s) still in flight", state.in_flight)
        return False
    return True
