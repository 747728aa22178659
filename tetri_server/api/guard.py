"""Who may use the API: Host and Origin checks for a workstation server, and the bearer keys.

A server bound to loopback is still reachable from the browser on the same machine: a web page
can point its own host name at 127.0.0.1 (DNS rebinding) and read the answers, or post to
http://127.0.0.1 from another site (CSRF). So on a loopback bind a request whose ``Host`` is
not a loopback name gets 421 and one whose ``Origin`` is not a localhost origin gets 403;
``server.allowed_hosts`` / ``server.allowed_origins`` accept more, and on other binds they are
the only check (empty = none). The keys come from the config, or from ``server.api_key_file``,
read here at start-up (config constructors do no I/O).
"""

from __future__ import annotations

import hmac
import logging
import os
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from urllib.parse import urlsplit

from aiohttp import web

from tetri_server.api.errors import APIError
from tetri_server.config import ConfigError, ServerConfig

log = logging.getLogger(__name__)

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
Middleware = Callable[[web.Request, Handler], Awaitable[web.StreamResponse]]
LOOPBACK_NAMES = frozenset({"localhost", "127.0.0.1", "::1"})


@dataclass(frozen=True)
class ApiKeys:
    """The bearer key each protected prefix needs; "" = that prefix is open."""

    v1: str
    admin: str


def load_keys(cfg: ServerConfig) -> ApiKeys:
    """The keys of ``cfg``, reading ``server.api_key_file`` when it is set."""
    api_key = _read_key_file(cfg.api_key_file) if cfg.api_key_file else cfg.api_key
    return ApiKeys(v1=api_key, admin=cfg.admin_api_key or api_key)


def _read_key_file(path: str) -> str:
    where = f"server.api_key_file = {path!r}"
    try:
        with open(path, encoding="utf-8") as f:
            mode = os.fstat(f.fileno()).st_mode
            key = f.read().strip()
    except OSError as e:
        raise ConfigError(f"{where}: cannot read it ({e.strerror})") from None
    except UnicodeDecodeError:
        raise ConfigError(f"{where}: not UTF-8 text") from None
    if not key:
        raise ConfigError(f"{where}: the file is empty")
    if mode & 0o077:
        log.warning("%s can be read by other users (mode %o); chmod 600 it", where, mode & 0o777)
    return key


def _host_name(header: str) -> str:
    """``Example.COM:8000`` -> ``example.com``; ``[::1]:8000`` -> ``::1``."""
    host = header.strip().lower()
    if host.startswith("["):
        return host[1 : host.find("]")] if "]" in host else host
    if host.count(":") == 1:
        host = host.partition(":")[0]
    return host.rstrip(".")


def _origin_host(origin: str) -> str | None:
    """The host of an ``http(s)://host[:port]`` origin; None for ``null`` or anything else."""
    try:
        parts = urlsplit(origin)
        return parts.hostname if parts.scheme in ("http", "https") else None
    except ValueError:
        return None


class HostGuard:
    """The Host and Origin rules of one ``ServerConfig``."""

    def __init__(self, cfg: ServerConfig) -> None:
        loopback = cfg.is_loopback  # may resolve the host name: once
        hosts = {_host_name(h) for h in cfg.allowed_hosts}
        if loopback:
            hosts |= LOOPBACK_NAMES | {_host_name(cfg.host)}
        self.hosts = frozenset() if "*" in hosts else frozenset(hosts)  # empty: any Host
        self.origins = frozenset(o.strip().lower().rstrip("/") for o in cfg.allowed_origins)
        self.localhost_origins = loopback
        self.check_origin = (loopback or bool(self.origins)) and "*" not in self.origins

    @property
    def active(self) -> bool:
        return bool(self.hosts) or self.check_origin

    def check(self, request: web.Request) -> None:
        host = request.headers.get("Host")  # absent: not a browser (they always send one)
        if self.hosts and host is not None and _host_name(host) not in self.hosts:
            raise APIError(
                f"the Host {host!r} is not served here; this server answers to "
                + ", ".join(sorted(self.hosts))
                + " (server.allowed_hosts adds names)",
                status=421,
                code="host_not_allowed",
            )
        origin = request.headers.get("Origin")
        if self.check_origin and origin is not None and not self._origin_ok(origin):
            raise APIError(
                f"requests from the web page origin {origin!r} are refused "
                "(server.allowed_origins adds origins)",
                status=403,
                code="origin_not_allowed",
            )

    def _origin_ok(self, origin: str) -> bool:
        if origin.strip().lower().rstrip("/") in self.origins:
            return True
        return self.localhost_origins and _origin_host(origin.strip()) in LOOPBACK_NAMES


