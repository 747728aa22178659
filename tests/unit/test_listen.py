"""Where the server listens: ``localhost`` on a machine with IPv6 disabled (docker's default:
the name resolves to ``::1`` too, which cannot be bound) serves on 127.0.0.1 rather than
refusing to start."""

from __future__ import annotations

import asyncio
import errno
import socket
import urllib.request

import pytest
import uvloop

from tetri_server.cli import port_error
from tetri_server.hostinfo import listen_addresses


@pytest.fixture
def ipv6_off(monkeypatch: pytest.MonkeyPatch) -> None:
    """``localhost`` resolves to ::1 and 127.0.0.1; binding ::1 fails with EADDRNOTAVAIL, as
    with net.ipv6.conf.lo.disable_ipv6 = 1."""
    real_socket, real_getaddrinfo = socket.socket, socket.getaddrinfo

    class Socket(real_socket):
        def bind(self, addr):  # noqa: ANN001, ANN202
            if self.family == socket.AF_INET6:
                raise OSError(errno.EADDRNOTAVAIL, "Cannot assign requested address")
            return super().bind(addr)

    def getaddrinfo(host, port, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
        if host == "localhost":
            return [(socket.AF_INET6, socket.SOCK_STREAM, 6, "", ("::1", port, 0, 0)),
                    (socket.AF_INET, socket.SOCK_STREAM, 6, "", ("127.0.0.1", port))]
        return real_getaddrinfo(host, port, *args, **kwargs)

    monkeypatch.setattr(socket, "socket", Socket)
    monkeypatch.setattr(socket, "getaddrinfo", getaddrinfo)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_localhost_with_ipv6_off_is_listened_on_over_ipv4(ipv6_off: None) -> None:
    """Regression: the start-up check bound every address of the name and refused to start
    ("Cannot assign requested address") where the server itself would skip ::1."""
    port = free_port()
    assert listen_addresses("localhost", port) == ["127.0.0.1"]
    assert port_error("localhost", port) is None


def test_a_busy_port_is_still_found_behind_an_unusable_address(ipv6_off: None) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        error = port_error("localhost", busy.getsockname()[1])
    assert error is not None and "is another server there?" in error


def test_the_site_listens_on_the_usable_addresses_under_uvloop() -> None:
    """The site binds the list ``listen_addresses`` gives, under uvloop (whose create_server
    does not skip EADDRNOTAVAIL itself); this host's IPv6 state decides whether ::1 is in
    it, so only the port check above reproduces the IPv6-off failure everywhere."""
    from aiohttp import web

    from tetri_server.api.server import _CappedSite  # noqa: PLC2701 - the site under test

    async def main() -> bytes:
        async def up(_: web.Request) -> web.Response:
            return web.Response(text="up")

        app = web.Application()
        app.router.add_get("/", up)
        runner = web.AppRunner(app)
        await runner.setup()
        port = free_port()
        site = _CappedSite(runner, "localhost", port, 8, 5.0)
        await site.start()
        try:
            loop = asyncio.get_running_loop()
            return await loop.run_in_executor(None, lambda: urllib.request.urlopen(
                f"http://127.0.0.1:{port}/", timeout=10).read())
        finally:
            await runner.cleanup()

    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        assert runner.run(main()) == b"up"
