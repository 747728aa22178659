"""Every request a prefill worker owns, in one table with its stage, and the dispatch loop.

Stages, in order::

    NEW         arrived; waits for its output-length prediction
    QUEUED      in the ``PrefillQueue``: waiting for, or in the middle of, its chunks
    HELD        prompt done, first token sampled; waits for room on a decode worker
    HANDED_OFF  a hand-off named a decode worker; its KV stays here until that worker pulls it
    DECODING    kept (elastic P/D, ``policy.LocalDecode``): decoded on this worker, to the end
                or until handed back (HELD again, with the tokens decoded here)

The real prefill role and the simulator's prefill instance both keep their requests here, so
they make the same dispatch decisions by construction. ``PrefillBook`` is generic over what the
worker keeps per request (a ``Sequence`` on a worker, a ``SimSeq`` in the simulator); it never
touches KV blocks: the caller frees, pins and unpins them on the transitions it is told about.
"""

from __future__ import annotations

import enum
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Generic, TypeVar

from tetri_server.policy.dispatch import Dispatcher, DispatchPlan
from tetri_server.policy.prefill import PrefillQueue
from tetri_server.policy.views import DecodeSnapshot

T = TypeVar("T")
# A held request refused for this many decode views is passed by no request held after it:
# smaller ones would otherwise take every block a decode worker frees, and a large one wait
# until its request timeout (about 5 s at the default monitor.interval_ms of 100)
MAX_PASSED_VIEWS = 50


class Stage(enum.Enum):
    NEW = "new"
    QUEUED = "queued"
    HELD = "held"
    HANDED_OFF = "handed_off"
    DECODING = "decoding"


@dataclass(eq=False)
class Entry(Generic[T]):
    req_id: int
    req: T
    num_prompt: int
    arrival_s: float
    prompt_text: str = ""  # the predictor's inputs (the simulator's buckets are drawn up front)
    true_output_len: int | None = None
    max_tokens: int | None = None  # the output cap (the dispatcher's prediction is at most it)
    stage: Stage = Stage.NEW
    bucket: int = 0
    plan: DispatchPlan | None = None  # set while HANDED_OFF
    num_decoded: int = 0  # tokens decoded here after the first (kept, then handed back)
    held_view: int = 0  # the book's view count when it became held (``MAX_PASSED_VIEWS``)