class Cors:
    """CORS for browser clients, only when ``server.allowed_origins`` is set (vLLM's
    ``--allowed-origins``): an allowed ``Origin`` is echoed in ``Access-Control-Allow-Origin``
    on every answer, errors included (``on_prepare``), and preflights are answered 204 before
    the key check, which browsers cannot pass on a preflight (``middleware``, outermost). A
    preflight gets the request headers it asks for (the OpenAI JS SDK sends its
    ``X-Stainless-*`` headers), as vLLM allows all; ``Retry-After`` is readable by the page."""

    METHODS = "GET, POST, OPTIONS"
    HEADERS = "Authorization, Content-Type"
    MAX_AGE_S = 600

    def __init__(self, cfg: ServerConfig) -> None:
        self.origins = frozenset(o.strip().lower().rstrip("/") for o in cfg.allowed_origins)

    def allowed(self, origin: str | None) -> bool:
        if origin is None:
            return False
        return "*" in self.origins or origin.strip().lower().rstrip("/") in self.origins

    def middleware(self) -> Middleware:
        @web.middleware
        async def preflight(request: web.Request, handler: Handler) -> web.StreamResponse:
            if (request.method == "OPTIONS" and self.allowed(request.headers.get("Origin"))
                    and "Access-Control-Request-Method" in request.headers):
                asked = request.headers.get("Access-Control-Request-Headers", "").strip()
                return web.Response(status=204, headers={
                    "Access-Control-Allow-Methods": self.METHODS,
                    "Access-Control-Allow-Headers": asked or self.HEADERS,
                    "Access-Control-Max-Age": str(self.MAX_AGE_S),
                    "Vary": "Origin, Access-Control-Request-Headers",
                })
            return await handler(request)

        return preflight

    async def on_prepare(self, request: web.Request, response: web.StreamResponse) -> None:
        origin = request.headers.get("Origin")
        if self.allowed(origin):
            assert origin is not None
            response.headers["Access-Control-Allow-Origin"] = origin
            response.headers["Access-Control-Expose-Headers"] = "Retry-After"
            vary = [v.strip() for v in response.headers.get("Vary", "").split(",") if v.strip()]
            if "origin" not in (v.lower() for v in vary):
                response.headers["Vary"] = ", ".join([*vary, "Origin"])


def host_middleware(guard: HostGuard) -> Middleware:
    @web.middleware
    async def hosts(request: web.Request, handler: Handler) -> web.StreamResponse:
        guard.check(request)
        return await handler(request)

    return hosts


def auth_middleware(keys: ApiKeys) -> Middleware:
    """Bearer keys on /v1/*, /tokenize, /detokenize and /admin/*; health, version and metrics
    stay open for probes and scrapers."""
    guarded = [
        (prefix, name, f"Bearer {key}".encode())
        for prefix, name, key in (
            ("/v1/", "API key", keys.v1),
            ("/tokenize", "API key", keys.v1),
            ("/detokenize", "API key", keys.v1),
            ("/admin/", "admin API key" if keys.admin != keys.v1 else "API key", keys.admin),
        )
        if key
    ]

    @web.middleware
    async def auth(request: web.Request, handler: Handler) -> web.StreamResponse:
        for prefix, name, expected in guarded:
            if request.path.startswith(prefix):
                given = request.headers.get("Authorization", "").encode(errors="replace")
                if not hmac.compare_digest(given, expected):
                    raise APIError(
                        f"invalid or missing {name}: send 'Authorization: Bearer <key>'",
                        status=401,
                        code="invalid_api_key",
                        headers={"WWW-Authenticate": "Bearer"},
                    )
        return await handler(request)

    return auth
