"""Admin routes (behind ``server.admin_api_key``, else ``server.api_key``, when one is set):

``GET /admin/workers``  -> ``{"workers": [{"id", "role", "state", "load"}, ...]}``
``POST /admin/flip``    body ``{"worker": ID, "role": "prefill"|"decode"}`` -> 200 with the flip's
                        timings when done; 4xx with the reason when refused.
"""

from __future__ import annotations

import asyncio
from typing import Any

from aiohttp import web

from tetri_server.api.body import parse_json_object, read_json_body
from tetri_server.api.errors import APIError
from tetri_server.config import ServerConfig


class AdminRoutes:
    def __init__(self, backend: Any, cfg: ServerConfig) -> None:
        self.backend = backend
        self.cfg = cfg

    async def workers(self, request: web.Request) -> web.Response:
        return web.json_response({"workers": self.backend.workers_info()})

    async def flip(self, request: web.Request) -> web.Response:
        from tetri_server.control.flip import FlipRefused

        raw = await read_json_body(
            request, max_bytes=self.cfg.max_body_bytes, timeout_s=self.cfg.body_timeout_s
        )
        body = await asyncio.to_thread(parse_json_object, raw)  # a hostile body takes a while
        worker, role = body.get("worker"), body.get("role")
        if not isinstance(worker, int) or isinstance(worker, bool):
            raise APIError("'worker' must be an integer worker id", param="worker")
        if role not in ("prefill", "decode"):
            raise APIError("'role' must be 'prefill' or 'decode'", param="role")
        try:
            result = await self.backend.flip(worker, role)
        except FlipRefused as e:
            raise APIError(str(e), status=409, code="flip_refused") from e
        except TimeoutError as e:
            raise APIError("the worker did not drain in time", status=504,
                           code="flip_timeout") from e
        return web.json_response({"worker": result.worker_id, "from": result.from_role,
                                  "role": result.to_role, "total_s": result.total_s,
                                  "switch_s": result.switch_s})


def add_admin_routes(app: web.Application, backend: Any, cfg: ServerConfig) -> None:
    if not hasattr(backend, "flip"):
        return  # a backend without roles (tests' in-process double)
    admin = AdminRoutes(backend, cfg)
    app.router.add_get("/admin/workers", admin.workers)
    app.router.add_post("/admin/flip", admin.flip)
