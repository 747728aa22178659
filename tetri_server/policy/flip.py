"""Instance flip: when one role sits idle while the other is overloaded, move a worker across.

Contract: the control process calls ``plan(reports, now_s)`` on every monitor tick with the
latest ``LoadReport`` of each live worker (role ``prefill`` or ``decode``; other roles, e.g. a
worker already draining, are ignored). A ``FlipPlan`` means: stop routing to that worker, drain
it, send ``SetRole``; then call ``on_done(plan, now_s)`` (also when the flip is abandoned). At
most one flip is in flight, and none starts within ``cooldown_s`` of the last one's end.

Rule: a worker whose utilisation (model-step seconds / wall seconds) stayed under ``low_util``
for the whole ``window_s``, or that had no work in every report of the last ``idle_window_s``,
flips to the other role if that role is overloaded: its mean utilisation over the window is at least
``high_util``, or its workers had on average at least one waiting request. A role never drops to
zero workers. Among candidates the least utilised (then lowest id) flips.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

from tetri_server.messages import FLIP_ROLES, Role
from tetri_server.policy.views import WorkerLoad

ROLES = FLIP_ROLES


@dataclass(frozen=True)
class FlipPlan:
    """Drain ``worker_id`` and switch it from ``from_role`` to ``to_role``."""

    worker_id: int
    from_role: str
    to_role: str
    utilisation: float  # of the worker over the window, in [0, 1]


@dataclass(frozen=True)
class _Sample:
    t_s: float
    busy_s: float
    num_waiting: int
    idle: bool


@dataclass(frozen=True)
class _WindowStats:
    role: Role
    utilisation: float
    mean_waiting: float
    idle: bool  # no work in any report of the window
    complete: bool  # the history covers the whole window


HIGH_UTIL = 0.70  # a role this busy asks for a worker (``flip.low_load`` must stay below it)


class FlipPolicy:
    """The flip rule; keeps a per-worker history of reports over the window."""

    def __init__(
        self,
        *,
        window_s: float = 60.0,
        idle_window_s: float | None = None,
        low_util: float = 0.10,
        high_util: float = HIGH_UTIL,
        cooldown_s: float = 60.0,
    ) -> None:
        if window_s <= 0 or cooldown_s < 0 or not 0 <= low_util < high_util <= 1:
            raise ValueError("need window_s > 0, cooldown_s >= 0, 0 <= low_util < high_util <= 1")
        self.window_s = window_s
        self.idle_window_s = window_s if idle_window_s is None else idle_window_s
        self.keep_s = max(self.window_s, self.idle_window_s)
        self.low_util = low_util
        self.high_util = high_util
        self.cooldown_s = cooldown_s
        self._history: dict[int, tuple[Role, deque[_Sample]]] = {}
        self._in_flight: FlipPlan | None = None
        self._last_flip_end_s: float | None = None

    def refusal(self, role: str, num_of_role: int, now_s: float) -> str | None:
        """Why a worker of ``role`` (one of ``num_of_role`` serving in it) may not start a flip
        now, or None. The one rule for automatic and manual (``POST /admin/flip``) flips: one
        flip at a time, none within ``cooldown_s`` of the last one's end, and one worker of
        each role always remains."""
        if self._in_flight is not None:
            return f"another flip is in progress (worker {self._in_flight.worker_id})"
        if self._last_flip_end_s is not None and now_s - self._last_flip_end_s < self.cooldown_s:
            wait = self.cooldown_s - (now_s - self._last_flip_end_s)
            return f"the last flip ended less than {self.cooldown_s:g} s ago; retry in {wait:.0f} s"
        if num_of_role <= 1:
            return f"it is the last {role} worker"
        return None

    def begin(self, plan: FlipPlan) -> None:
        """A flip decided outside ``plan`` (by hand) starts: no other until ``on_done``."""
        self._in_flight = plan
        self._history.pop(plan.worker_id, None)

    def plan(self, reports: Sequence[WorkerLoad], now_s: float) -> FlipPlan | None:
        """Record ``reports`` (taken at ``now_s``) and decide whether a worker flips now."""
        self._observe(reports, now_s)
        if self.refusal("", 2, now_s) is not None:
            return None
        stats = {wid: self._stats(wid, now_s) for wid in self._history}
        by_role = {role: [w for w, s in stats.items() if s.role == role] for role in ROLES}
        overloaded = {role: self._overloaded([stats[w] for w in by_role[role]]) for role in ROLES}
        candidates = [
            (s.utilisation, wid)
            for wid, s in stats.items()
            # a worker with a queue is not idle, whatever its steps: one blocked (its pool
            # full of KV waiting for decode room) ran none, and would drain its whole queue
            # into the overloaded side first
            if (s.idle or (s.complete and s.utilisation < self.low_util and s.mean_waiting < 1.0))
            and self.refusal(s.role, len(by_role[s.role]), now_s) is None
            and overloaded[_other(s.role)]
        ]
        if not candidates:
            return None
        utilisation, wid = min(candidates)
        role = stats[wid].role
        self._in_flight = FlipPlan(wid, role, _other(role), utilisation)
        del self._history[wid]  # its window restarts in the new role
        return self._in_flight

    def on_done(self, plan: FlipPlan, now_s: float) -> None:
        """The flip finished (or was abandoned): the cooldown starts now."""
        if self._in_flight == plan:
            self._in_flight = None
        self._last_flip_end_s = now_s

    def _observe(self, reports: Sequence[WorkerLoad], now_s: float) -> None:
        flipping = None if self._in_flight is None else self._in_flight.worker_id
        live = set()
        for r in reports:
            if r.role not in ROLES or r.worker_id == flipping:
                continue
            live.add(r.worker_id)
            role, samples = self._history.get(r.worker_id, (r.role, deque()))
            if role != r.role or (samples and not _continues(samples[-1], r.busy_s)):
                samples = deque()  # flipped (or restarted): a new window
            idle = r.num_waiting == 0 and r.num_running == 0
            samples.append(_Sample(now_s, r.busy_s, r.num_waiting, idle))
            # keep one sample at or before the window start as the anchor
            while len(samples) >= 2 and samples[1].t_s <= now_s - self.keep_s:
                samples.popleft()
            self._history[r.worker_id] = (r.role, samples)
        for wid in set(self._history) - live:
            del self._history[wid]

    def _stats(self, worker_id: int, now_s: float) -> _WindowStats:
        role, history = self._history[worker_id]
        samples = _last(history, now_s - self.window_s)
        first, last = samples[0], samples[-1]
        span_s = last.t_s - first.t_s
        utilisation = (last.busy_s - first.busy_s) / span_s if span_s > 0 else 0.0
        recent = _last(history, now_s - self.idle_window_s)
        return _WindowStats(
            role=role,
            utilisation=min(1.0, max(0.0, utilisation)),
            mean_waiting=sum(s.num_waiting for s in samples) / len(samples),
            idle=recent[-1].t_s - recent[0].t_s >= self.idle_window_s
            and all(s.idle for s in recent),
            complete=span_s >= self.window_s,
        )

    def _overloaded(self, workers: list[_WindowStats]) -> bool:
        if not workers:
            return False
        mean_util = sum(w.utilisation for w in workers) / len(workers)
        mean_waiting = sum(w.mean_waiting for w in workers) / len(workers)
        return mean_util >= self.high_util or mean_waiting >= 1.0


def _last(samples: deque[_Sample], start_s: float) -> list[_Sample]:
    """The samples from the last one at or before ``start_s`` (the anchor) onwards."""
    items = list(samples)
    i = 0
    while i + 1 < len(items) and items[i + 1].t_s <= start_s:
        i += 1
    return items[i:]


def _other(role: Role) -> Role:
    return "decode" if role == "prefill" else "prefill"



def _continues(last: _Sample, busy_s: float) -> bool:
    """``busy_s`` (a worker process's running total) can follow ``last``: it did not go back
    (a restarted process counts from 0). (It may grow by more than the time since: a worker
    reports only between steps, a long step's time all at once.)"""
    return busy_s >= last.busy_s
