"""POST /v1/completions and /v1/chat/completions: validate, submit, stream or answer whole.

Every request is bounded by ``server.request_timeout_s`` from arrival, counted against
``server.max_queued_requests`` while in flight (``n`` choices count n: each is one backend
request with its own derived seed), and aborted in the backend on every way out that is not a
normal finish (``Generation.close`` in a ``finally``).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import AsyncGenerator
from contextlib import aclosing
from typing import Literal

from aiohttp import web

from tetri_server.api.body import parse_json_object, read_json_body
from tetri_server.api.errors import (
    APIError,
    bad_param,
    generation_failed,
    queue_full,
    timeout_error,
)
from tetri_server.api.fields import Fields
from tetri_server.api.generation import Generation, Piece
from tetri_server.api.models import ServedModel
from tetri_server.api.params import MAX_REQUEST_ID, GenRequest, parse_request
from tetri_server.api.prompts import (
    PromptLimits,
    chat_prompt,
    completion_prompts,
    end_of_turn_ids,
)
from tetri_server.api.responses import ResponseBuilder
from tetri_server.api.sse import EventStream
from tetri_server.api.tools import parse_tools
from tetri_server.config import ServerConfig
from tetri_server.control.protocol import Backend
from tetri_server.metrics import Metrics

Kind = Literal["completion", "chat"]
MAX_CHOICES = 64  # prompts x n of one request: each choice is one backend request

log = logging.getLogger(__name__)


class ApiState:
    """Per-app mutable state: generations in flight (``in_flight``, the queue limit's count),
    requests still arriving (body read, parsed: ``arriving``) and whether the server is
    draining; ``idle`` once neither has any (the drain waits for it)."""

    def __init__(self) -> None:
        self.in_flight = 0
        self.arriving = 0
        self.draining = False
        self.idle = asyncio.Event()
        self.idle.set()

    def enter(self, n: int = 1) -> None:
        self.in_flight += n
        self.idle.clear()

    def leave(self, n: int = 1) -> None:
        self.in_flight -= n
        self._check_idle()

    def arrive(self) -> None:
        self.arriving += 1
        self.idle.clear()

    def arrived(self) -> None:
        self.arriving -= 1
        self._check_idle()

    def _check_idle(self) -> None:
        if self.in_flight == 0 and self.arriving == 0:
            self.idle.set()


async def merged(gens: list[Generation]) -> AsyncGenerator[Piece, None]:
    """The pieces of every generation, as they come (``Piece.index`` tells them apart). An
    error of any one is raised here; the others are left for the caller's ``close()``."""
    if len(gens) == 1:
        async with aclosing(gens[0].pieces()) as stream:
            async for piece in stream:
                yield piece
        return
    queue: asyncio.Queue[Piece | BaseException | None] = asyncio.Queue()

    async def pump(gen: Generation) -> None:
        try:
            async with aclosing(gen.pieces()) as stream:
                async for piece in stream:
                    queue.put_nowait(piece)
            queue.put_nowait(None)
        except Exception as e:  # noqa: BLE001 - handed to the consumer, which raises it
            queue.put_nowait(e)

    tasks = [asyncio.ensure_future(pump(g)) for g in gens]
    try:
        remaining = len(gens)
        while remaining:
            item = await queue.get()
            if item is None:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield item
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


class GenerateHandlers:
    """The two generation routes of one app."""

    def __init__(
        self, backend: Backend, cfg: ServerConfig, metrics: Metrics, state: ApiState,
        served: ServedModel,
    ) -> None:
        self.backend = backend
        self.served = served
        self.cfg = cfg
        self.metrics = metrics
        self.state = state
        self._limits = PromptLimits.of(
            backend.tokenizer, vocab_size=backend.vocab_size, max_model_len=backend.max_model_len
        )
        # stop ids added to every request unless ignore_eos: generation_config's EOS ids
        # (e.g. Llama 3's <|eot_id|>), and on chat the template's end-of-turn markers
        eos = tuple(i for i in served.defaults.eos_token_ids if i < backend.vocab_size)
        self._stop_ids = {"completion": eos,
                          "chat": eos + tuple(i for i in end_of_turn_ids(backend.tokenizer)
                                              if i not in eos)}

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, "completion")

    async def chat(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, "chat")

    def _parse(self, raw: bytes, kind: Kind) -> list[GenRequest]:
        """Body bytes -> validated requests, one per prompt (a completions batch). Runs in a
        worker thread: decoding, the chat template and tokenizing a large prompt take long
        enough to stall every other stream."""
        f = Fields(parse_json_object(raw))
        b = self.backend
        model = self.served.check(f)
        tool_parser, forced_call = None, None
        if kind == "chat":
            choice = parse_tools(f, self.served.tool_call_parser)
            tool_parser = self.served.tool_call_parser if choice.parse_calls else None
            forced_call = choice.forced
            prompts = [chat_prompt(f, b.tokenizer, self._limits, choice.tools)]
        else:
            prompts = completion_prompts(f, b.tokenizer, self._limits)
        reqs = [
            parse_request(
                f,
                kind,
                prompt,
                model=model,
                max_model_len=self._limits.max_model_len,
                vocab_size=self._limits.vocab_size,
                extra_stop_ids=self._stop_ids[kind],
                defaults=self.served.defaults,
                tool_parser=tool_parser,
                forced_call=forced_call,
            )
            for prompt in prompts
        ]
        if len(reqs) * reqs[0].n > MAX_CHOICES:
            raise bad_param("n", f"{len(reqs)} prompts times n = {reqs[0].n} is more than "
                                 f"{MAX_CHOICES} choices")
        return reqs

    async def _generate(self, request: web.Request, kind: Kind) -> web.StreamResponse:
        arrival_s = time.monotonic()
        if self.state.draining:
            raise APIError("the server is shutting down", status=503, code="shutting_down",
                           headers={"Retry-After": "1"})  # another replica, or the restart
        self.state.arrive()  # a drain from now on waits for it: it was accepted
        try:
            raw = await read_json_body(
                request,
                max_bytes=self.cfg.max_body_bytes,
                timeout_s=min(self.cfg.body_timeout_s, self._remaining(arrival_s)),
            )
            reqs = await asyncio.to_thread(self._parse, raw, kind)
            header_id = request.headers.get("X-Request-Id")
            if header_id:  # vLLM's id base: the header (its bytes as latin-1, as vLLM reads
                # them: aiohttp's surrogate escapes cannot be written as JSON), else the body's
                header_id = header_id.encode("utf-8", "surrogateescape").decode("latin-1")
                reqs = [dataclasses.replace(r, request_id=header_id[:MAX_REQUEST_ID])
                        for r in reqs]
            n = reqs[0].n
            # choice p * n + j: prompt p, sample j (seed + j)
            gens = [Generation(self.backend, req, self.metrics, arrival_s, p * n + j, sample=j)
                    for p, req in enumerate(reqs) for j in range(n)]
            if len(gens) > self.cfg.max_queued_requests:  # a retry could never succeed
                raise bad_param("n", f"{len(gens)} choices (prompts x n) are more than the "
                                     f"server takes at once ({self.cfg.max_queued_requests}, "
                                     "server.max_queued_requests)")
            if self.state.in_flight + len(gens) > self.cfg.max_queued_requests:
                raise queue_full(1.0)
            try:
                for gen in gens:
                    gen.submit()
            except APIError:
                await self._close(gens, False)
                raise
            self.state.enter(len(gens))
        finally:
            self.state.arrived()
        try:
            deadline = asyncio.get_running_loop().time() + self._remaining(arrival_s)
            if reqs[0].stream:
                return await self._stream(request, gens, deadline)
            return await self._whole(gens, deadline)
        finally:
            self.state.leave(len(gens))

    def _remaining(self, arrival_s: float) -> float:
        return max(0.0, self.cfg.request_timeout_s - (time.monotonic() - arrival_s))

    @staticmethod
    async def _close(gens: list[Generation], client_gone: bool) -> None:
        """Abort every choice's request, all under one shield: a cancel of the handler during
        the first abort must not leave the others running (n > 1, batched prompts)."""
        done = await asyncio.shield(asyncio.gather(
            *(g.close(client_gone=client_gone) for g in gens), return_exceptions=True))
        for error in done:
            if isinstance(error, BaseException):
                log.error("aborting a choice failed: %s: %s", type(error).__name__, error)

    @staticmethod
    def _usage(gens: list[Generation]) -> tuple[int, int]:
        """(prompt tokens, each prompt once; output tokens of every choice)."""
        prompt = sum(g.num_prompt_tokens for g in gens if g.sample == 0)
        return prompt, sum(g.num_output_tokens for g in gens)

    async def _whole(self, gens: list[Generation], deadline: float) -> web.Response:
        pieces: list[list[Piece]] = [[] for _ in gens]
        client_gone = False
        try:
            async with asyncio.timeout_at(deadline), aclosing(merged(gens)) as stream:
                async for piece in stream:
                    pieces[piece.index].append(piece)
        except TimeoutError:
            raise timeout_error(self.cfg.request_timeout_s) from None
        except asyncio.CancelledError:  # the client went away (handler cancellation)
            client_gone = True
            raise
        finally:
            await self._close(gens, client_gone)
        builder = ResponseBuilder(gens[0].req, self.backend.tokenizer, len(gens),
                                  [g.req.prompt_ids for g in gens])
        choices = []
        for gen, own in zip(gens, pieces, strict=True):
            assert gen.finish_reason is not None
            choices.append(builder.choice(gen.index, own, gen.finish_reason))
        return web.json_response(builder.full(choices, *self._usage(gens)))

    async def _stream(
        self, request: web.Request, gens: list[Generation], deadline: float
    ) -> web.StreamResponse:
        """SSE. Headers go out with the first chunk, so a request that fails before producing
        anything gets a real HTTP error status; later failures are an SSE error event."""
        req = gens[0].req
        builder = ResponseBuilder(req, self.backend.tokenizer, len(gens),
                                  [g.req.prompt_ids for g in gens])
        sse = EventStream(request, builder.role_chunks())
        client_gone = False
        try:
            try:
                async with asyncio.timeout_at(deadline), aclosing(merged(gens)) as stream:
                    async for piece in stream:
                        chunk = builder.chunk(piece)
                        if chunk is not None:
                            await sse.send(chunk)
                        elif not sse.opened:  # a parser holds the text (a forced call):
                            await sse.open()  # the headers and role chunk go at the first token
            except TimeoutError:
                raise timeout_error(self.cfg.request_timeout_s) from None
            await sse.done(builder.usage_chunk(*self._usage(gens)) if req.include_usage
                           else None)
        except APIError as e:
            if not sse.opened:
                raise  # nothing sent yet: the error middleware answers with its status
            self.metrics.inc_error(e.kind)
            await self._close(gens, client_gone)  # before the event: its client may not read
            await sse.fail(e)
        except ConnectionResetError:
            client_gone = True
        except asyncio.CancelledError:
            client_gone = True
            raise
        except Exception as e:  # a bug: the client gets an error event, not a cut stream
            if not sse.opened:
                raise  # nothing sent yet: the error middleware answers 500
            log.exception("stream failed after its first chunk")
            err = generation_failed(f"internal error ({type(e).__name__})")
            self.metrics.inc_error(err.kind)
            await self._close(gens, client_gone)
            await sse.fail(err)
        finally:
            await self._close(gens, client_gone)
        return sse.response