class PrefillBook(Generic[T]):
    """The per-request state of one prefill worker. A request is in exactly one stage; the
    ``HELD`` ones are dispatched in the order they became held (a refused hand-off goes to the
    back); one the dispatcher keeps refusing is passed for ``MAX_PASSED_VIEWS`` views, then
    nothing behind it goes before it does."""

    def __init__(self, queue: PrefillQueue, dispatcher: Dispatcher) -> None:
        self.queue = queue
        self.dispatcher = dispatcher
        self._entries: dict[int, Entry[T]] = {}
        self._counts = dict.fromkeys(Stage, 0)  # requests per stage, kept with every move
        self._await_view = False  # a hand-off was refused: dispatch again on the next view
        self.view: DecodeSnapshot | None = None  # the newest decode view adopted
        self._num_views = 0  # views adopted (the clock of ``MAX_PASSED_VIEWS``)

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def num_views(self) -> int:
        """Decode views adopted so far."""
        return self._num_views

    def __contains__(self, req_id: int) -> bool:
        return req_id in self._entries

    def get(self, req_id: int) -> T:
        return self._entries[req_id].req

    def count(self, *stages: Stage) -> int:
        return sum(self._counts[s] for s in stages)

    def ids(self, stage: Stage) -> list[int]:
        """The requests in ``stage``, in order (for HELD: the dispatch order)."""
        return [rid for rid, e in self._entries.items() if e.stage is stage]

    def kv_returning(self) -> bool:
        """Whether KV here waits to go without a prompt completing: a request held for
        dispatch, or handed off and not yet pulled (its blocks come back when it is)."""
        return bool(self._counts[Stage.HELD] or self._counts[Stage.HANDED_OFF])

    def has_work(self) -> bool:
        """A prediction, a chunk or a local decode is due (held and handed-off requests need
        no step)."""
        return bool(len(self.queue) or self._counts[Stage.NEW] or self._counts[Stage.DECODING])

    # ------------------------------------------------------------------ transitions

    def add(self, req_id: int, req: T, num_prompt: int, arrival_s: float, *,
            prompt_text: str = "", true_output_len: int | None = None,
            max_tokens: int | None = None) -> None:
        if req_id in self._entries:
            raise ValueError(f"request {req_id} is already on this prefill worker")
        self._entries[req_id] = Entry(req_id, req, num_prompt, arrival_s, prompt_text,
                                      true_output_len, max_tokens)
        self._counts[Stage.NEW] += 1

    def num_waiting_prompt_tokens(self) -> int:
        """Prompt tokens not prefilled yet: the queue's and those of requests still waiting for
        their prediction (a load report counts them from the moment the request arrived)."""
        return self.queue.num_queued_tokens + sum(e.num_prompt for e in self.new())

    def new(self) -> list[Entry[T]]:
        """The requests waiting for a prediction, in arrival order."""
        return [e for e in self._entries.values() if e.stage is Stage.NEW]

    def predicted(self, req_id: int, bucket: int) -> None:
        """NEW -> QUEUED with its predicted bucket."""
        e = self._entry(req_id, Stage.NEW)
        self._move(e, Stage.QUEUED)
        e.bucket = bucket
        self.queue.add(req_id, e.num_prompt, e.arrival_s)

    def prefilled(self, req_id: int) -> T:
        """QUEUED -> HELD: the prompt is done and the request continues on a decode worker."""
        e = self._entry(req_id, Stage.QUEUED)
        self._hold(e)
        self.queue.remove(req_id)  # normally gone already: the chunker's on_done advanced it
        return e.req

    def dispatch(self) -> list[tuple[T, DispatchPlan]]:
        """HELD -> HANDED_OFF for every held request the dispatcher finds room for, in order;
        the caller sends the hand-offs. Nothing while a refusal waits for a fresh view."""
        if self._await_view:
            return []
        sent = []
        for req_id, e in list(self._held()):
            # one handed back holds the KV of the tokens it decoded here too: its output is at
            # least those (the prediction is of the whole output, as the decode worker counts)
            plan = self.dispatcher.plan(req_id, e.num_prompt, e.bucket, e.max_tokens,
                                        min_output=e.num_decoded + 1)
            if plan is not None:
                self._move(e, Stage.HANDED_OFF)
                e.plan = plan
                sent.append((e.req, plan))
            elif self._num_views - e.held_view >= MAX_PASSED_VIEWS:
                break  # it has been passed long enough: the rest wait behind it
        return sent

    def keep(self, req_id: int) -> T:
        """HELD -> DECODING: this worker decodes the request itself."""
        e = self._entry(req_id, Stage.HELD)
        self._move(e, Stage.DECODING)
        return e.req

    def hand_back(self, req_id: int, num_tokens: int) -> T:
        """DECODING -> HELD (at the back): a kept request goes to a decode worker after all; its
        hand-off carries the KV of its prompt and of the tokens decoded here (``num_tokens``:
        its prompt and output now), and its dispatch counts them."""
        e = self._entry(req_id, Stage.DECODING)
        e.num_decoded = max(0, num_tokens - e.num_prompt - 1)
        self._hold(e)
        return e.req

    def on_view(self, view: DecodeSnapshot) -> bool:
        """A decode view arrived; returns whether it is new (the caller then dispatches)."""
        self._await_view = False
        adopted = self.dispatcher.on_view(view)
        if adopted:
            self.view = view
            self._num_views += 1
        return adopted

    def pulled(self, req_id: int) -> T | None:
        """HANDED_OFF -> gone: the decode worker has the KV. None if not handed off here."""
        e = self._entries.get(req_id)
        if e is None or e.stage is not Stage.HANDED_OFF:
            return None
        del self._entries[req_id]
        self._counts[e.stage] -= 1
        return e.req

    def rejected(self, req_id: int) -> T | None:
        """HANDED_OFF -> HELD (at the back): the decode worker refused the hand-off. The plan
        is undone in the dispatcher, and nothing is dispatched until the next view."""
        e = self._entries.get(req_id)
        if e is None or e.stage is not Stage.HANDED_OFF:
            return None
        assert e.plan is not None
        self.dispatcher.on_rejected(e.plan)
        self._hold(e)
        e.plan = None
        self._await_view = True
        return e.req

    def remove(self, req_id: int) -> T | None:
        """Any stage -> gone (finished at its first token, failed or aborted)."""
        e = self._entries.pop(req_id, None)
        if e is None:
            return None
        self._counts[e.stage] -= 1
        if e.stage is Stage.QUEUED:
            self.queue.remove(req_id)
        if e.stage is Stage.HANDED_OFF and e.plan is not None:
            self.dispatcher.on_rejected(e.plan)  # control drops its hand-off if still unread
        return e.req

    # ------------------------------------------------------------------ helpers

    def _held(self) -> Iterator[tuple[int, Entry[T]]]:
        return ((rid, e) for rid, e in self._entries.items() if e.stage is Stage.HELD)

    def _hold(self, e: Entry[T]) -> None:
        """-> HELD, at the back of the held order (``dispatch`` goes in insertion order)."""
        self._move(e, Stage.HELD)
        self._entries[e.req_id] = self._entries.pop(e.req_id)
        e.held_view = self._num_views

    def _move(self, e: Entry[T], stage: Stage) -> None:
        self._counts[e.stage] -= 1
        self._counts[stage] += 1
        e.stage = stage

    def _entry(self, req_id: int, stage: Stage) -> Entry[T]:
        e = self._entries[req_id]
        if e.stage is not stage:
            raise ValueError(f"request {req_id} is {e.stage.value}, not {stage.value}")
        return e
