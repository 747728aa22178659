"""The control process's request table: one record per live request, one state enum."""

from __future__ import annotations

import asyncio
import enum
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Protocol

from tetri_server.control.protocol import GenerationError
from tetri_server.messages import PromptLogprobs, SamplingParams, TokenDelta


class ReqState(enum.Enum):
    PREFILL = "prefill"  # sent to a prefill (or coupled) worker
    HANDOFF = "handoff"  # Handoff forwarded; the decode worker is pulling its KV
    DECODE = "decode"  # owned by a decode worker
    FINISHED = "finished"
    FAILED = "failed"
    ABORTED = "aborted"


DONE = (ReqState.FINISHED, ReqState.FAILED, ReqState.ABORTED)

# Workers know a request by its id with its attempt (``Request.num_reruns``) above this bit.
ATTEMPT_SHIFT = 40
ID_MASK = (1 << ATTEMPT_SHIFT) - 1


@dataclass(eq=False)
class Request:
    """Owned by the control process. ``owner``: the worker that will produce its next token;
    ``src``: during a hand-off, the prefill worker still holding its KV blocks."""

    req_id: int
    prompt_ids: list[int]
    params: SamplingParams
    prompt_text: str
    true_output_len: int | None
    arrival_s: float = field(default_factory=time.monotonic)
    owner: int = -1
    src: int = -1
    state: ReqState = ReqState.PREFILL
    output_ids: list[int] = field(default_factory=list)
    num_reruns: int = 0
    handoff_s: float = 0.0  # monotonic time the Handoff was forwarded (the latest, if refused)
    handoff_bytes: int = 0  # KV bytes the forwarded Handoff moves, counted once it is pulled
    first_token_s: float | None = None  # monotonic time its first token reached control
    scheduled_s: float | None = None  # monotonic time its worker scheduled its first chunk
    # prompt-logprobs parts received before the first token (join_prompt_part)
    prompt_part: PromptLogprobs | None = None
    # output-length bucket the prefill worker predicted (first delta, Handoff); -1: none
    predicted_bucket: int = -1
    # Waiting for a worker of a role that has none live (restarting): fail with 503 at this
    # monotonic time unless it got past that role by then. None: not waiting.
    wait_deadline_s: float | None = None
    # was in a step that crashed a worker (StepFailed), and has not streamed two tokens since
    # its re-run (a prefill step's and a decode step's: either kind may be what crashed)
    suspect: bool = False
    suspect_clear_at: int = 0  # len(output_ids) that clears ``suspect``
    queue: asyncio.Queue[TokenDelta | GenerationError] = field(default_factory=asyncio.Queue)

    @property
    def wire_id(self) -> int:
        """The id its workers know this attempt by (in every message both ways): a message
        about an attempt that was re-run, still on its way from a worker that was told to
        drop it, never counts for the next attempt, even one on that same worker."""
        return self.req_id | (self.num_reruns << ATTEMPT_SHIFT)


class StreamOwner(Protocol):
    def fail(self, req: Request, error: str | GenerationError,
             retry_after_s: float | None = None) -> None: ...
    def abort(self, req_id: int, *, stopped: bool = False) -> None: ...


class Stream:
    """The ``RequestStream`` the HTTP layer iterates. Each wait is bounded by
    ``token_timeout_s`` (a stalled request becomes a GenerationError, never a hang)."""

    def __init__(self, cluster: StreamOwner, req: Request, token_timeout_s: float) -> None:
        self.req_id = req.req_id
        self._cluster = cluster
        self._req = req
        self._timeout_s = token_timeout_s

    async def __aiter__(self) -> AsyncIterator[TokenDelta]:
        while True:
            try:  # not wait_for: on Python 3.11 it returned the item and dropped a cancel
                # (the client's disconnect, the HTTP deadline) that landed in the same turn
                async with asyncio.timeout(self._timeout_s):
                    item = await self._req.queue.get()
            except TimeoutError:
                # fail() also aborts the request on every worker that holds state for it
                self._cluster.fail(self._req, "no token within "
                                   f"{self._timeout_s:.0f} s (server overloaded or stalled)")
                raise GenerationError(f"request {self.req_id} timed out") from None
            if isinstance(item, GenerationError):
                raise item
            yield item
            if item.finish_reason is not None:
                return

    async def abort(self, *, stopped: bool = False) -> None:
        self._cluster.abort(self.req_id, stopped=stopped)
