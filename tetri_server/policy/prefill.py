"""The prefill queue of one prefill (or coupled) worker: ordering and per-request progress.

Ordering follows the paper's two queues. Arrivals enter a *raw* queue in arrival order. When
the chunker first reaches into the raw queue, the raw requests are cut into rounds of
``sched_batch`` (PrefillSchedBatch); each round is sorted by the policy and appended, frozen, to
the *scheduled* queue. SJF/LJF therefore reorder only within a round, which bounds starvation:
a long prompt waits at most for the rounds formed before its own. Prefill is non-preemptive:
a request whose first chunk has run stays at the head until its whole prompt is prefilled.
(With ``prefill.overtake_share`` the chunker lets waiting prompts that fit whole in part of a
step run beside the started head; they complete in that step, so the head stays the head.)

``srpt`` is the exception, and preemptive at step granularity: every queued prompt, started or
not, is ordered by the prompt tokens it has left (ties in arrival order), so a prompt that
arrives while a long one is half done runs first, and the long one resumes after it (its KV
blocks stay allocated meanwhile). A TTFT SLO proportional to the prompt's own prefill time
(DistServe's) is met for the most requests this way. Starvation is bounded in prompt tokens,
not seconds (the simulator runs the same code): once more than ``starve_tokens`` tokens of
other prompts have been prefilled since a prompt was queued, it goes ahead of every prompt not
starved, starved ones in arrival order.

The queue owns progress: ``num_done_tokens`` counts prompt tokens whose KV is in the pool.
Callers mutate it only through ``add``, ``remove`` (abort) and ``advance`` (after a forward
pass ran). ``order()`` is a pure view.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Literal

PrefillOrder = Literal["fcfs", "sjf", "ljf", "srpt"]
PREFILL_ORDERS: tuple[PrefillOrder, ...] = ("fcfs", "sjf", "ljf", "srpt")


@dataclass(frozen=True)
class QueuedPrompt:
    """One waiting prompt as the chunker sees it."""

    req_id: int
    num_prompt_tokens: int
    arrival_s: float
    num_done_tokens: int  # prompt tokens already prefilled (their KV is in this worker's pool)

    @property
    def num_remaining_tokens(self) -> int:
        return self.num_prompt_tokens - self.num_done_tokens

    @property
    def started(self) -> bool:
        return self.num_done_tokens > 0


@dataclass(frozen=True)
class ChunkSlice:
    """Tokens ``[start, start + num_tokens)`` of one request's prompt inside a forward pass."""

    req_id: int
    start: int
    num_tokens: int
    num_prompt_tokens: int

    @property
    def end(self) -> int:
        return self.start + self.num_tokens

    @property
    def is_first(self) -> bool:
        """The request starts here: the runtime allocates blocks for its whole prompt."""
        return self.start == 0

    @property
    def is_last(self) -> bool:
        """The prompt completes here: the runtime samples the first output token."""
        return self.end == self.num_prompt_tokens


@dataclass
class _Entry:
    req_id: int
    num_prompt_tokens: int
    arrival_s: float
    seq: int  # insertion counter: breaks arrival-time ties in insertion order
    served_at_add: int  # the queue's prefilled-token count when this prompt was queued
    num_done_tokens: int = 0

    def view(self) -> QueuedPrompt:
        return QueuedPrompt(
            self.req_id, self.num_prompt_tokens, self.arrival_s, self.num_done_tokens
        )


