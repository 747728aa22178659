"""The request table of the control process: one record per live request (states in
``requests.py``), the one admission limit, failing and aborting, and the requests that wait
(bounded) for a worker of a role that has none live.

Ownership: a request is in ``requests`` from ``add`` until it finishes, fails or is aborted;
``owner``/``src`` name the workers that hold state for it, and only this table posts the
``Abort`` that frees it there.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator, Mapping

from tetri_server.control.protocol import GenerationError, QueueFullError, WorkerUnavailableError
from tetri_server.control.requests import DONE, ID_MASK, ReqState, Request
from tetri_server.control.supervisor import WorkerHandle
from tetri_server.messages import Abort, SamplingParams

MAX_PROMPT_TEXT_CHARS = 64 * 1024


class RequestTable:
    def __init__(self, workers: Mapping[int, WorkerHandle], max_requests: int) -> None:
        self.workers = workers
        self.max_requests = max_requests
        self.requests: dict[int, Request] = {}
        self.parked: list[Request] = []  # no live worker of the entry role: waiting for one
        self._next_id = 0
        self._drained = asyncio.Event()

    def __len__(self) -> int:
        return len(self.requests)

    def __iter__(self) -> Iterator[Request]:
        return iter(list(self.requests.values()))

    def get(self, req_id: int) -> Request | None:
        return self.requests.get(req_id)

    def of(self, wire_id: int) -> Request | None:
        """The request a worker's message is about (``Request.wire_id``); None if it is gone
        or the message is about an attempt before its re-run."""
        req = self.requests.get(wire_id & ID_MASK)
        return req if req is not None and req.wire_id == wire_id else None

    def add(self, prompt_ids: list[int], params: SamplingParams, prompt_text: str,
            true_output_len: int | None) -> Request:
        """A new request; QueueFullError at the admission limit."""
        if len(self.requests) >= self.max_requests:
            raise QueueFullError(retry_after_s=1.0)
        # The text only feeds the length predictor; bounded, so an AddRequest always fits a ring.
        req = Request(self._next_id, list(prompt_ids), params,
                      prompt_text[:MAX_PROMPT_TEXT_CHARS], true_output_len)
        self._next_id += 1
        self.requests[req.req_id] = req
        return req

    def forget(self, req_id: int) -> Request | None:
        req = self.requests.pop(req_id, None)
        if req is not None and req in self.parked:
            self.parked.remove(req)
        if not self.requests:
            self._drained.set()
        return req

    def finish(self, req: Request) -> None:
        req.state = ReqState.FINISHED
        self.forget(req.req_id)

    def abort(self, req_id: int) -> None:
        """The client went away (or a stop string matched): free it everywhere."""
        req = self.forget(req_id)
        if req is None:
            return
        req.state = ReqState.ABORTED
        self._abort_on_workers(req)

    def fail(self, req: Request, error: str | GenerationError,
             retry_after_s: float | None = None) -> None:
        """The request ends with an error for its client: 503 + Retry-After when
        ``retry_after_s`` is given (retrying may work), a given ``GenerationError`` subclass
        as it is, else a generation error."""
        if req.state in DONE:
            return
        req.state = ReqState.FAILED
        self.forget(req.req_id)
        if isinstance(error, str):
            error = (GenerationError(error) if retry_after_s is None
                     else WorkerUnavailableError(error, retry_after_s))
        req.queue.put_nowait(error)
        self._abort_on_workers(req)

    def _abort_on_workers(self, req: Request) -> None:
        for wid in {req.owner, req.src} - {-1}:
            h = self.workers.get(wid)
            if h is not None and h.alive:
                h.post(Abort(req.wire_id))

    # ------------------------------------------------------------------ waiting for a worker

    def park(self, req: Request, deadline_s: float) -> None:
        """No live worker can start the request: it waits until ``take_parked`` (a worker is
        ready) or, at the latest, ``deadline_s`` (then ``expired`` names it)."""
        req.owner, req.src, req.state = -1, -1, ReqState.PREFILL
        if req.wait_deadline_s is None:
            req.wait_deadline_s = deadline_s
        if req not in self.parked:
            self.parked.append(req)

    def take_parked(self) -> list[Request]:
        parked, self.parked = self.parked, []
        return [r for r in parked if r.state not in DONE and r.req_id in self.requests]

    def expired(self, now_s: float, decode_serving: bool) -> list[Request]:
        """Requests still waiting for a worker past their deadline: parked ones, and those
        routed while no decode worker was serving (held for one after their prompt) while
        there is still none. Once one serves, the latter wait for nothing: their deadlines
        go (a request kept decoding on its prefill worker, or queued there behind prompts,
        must not be cut off by an outage that is over)."""
        if decode_serving:
            for r in self.requests.values():
                if r not in self.parked:
                    r.wait_deadline_s = None
        return [r for r in self.requests.values()
                if r.wait_deadline_s is not None and now_s > r.wait_deadline_s]

    async def drained(self, bound_s: float) -> bool:
        """Wait (at most ``bound_s``) until no request is left; False on the bound."""
        if not self.requests:
            return True
        self._drained.clear()
        try:
            await asyncio.wait_for(self._drained.wait(), bound_s)
        except TimeoutError:
            return False
        return True
