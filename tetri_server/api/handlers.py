"""POST /v1/completions and /v1/chat/completions: validate, submit, stream or answer whole.

Every request is bounded by ``server.request_timeout_s`` from arrival, counted against
``server.max_queued_requests`` while in flight, and aborted in the backend on every way out
that is not a normal finish (``Generation.close`` in a ``finally``).
"""

from __future__ import annotations

import asyncio
import time
from contextlib import aclosing
from typing import Literal

from aiohttp import web

from tetri_server.api.body import parse_json_object, read_json_body
from tetri_server.api.errors import APIError, queue_full, timeout_error
from tetri_server.api.fields import Fields
from tetri_server.api.generation import Generation, Piece
from tetri_server.api.params import GenRequest, check_model, parse_request
from tetri_server.api.prompts import PromptLimits, chat_prompt, completion_prompt, end_of_turn_ids
from tetri_server.api.responses import ResponseBuilder
from tetri_server.api.sse import EventStream
from tetri_server.config import ServerConfig
from tetri_server.control.protocol import Backend
from tetri_server.metrics import Metrics

Kind = Literal["completion", "chat"]


class ApiState:
    """Per-app mutable state: requests in flight and whether the server is draining."""

    def __init__(self) -> None:
        self.in_flight = 0
        self.draining = False
        self.idle = asyncio.Event()
        self.idle.set()

    def enter(self) -> None:
        self.in_flight += 1
        self.idle.clear()

    def leave(self) -> None:
        self.in_flight -= 1
        if self.in_flight == 0:
            self.idle.set()


class GenerateHandlers:
    """The two generation routes of one app."""

    def __init__(
        self, backend: Backend, cfg: ServerConfig, metrics: Metrics, state: ApiState
    ) -> None:
        self.backend = backend
        self.cfg = cfg
        self.metrics = metrics
        self.state = state
        self._limits = PromptLimits.of(
            backend.tokenizer, vocab_size=backend.vocab_size, max_model_len=backend.max_model_len
        )
        self._end_of_turn = end_of_turn_ids(backend.tokenizer)

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, "completion")

    async def chat(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, "chat")

    def _parse(self, raw: bytes, kind: Kind) -> GenRequest:
        """Body bytes -> validated request. Runs in a worker thread: decoding, the chat template
        and tokenizing a large prompt take long enough to stall every other stream."""
        f = Fields(parse_json_object(raw))
        b = self.backend
        model = check_model(f, b.model_name)
        if kind == "chat":
            prompt = chat_prompt(f, b.tokenizer, self._limits)
            extra_stops = self._end_of_turn
        else:
            prompt = completion_prompt(f, b.tokenizer, self._limits)
            extra_stops = ()
        return parse_request(
            f,
            kind,
            prompt,
            model=model,
            max_model_len=self._limits.max_model_len,
            vocab_size=self._limits.vocab_size,
            extra_stop_ids=extra_stops,
        )

    async def _generate(self, request: web.Request, kind: Kind) -> web.StreamResponse:
        arrival_s = time.monotonic()
        if self.state.draining:
            raise APIError("the server is shutting down", status=503, code="shutting_down")
        raw = await read_json_body(
            request,
            max_bytes=self.cfg.max_body_bytes,
            timeout_s=min(self.cfg.body_timeout_s, self._remaining(arrival_s)),
        )
        req = await asyncio.to_thread(self._parse, raw, kind)
        if self.state.in_flight >= self.cfg.max_queued_requests:
            raise queue_full(1.0)
        gen = Generation(self.backend, req, self.metrics, arrival_s)
        gen.submit()
        self.state.enter()
        try:
            deadline = asyncio.get_running_loop().time() + self._remaining(arrival_s)
            if req.stream:
                return await self._stream(request, gen, deadline)
            return await self._whole(gen, deadline)
        finally:
            self.state.leave()

    def _remaining(self, arrival_s: float) -> float:
        return max(0.0, self.cfg.request_timeout_s - (time.monotonic() - arrival_s))

    async def _whole(self, gen: Generation, deadline: float) -> web.Response:
        pieces: list[Piece] = []
        client_gone = False
        try:
            async with asyncio.timeout_at(deadline), aclosing(gen.pieces()) as stream:
                async for piece in stream:
                    pieces.append(piece)
        except TimeoutError:
            raise timeout_error(self.cfg.request_timeout_s) from None
        except asyncio.CancelledError:  # the client went away (handler cancellation)
            client_gone = True
            raise
        finally:
            await gen.close(client_gone=client_gone)
        builder = ResponseBuilder(gen.req, self.backend.tokenizer)
        assert gen.finish_reason is not None
        body = builder.full(pieces, gen.finish_reason, gen.num_prompt_tokens, gen.num_output_tokens)
        return web.json_response(body)

    async def _stream(
        self, request: web.Request, gen: Generation, deadline: float
    ) -> web.StreamResponse:
        """SSE. Headers go out with the first chunk, so a request that fails before producing
        anything gets a real HTTP error status; later failures are an SSE error event."""
        builder = ResponseBuilder(gen.req, self.backend.tokenizer)
        sse = EventStream(request, builder.role_chunk())
        client_gone = False
        try:
            try:
                async with asyncio.timeout_at(deadline), aclosing(gen.pieces()) as stream:
                    async for piece in stream:
                        chunk = builder.chunk(piece)
                        if chunk is not None:
                            await sse.send(chunk)
            except TimeoutError:
                raise timeout_error(self.cfg.request_timeout_s) from None
            if gen.req.include_usage:
                await sse.send(builder.usage_chunk(gen.num_prompt_tokens, gen.num_output_tokens))
            await sse.done()
        except APIError as e:
            if not sse.opened:
                raise  # nothing sent yet: the error middleware answers with its status
            self.metrics.inc_error(e.kind)
            await sse.fail(e)
        except ConnectionResetError:
            client_gone = True
        except asyncio.CancelledError:
            client_gone = True
            raise
        finally:
            await gen.close(client_gone=client_gone)
        return sse.response
