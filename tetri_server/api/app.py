"""``build_app``: the aiohttp application of the OpenAI-compatible API.

Routes: POST /v1/completions, POST /v1/chat/completions, GET /v1/models[/{model}],
POST /tokenize, POST /detokenize, GET /version (``info.py``), GET /health (200 only while
``backend.is_ready()``), GET /metrics (Prometheus text), /admin/* (``admin.py``).
Middlewares, outermost first: every error is an OpenAI-style JSON body; Host and Origin checks
(on a loopback bind, or as configured); optional bearer keys on /v1/* and /admin/* (see
``guard.py``).
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable

from aiohttp import web

from tetri_server.api.admin import add_admin_routes
from tetri_server.api.errors import APIError, error_body, error_response
from tetri_server.api.guard import Cors, HostGuard, auth_middleware, host_middleware, load_keys
from tetri_server.api.handlers import ApiState, GenerateHandlers
from tetri_server.api.info import InfoRoutes, add_info_routes
from tetri_server.api.models import ServedModel
from tetri_server.api.prompts import PromptLimits
from tetri_server.config import ModelConfig, ServerConfig
from tetri_server.control.protocol import Backend
from tetri_server.metrics import Metrics

log = logging.getLogger(__name__)

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
STATE = web.AppKey("tetri_api_state", ApiState)
CONFIG = web.AppKey("tetri_server_config", ServerConfig)  # start_site reads its limits


def _error_middleware(metrics: Metrics) -> Callable[..., Awaitable[web.StreamResponse]]:
    @web.middleware
    async def errors(request: web.Request, handler: Handler) -> web.StreamResponse:
        try:
            return await handler(request)
        except APIError as e:
            metrics.inc_error(e.kind)
            level = logging.WARNING if e.status >= 500 and e.status != 503 else logging.DEBUG
            log.log(level, "%s %s -> %d %s", request.method, request.path, e.status, e.message)
            return error_response(e)
        except web.HTTPException as e:  # aiohttp's own: 404 no route, 405 wrong method, ...
            if e.status < 400:
                raise
            metrics.inc_error(f"http_{e.status}")
            message = f"{e.reason}: {request.method} {request.path}"
            headers = {k: v for k, v in e.headers.items() if k.lower() == "allow"}
            return web.json_response(
                error_body(message, e.status), status=e.status, headers=headers
            )
        except Exception:  # a bug: log it with its traceback, answer 500, keep serving
            log.exception("internal error on %s %s", request.method, request.path)
            metrics.inc_error("internal")
            body = error_body("internal server error", 500, code="internal_error")
            return web.json_response(body, status=500)

    return errors


class _HealthRoutes:
    """Health and metrics: open to probes and scrapers."""

    def __init__(self, backend: Backend, metrics: Metrics, state: ApiState) -> None:
        self.backend = backend
        self.metrics = metrics
        self.state = state

    async def health(self, request: web.Request) -> web.Response:
        if self.state.draining:
            raise APIError("the server is shutting down", status=503, code="shutting_down",
                           headers={"Retry-After": "1"})
        if not self.backend.is_ready():
            raise APIError(
                "the server is not ready: workers are starting or restarting",
                status=503,
                code="not_ready",
                headers={"Retry-After": "1"},
            )
        return web.json_response({"status": "ok"})

    async def prometheus(self, request: web.Request) -> web.Response:
        return web.Response(
            body=self.metrics.render(), headers={"Content-Type": self.metrics.content_type}
        )


def default_served_model(backend: Backend) -> ServedModel:
    """For a backend started without a ServedModel (tests): its name, its tokenizer's folder."""
    root = str(getattr(backend.tokenizer, "name_or_path", "") or backend.model_name)
    return ServedModel.from_config(ModelConfig(path=root), backend.model_name, root=root)


def build_app(
    backend: Backend, cfg: ServerConfig, metrics: Metrics, served: ServedModel | None = None
) -> web.Application:
    """The API application. Serve it with ``tetri_server.api.server.start_site`` (which turns
    on handler cancellation, so a client that disconnects aborts its request at once, and
    applies the connection limits). Reads ``server.api_key_file`` if set. ``served``: the
    model's names, folder and sampling defaults (``ServedModel.from_config``); None = the
    backend's name and its tokenizer's folder."""
    middlewares = [_error_middleware(metrics)]
    guard = HostGuard(cfg)
    if guard.active:
        middlewares.append(host_middleware(guard))
    keys = load_keys(cfg)
    if keys.v1 or keys.admin:
        middlewares.append(auth_middleware(keys))
    cors = Cors(cfg) if cfg.allowed_origins else None
    if cors is not None:
        middlewares.insert(0, cors.middleware())
    app = web.Application(client_max_size=cfg.max_body_bytes, middlewares=middlewares)
    if cors is not None:
        app.on_response_prepare.append(cors.on_prepare)
    state = ApiState()
    app[STATE] = state
    app[CONFIG] = cfg
    served = served or default_served_model(backend)
    gen = GenerateHandlers(backend, cfg, metrics, state, served)
    limits = PromptLimits.of(
        backend.tokenizer, vocab_size=backend.vocab_size, max_model_len=backend.max_model_len
    )
    health = _HealthRoutes(backend, metrics, state)
    app.router.add_post("/v1/completions", gen.completions)
    app.router.add_post("/v1/chat/completions", gen.chat)
    add_info_routes(app, InfoRoutes(backend, served, cfg, limits))
    app.router.add_get("/health", health.health)
    app.router.add_get("/metrics", health.prometheus)
    add_admin_routes(app, backend, cfg)
    return app
