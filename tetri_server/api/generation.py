"""One request's run against the backend: submit, stream token deltas, detokenize, match stop
strings, time it, and always abort what is left (client gone, stop string, timeout, error).

The handler owns a ``Generation`` for the life of the HTTP request and must call ``close()``
in a ``finally``: that is what frees the request's KV blocks when anything goes wrong.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncGenerator
from dataclasses import dataclass

from tetri_server.api.detokenizer import StopMatcher, make_detokenizer
from tetri_server.api.errors import (
    bad_param,
    generation_failed,
    queue_full,
    request_too_large,
    worker_unavailable,
)
from tetri_server.api.params import GenRequest
from tetri_server.control.protocol import (
    Backend,
    GenerationError,
    InvalidRequestError,
    QueueFullError,
    RequestStream,
    RequestTooLargeError,
    WorkerUnavailableError,
)
from tetri_server.messages import PromptLogprobs, TokenDelta
from tetri_server.metrics import Metrics

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Piece:
    """What one backend delta turned into: text safe to send (maybe empty), the tokens that
    arrived (with their logprobs when asked for), and the finish reason on the last piece."""

    text: str
    token_ids: list[int]
    logprobs: list[float] | None
    finish_reason: str | None
    top_logprobs: list[list[tuple[int, float]]] | None = None  # per token, best first
    index: int = 0  # the choice (n > 1)
    prompt_logprobs: PromptLogprobs | None = None  # on the first piece, when asked for
    # vLLM's stop_reason, on the last piece: the stop string matched, or the stop token id
    # (one of stop_token_ids, not an EOS) the backend stopped on; None otherwise
    stop_reason: int | str | None = None
    # echo: this many characters open text (the first piece's), no part of the model's reply
    # (a tool-call parser never reads them)
    echo_len: int = 0


class Generation:
    """Drives one ``RequestStream``. Not reusable."""

    def __init__(
        self, backend: Backend, req: GenRequest, metrics: Metrics, arrival_s: float,
        index: int = 0,
        *,
        sample: int = 0,
    ) -> None:
        self.req = req
        self.index = index  # the choice this generation answers
        self.sample = sample  # which of the prompt's n samples (seed + sample)
        self._backend = backend
        self._metrics = metrics
        self._arrival_s = arrival_s  # time.monotonic() when the HTTP request arrived
        self._stream: RequestStream | None = None
        self._detok = make_detokenizer(backend.tokenizer, req.prompt_ids,
                                       skip_special_tokens=req.skip_special_tokens)
        self._stops = StopMatcher(req.stop, include=req.include_stop_str)
        self.num_output_tokens = 0
        self.finish_reason: str | None = None
        self._echo_pending = req.echo
        self._first_delta = True
        self._backend_done = False  # the backend sent its last delta: nothing to abort
        self._first_s: float | None = None
        self._last_s: float | None = None

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.req.prompt_ids)

    def submit(self) -> None:
        """Hand the request to the backend; 429 at its queue limit."""
        r = self.req
        try:
            self._stream = self._backend.submit(
                r.prompt_ids, r.choice_params(self.sample), prompt_text=r.prompt_text,
                true_output_len=r.true_output_len,
            )
        except QueueFullError as e:
            raise queue_full(e.retry_after_s) from None
        except WorkerUnavailableError as e:
            raise worker_unavailable(str(e), e.retry_after_s) from None
        except RequestTooLargeError as e:
            raise request_too_large(str(e)) from None
        except GenerationError as e:
            raise generation_failed(str(e)) from None

    async def pieces(self) -> AsyncGenerator[Piece, None]:
        """Text pieces until the request finishes. Raises ``APIError`` if it fails."""
        assert self._stream is not None, "submit() first"
        try:
            async for delta in self._stream:
                piece = self._on_delta(delta)
                if piece.finish_reason == "stop" and delta.finish_reason is None:
                    await self._abort(stopped=True)  # a stop string matched: stop it now
                yield piece
                if piece.finish_reason is not None:
                    return
        except WorkerUnavailableError as e:
            raise worker_unavailable(str(e), e.retry_after_s) from None
        except RequestTooLargeError as e:
            raise request_too_large(str(e)) from None
        except InvalidRequestError as e:  # a worker could not compile the request's guide
            raise bad_param(self.req.guide_param or "request", str(e)) from None
        except GenerationError as e:
            raise generation_failed(str(e)) from None
        raise generation_failed("the backend ended the request's stream without finishing it")

    def _on_delta(self, delta: TokenDelta) -> Piece:
        now = time.monotonic()
        token_ids, logprobs, top_logprobs = delta.token_ids, delta.logprobs, delta.top_logprobs
        backend_reason = delta.finish_reason
        prompt = delta.prompt_logprobs if self._first_delta else None
        self._first_delta = False
        if self.req.prompt_only:  # echo with max_tokens=0: the one sampled token is dropped
            token_ids, logprobs, top_logprobs = [], None, None
            if backend_reason not in (None, "abort"):
                backend_reason = "length"
        if token_ids:
            gap_s = None if self._last_s is None else now - self._last_s
            if self._first_s is None:
                self._first_s = now
                self._metrics.observe_first_token(now - self._arrival_s, self.num_prompt_tokens)
            self._metrics.observe_tokens(len(token_ids), gap_s)
            self._last_s = now
            self.num_output_tokens += len(token_ids)
        final = self._backend_done = backend_reason is not None
        if backend_reason == "abort":
            raise generation_failed("the request was aborted by the server")
        # the stop token the backend stopped on (EOS, stop_token_ids; a complete grammar ends
        # with one too): like vLLM, its text is no part of the reply unless asked for
        stop_id = (token_ids[-1] if backend_reason == "stop" and token_ids
                   and (token_ids[-1] in self.req.params.stop_token_ids
                        or token_ids[-1] in self._backend.eos_token_ids) else None)
        keep_stop = stop_id is None or self.req.include_stop_str
        text_ids = token_ids if keep_stop else token_ids[:-1]
        # no stop string ends within the first min_tokens tokens' text (vLLM)
        below = self.req.params.min_tokens - (self.num_output_tokens - len(token_ids))
        if below > 0 and self.req.stop:
            head = self._detok.add(text_ids[:below])
            self._stops.min_end = self._stops.num_fed + len(head)
            text = head + self._detok.add(text_ids[below:], final=final)
        else:
            text = self._detok.add(text_ids, final=final)
        text, matched = self._stops.feed(text, final=final)
        stop_reason: int | str | None = self._stops.matched if matched else None
        if stop_reason is None and stop_id not in self._backend.eos_token_ids:
            stop_reason = stop_id  # vLLM names a stop token id, not an EOS
        echo_len = 0
        if self._echo_pending:  # echo: its text opens the first piece (never stop-matched)
            text, self._echo_pending = self.req.echo_text + text, False
            echo_len = len(self.req.echo_text)
        reason = "stop" if matched else backend_reason
        if reason is not None:
            self._finish(reason, now)
        if not self.req.logprobs:
            logprobs = top_logprobs = None
        return Piece(text, list(token_ids), logprobs, reason, top_logprobs, self.index, prompt,
                     stop_reason, echo_len)

    def _finish(self, reason: str, now: float) -> None:
        self.finish_reason = reason
        tpot = None
        if self._first_s is not None and self._last_s is not None and self.num_output_tokens > 1:
            tpot = (self._last_s - self._first_s) / (self.num_output_tokens - 1)
        self._metrics.observe_finished(
            reason, e2e_s=now - self._arrival_s, tpot_s=tpot,
            num_prompt_tokens=self.num_prompt_tokens, num_output_tokens=self.num_output_tokens)

    async def _abort(self, *, stopped: bool = False) -> None:
        if self._stream is not None:
            stream, self._stream = self._stream, None
            # shielded: the handler may be being cancelled (client gone); the abort must land
            await asyncio.shield(stream.abort(stopped=stopped))

    async def close(self, *, client_gone: bool = False) -> None:
        """Abort the request unless it finished; count a client that left. Idempotent."""
        if self.finish_reason is None and client_gone and self._stream is not None:
            self._metrics.observe_finished("abort")
            log.debug("client went away; aborting its request")
        if not self._backend_done:
            await self._abort()