class PrefillQueue:
    """Waiting prompts of one worker, ordered by ``policy`` within rounds of ``sched_batch``
    (``srpt``: all of them by remaining tokens, ``starve_tokens`` bounding the wait)."""

    def __init__(self, policy: PrefillOrder = "fcfs", sched_batch: int = 16, *,
                 starve_tokens: int = 8192) -> None:
        if policy not in PREFILL_ORDERS:
            raise ValueError(f"prefill policy must be one of {PREFILL_ORDERS}, got {policy!r}")
        if sched_batch < 1:
            raise ValueError(f"sched_batch must be >= 1, got {sched_batch}")
        if starve_tokens < 1:
            raise ValueError(f"starve_tokens must be >= 1, got {starve_tokens}")
        self.policy: PrefillOrder = policy
        self.sched_batch = sched_batch
        self.starve_tokens = starve_tokens
        self._num_served = 0  # prompt tokens prefilled from this queue so far (srpt's clock)
        self._entries: dict[int, _Entry] = {}
        # The rounds (not srpt, whose prompts all stay in _raw: iter_order sorts the entries):
        self._started: list[int] = []  # first chunk ran; in start order; always the head
        self._scheduled: list[int] = []  # frozen sorted rounds, not yet started
        self._raw: list[tuple[float, int, int]] = []  # (arrival_s, seq, req_id), sorted
        self._num_added = 0

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, req_id: object) -> bool:
        return req_id in self._entries

    @property
    def preemptive(self) -> bool:
        """Whether a started prompt can come after one not started in ``order()`` (srpt)."""
        return self.policy == "srpt"

    @property
    def num_queued_tokens(self) -> int:
        """Prompt tokens still to prefill, started requests included (the global load metric)."""
        return sum(e.num_prompt_tokens - e.num_done_tokens for e in self._entries.values())

    def add(self, req_id: int, num_prompt_tokens: int, arrival_s: float) -> None:
        """Queue a prompt. Raises on a duplicate id or an empty prompt."""
        if req_id in self._entries:
            raise ValueError(f"request {req_id} is already queued")
        if num_prompt_tokens < 1:
            raise ValueError(f"request {req_id}: a prompt needs at least one token")
        entry = _Entry(req_id, num_prompt_tokens, arrival_s, self._num_added, self._num_served)
        self._num_added += 1
        self._entries[req_id] = entry
        bisect.insort(self._raw, (arrival_s, entry.seq, req_id))

    def remove(self, req_id: int) -> bool:
        """Drop a request (abort). Returns whether it was queued. Its blocks are the caller's."""
        entry = self._entries.pop(req_id, None)
        if entry is None:
            return False
        if req_id in self._started:
            self._started.remove(req_id)
        elif req_id in self._scheduled:
            self._scheduled.remove(req_id)
        else:
            self._raw.remove((entry.arrival_s, entry.seq, req_id))
        return True

    def order(self) -> list[QueuedPrompt]:
        """Every queued prompt in the order the chunker must serve them. Pure."""
        return list(self.iter_order())

    def iter_order(self) -> Iterator[QueuedPrompt]:
        """``order()`` lazily: rounds are sorted only as far as the caller reads. Do not
        mutate the queue while iterating."""
        if self.policy == "srpt":
            yield from (e.view() for e in sorted(self._entries.values(), key=self._srpt_key))
            return
        for rid in (*self._started, *self._scheduled):
            yield self._entries[rid].view()
        for lo in range(0, len(self._raw), self.sched_batch):
            window = [rid for _, _, rid in self._raw[lo : lo + self.sched_batch]]
            for rid in self._sorted_round(window):
                yield self._entries[rid].view()

    def advance(self, slices: Iterable[ChunkSlice]) -> list[int]:
        """Record that ``slices`` ran. Returns the ids whose prompt is now complete, in slice
        order; they leave the queue. Slices of requests removed meanwhile are ignored."""
        finished: list[int] = []
        for piece in slices:
            entry = self._entries.get(piece.req_id)
            if entry is None:
                continue
            if piece.start != entry.num_done_tokens:
                raise ValueError(
                    f"request {piece.req_id}: slice starts at {piece.start}, "
                    f"progress is {entry.num_done_tokens}"
                )
            if entry.num_done_tokens == 0 and not self.preemptive:
                self._start(piece.req_id)
            entry.num_done_tokens += piece.num_tokens
            self._num_served += piece.num_tokens
            if entry.num_done_tokens >= entry.num_prompt_tokens:
                self.remove(piece.req_id)
                finished.append(piece.req_id)
        return finished

    def _start(self, req_id: int) -> None:
        """Freeze the rounds up to ``req_id``'s and move it to the started head."""
        raw_ids = [rid for _, _, rid in self._raw]
        if req_id in raw_ids:
            num_promoted = (raw_ids.index(req_id) // self.sched_batch + 1) * self.sched_batch
            promoted = raw_ids[:num_promoted]
            for lo in range(0, len(promoted), self.sched_batch):
                self._scheduled.extend(self._sorted_round(promoted[lo : lo + self.sched_batch]))
            del self._raw[:num_promoted]
        self._scheduled.remove(req_id)
        self._started.append(req_id)

    def _srpt_key(self, entry: _Entry) -> tuple[int, float, int, int]:
        """Starved prompts first, in arrival order; then the fewest remaining tokens."""
        others = self._num_served - entry.served_at_add - entry.num_done_tokens
        if others > self.starve_tokens:
            return (0, entry.arrival_s, entry.seq, 0)
        return (1, 0.0, entry.num_prompt_tokens - entry.num_done_tokens, entry.seq)

    def _sorted_round(self, ids: list[int]) -> list[int]:
        if self.policy == "fcfs":
            return ids
        sign = 1 if self.policy == "sjf" else -1
        # `ids` is in arrival order and sorted() is stable: equal lengths stay FCFS.
        return sorted(ids, key=lambda rid: sign * self._entries[rid].num_prompt_tokens)
