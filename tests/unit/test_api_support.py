"""Harness for the API tests (no tests here): a server thread, fixtures and HTTP helpers.

``ApiHarness`` runs one event loop in a background thread holding one backend, and serves any
number of apps (different ``ServerConfig``s) on it at 127.0.0.1, port 0. Tests are plain
synchronous functions using the real ``openai`` client or raw HTTP. Test modules load the
fixtures with ``pytest_plugins = ["tests.unit.test_api_support"]``.

Other backends: the ``api`` fixture is parametrised over ``BACKEND_FACTORIES``
(``async factory(model_path, metrics) -> (backend, close)``); the default is the test double
in ``test_api_double.py``. To run a suite against the real cluster elsewhere, star-import the
test module and define a module-level ``api`` fixture there returning an ``ApiHarness`` over
the cluster factory (a module's own fixture overrides the plugin's). Tests that need the
double's fault knobs skip themselves on other backends; ``slow_generation`` is a no-op there.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import http.client
import json
import socket
import threading
import time
from collections.abc import Awaitable, Callable, Coroutine, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.unit.test_api_double import MODEL_NAME, Close, EngineBackend, make_engine_backend
from tetri_server.api import build_app, start_site
from tetri_server.config import ServerConfig
from tetri_server.metrics import Metrics

Factory = Callable[[Path, Metrics], Awaitable[tuple[Any, Close]]]


BACKEND_FACTORIES: dict[str, Factory] = {"engine": make_engine_backend}


class ApiHarness:
    """One event-loop thread (uvloop, as ``serve`` runs), one backend, any number of served
    apps."""

    def __init__(self, factory: Factory, model_path: Path) -> None:
        import uvloop

        self.loop = uvloop.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self._thread.start()
        self.metrics = Metrics(model_name=MODEL_NAME)
        self.backend, self._close_backend = self.run(factory(model_path, self.metrics), 300)
        self._runners: list[Any] = []
        self.apps: dict[str, Any] = {}  # base_url -> aiohttp Application
        self.base_url = self.serve()

    def run(self, coro: Coroutine[Any, Any, Any], timeout_s: float = 30) -> Any:
        """Run a coroutine on the server loop and return its result."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout_s)

    def serve(self, backend: Any = None, served: Any = None, **server: Any) -> str:
        """Serve a new app over ``backend`` (default: the shared one) and ``served`` (a
        ``ServedModel``; default: the backend's); ``server`` overrides ServerConfig fields."""
        cfg = dataclasses.replace(ServerConfig(port=0, request_timeout_s=60.0), **server)

        async def start() -> tuple[Any, Any, int]:
            app = build_app(backend or self.backend, cfg, self.metrics, served)
            return (app, *await start_site(app, "127.0.0.1", 0))

        app, runner, port = self.run(start())
        self._runners.append(runner)
        url = f"http://127.0.0.1:{port}"
        self.apps[url] = app
        return url

    def close(self) -> None:
        async def stop() -> None:
            for runner in self._runners:
                await runner.cleanup()
            await self._close_backend()

        self.run(stop())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10)
        self.loop.close()


@pytest.fixture(scope="module", params=sorted(BACKEND_FACTORIES))
def api(request: pytest.FixtureRequest, model_dir: Any) -> Any:
    """The harness for this module, over each registered backend."""
    harness = ApiHarness(BACKEND_FACTORIES[request.param], model_dir("llama", "tiny"))
    yield harness
    harness.close()


@contextlib.contextmanager
def slow_generation(api: ApiHarness, step_delay_s: float = 0.02) -> Iterator[None]:
    """Make tokens come slowly enough for a test to act mid-request (the test double's
    ``step_delay_s``; another backend is left as it is, being slower than the double)."""
    backend = api.backend
    if not isinstance(backend, EngineBackend):
        yield
        return
    backend.step_delay_s = step_delay_s
    try:
        yield
    finally:
        backend.step_delay_s = 0.0


def double(api: ApiHarness) -> EngineBackend:
    """The test double behind ``api``; skips tests that need its knobs on other backends."""
    if not isinstance(api.backend, EngineBackend):
        pytest.skip("needs the test double's fault knobs")
    return api.backend


@dataclasses.dataclass
class Reply:
    status: int
    headers: dict[str, str]
    body: bytes

    def json(self) -> Any:
        return json.loads(self.body)


def raw_request(
    base_url: str,
    method: str,
    path: str,
    body: bytes | dict[str, Any] | None = None,
    headers: dict[str, str] | None = None,
    timeout_s: float = 60,
) -> Reply:
    """One raw HTTP request (bodies that the openai client would refuse to send)."""
    host, port = base_url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=timeout_s)
    data = json.dumps(body).encode() if isinstance(body, dict) else body
    hdrs = {"Content-Type": "application/json", **(headers or {})}
    try:
        conn.request(method, path, body=data, headers=hdrs)
        resp = conn.getresponse()
        return Reply(resp.status, {k.lower(): v for k, v in resp.getheaders()}, resp.read())
    finally:
        conn.close()


def sse_data(body: bytes) -> list[str]:
    """The ``data:`` payloads of an SSE body, in order."""
    return [
        line[len("data: ") :] for line in body.decode().split("\n") if line.startswith("data: ")
    ]


def metric(base_url: str, name: str, **labels: str) -> float:
    """Sum of the samples of ``name`` with ``labels`` on the server's /metrics page."""
    from prometheus_client.parser import text_string_to_metric_families

    text = raw_request(base_url, "GET", "/metrics").body.decode()
    return sum(
        s.value
        for fam in text_string_to_metric_families(text)
        for s in fam.samples
        if s.name == name and all(s.labels.get(k) == v for k, v in labels.items())
    )


def wait_until(check: Callable[[], bool], timeout_s: float = 20.0) -> bool:
    """Poll ``check`` (test code only) until it holds or ``timeout_s`` passes."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if check():
            return True
        time.sleep(0.05)
    return check()


def open_stream(base_url: str, path: str, body: dict[str, Any]) -> socket.socket:
    """Send a POST by hand and return the socket, so a test can drop it mid-response."""
    host, port = base_url.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)), timeout=30)
    data = json.dumps(body).encode()
    head = (
        f"POST {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(data)}\r\n\r\n"
    )
    sock.sendall(head.encode() + data)
    return sock


def read_events(sock: socket.socket, *, until: bytes, count: int = 1) -> bytes:
    """Read from ``sock`` until ``until`` was seen ``count`` times (or EOF)."""
    got = b""
    while got.count(until) < count:
        chunk = sock.recv(65536)
        if not chunk:
            break
        got += chunk
    return got
