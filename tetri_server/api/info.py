"""Routes about the model rather than generation, in vLLM's shapes:

``GET /v1/models``, ``GET /v1/models/{model}``  model cards (``root`` = the model folder)
``POST /tokenize``   ``{"prompt": str, "add_special_tokens"?: true}`` or ``{"messages": [...],
                     "add_generation_prompt"?: true, ...}`` -> ``{"count", "max_model_len",
                     "tokens", "token_strs"}`` (``token_strs`` when ``return_token_strs``)
``POST /detokenize`` ``{"tokens": [ids]}`` -> ``{"prompt": str}``
``GET /version``     ``{"version": "<tetri_server version>"}``
"""

from __future__ import annotations

import asyncio
import time
from importlib.metadata import PackageNotFoundError, version
from typing import Any

from aiohttp import web

from tetri_server.api.body import parse_json_object, read_json_body
from tetri_server.api.errors import APIError, bad_param
from tetri_server.api.fields import Fields
from tetri_server.api.models import ServedModel
from tetri_server.api.prompts import PromptLimits, chat_prompt, check_text_length, encode
from tetri_server.api.tools import check_tools
from tetri_server.config import ServerConfig
from tetri_server.control.protocol import Backend


def server_version() -> str:
    try:
        return version("tetri_server")
    except PackageNotFoundError:  # run from a checkout that was never installed
        return "0.0.0+unknown"


class InfoRoutes:
    def __init__(
        self, backend: Backend, served: ServedModel, cfg: ServerConfig, limits: PromptLimits
    ) -> None:
        self.backend = backend
        self.served = served
        self.cfg = cfg
        self.limits = limits
        self.created = int(time.time())

    def _card(self, name: str) -> dict[str, object]:
        return self.served.card(name, self.created, self.backend.max_model_len)

    async def models(self, request: web.Request) -> web.Response:
        data = [self._card(n) for n in self.served.names]
        return web.json_response({"object": "list", "data": data})

    async def model(self, request: web.Request) -> web.Response:
        name = request.match_info["model"]
        if name not in self.served.accepted:
            raise APIError(f"the model '{name}' does not exist", status=404, param="model",
                           code="model_not_found")
        return web.json_response(self._card(name if name in self.served.names else
                                            self.served.names[0]))

    async def version(self, request: web.Request) -> web.Response:
        return web.json_response({"version": server_version()})

    async def _body(self, request: web.Request) -> Fields:
        raw = await read_json_body(request, max_bytes=self.cfg.max_body_bytes,
                                   timeout_s=self.cfg.body_timeout_s)
        return Fields(await asyncio.to_thread(parse_json_object, raw))

    def _tokenize(self, f: Fields) -> dict[str, Any]:
        tok = self.backend.tokenizer
        self.served.check(f)
        if f.has("messages"):
            ids = chat_prompt(f, tok, self.limits, check_tools(f)).ids
        else:
            prompt = f.raw("prompt")
            if not isinstance(prompt, str):
                raise bad_param("prompt", "expected a string (or send 'messages')")
            check_text_length(len(prompt), "prompt", self.limits)
            ids = encode(tok, prompt, "prompt",
                         add_special_tokens=f.boolean("add_special_tokens", True))
        strs = tok.convert_ids_to_tokens(ids) if f.boolean("return_token_strs", False) else None
        return {"count": len(ids), "max_model_len": self.limits.max_model_len, "tokens": ids,
                "token_strs": strs}

    async def tokenize(self, request: web.Request) -> web.Response:
        f = await self._body(request)
        return web.json_response(await asyncio.to_thread(self._tokenize, f))

    def _detokenize(self, f: Fields) -> dict[str, Any]:
        self.served.check(f)
        if not f.has("tokens"):
            raise bad_param("tokens", "this field is required")
        ids = f.token_ids("tokens", vocab_size=self.limits.vocab_size,
                          max_items=self.limits.max_model_len)
        return {"prompt": self.backend.tokenizer.decode(ids)}

    async def detokenize(self, request: web.Request) -> web.Response:
        f = await self._body(request)
        return web.json_response(await asyncio.to_thread(self._detokenize, f))


def add_info_routes(app: web.Application, routes: InfoRoutes) -> None:
    app.router.add_get("/v1/models", routes.models)
    app.router.add_get("/v1/models/{model:.+}", routes.model)  # ids may hold '/' (org/name)
    app.router.add_get("/version", routes.version)
    app.router.add_post("/tokenize", routes.tokenize)
    app.router.add_post("/detokenize", routes.detokenize)
