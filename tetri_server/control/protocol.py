"""What the HTTP layer needs from the serving backend (the control process's cluster).

The API (``tetri_server/api``) tokenizes, validates, detokenizes, matches stop strings and
streams; the backend schedules and runs. One ``RequestStream`` per request: iterate it for token
deltas; ``abort()`` it when the client goes away or a stop string matched.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any, Protocol

from tetri_server.messages import PromptLogprobs, SamplingParams, TokenDelta


class GenerationError(Exception):
    """The request cannot finish (worker died without a live replacement, timeout, transfer
    failure). The client gets an error (SSE error event or 5xx), never an empty 200."""


class WorkerUnavailableError(GenerationError):
    """No worker could take the request within the bound (all of its role restarting, server
    starting or stopping). Retryable: the client gets 503 with ``Retry-After``."""

    def __init__(self, message: str, retry_after_s: float = 5.0) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class RequestTooLargeError(GenerationError):
    """The request cannot be carried to a worker (a message larger than a ring): the client
    gets 413; retrying the same request cannot work."""


class InvalidRequestError(GenerationError):
    """A worker found the request itself bad (its guide does not compile): the client gets a
    400 naming the field the guide came from; retrying the same request cannot work."""


class QueueFullError(Exception):
    """Admission limit reached: the client gets 429 with ``Retry-After``."""

    def __init__(self, retry_after_s: float = 1.0) -> None:
        super().__init__("server is at its queue limit; retry later")
        self.retry_after_s = retry_after_s


def join_prompt_part(held: PromptLogprobs | None,
                     delta: TokenDelta) -> tuple[PromptLogprobs | None, bool]:
    """A worker streams a request's prompt logprobs in parts (``PromptLogprobs``); a backend
    gives them whole on the first token's delta. Returns what is still held back and whether
    ``delta`` goes on (a part alone, with no tokens, does not). A re-run from the prompt starts
    again from ``held = None``."""
    part = delta.prompt_logprobs
    if part is None:
        return held, True
    if held is not None:
        part = PromptLogprobs(held.logprobs + part.logprobs, held.ranks + part.ranks,
                              held.top + part.top)
    if not delta.token_ids and delta.finish_reason is None:
        return part, False
    delta.prompt_logprobs = part
    return None, True


class RequestStream(Protocol):
    req_id: int

    def __aiter__(self) -> AsyncIterator[TokenDelta]:
        """Token deltas in order; the last one has ``finish_reason`` set; the first one with
        tokens carries the whole ``prompt_logprobs`` when asked for. Raises
        ``GenerationError`` if the request fails. Every wait inside is bounded."""
        ...

    async def abort(self, *, stopped: bool = False) -> None:
        """Stop the request and free its blocks (within one worker step). Idempotent.
        ``stopped``: a stop string matched, so the request finished (with "stop")."""
        ...


class Backend(Protocol):
    model_name: str
    max_model_len: int
    tokenizer: Any  # a transformers tokenizer loaded from the model folder
    eos_token_ids: tuple[int, ...]
    vocab_size: int  # token ids must be < vocab_size (a tokenizer may be longer)

    def submit(self, prompt_ids: list[int], params: SamplingParams, *, prompt_text: str = "",
               true_output_len: int | None = None) -> RequestStream:
        """Register and schedule a request. Raises ``QueueFullError`` at the queue limit."""
        ...

    def is_ready(self) -> bool:
        """True only while every worker is up and ready (``GET /health``)."""
        ...
