"""The event loop: a heap of ``(time_s, seq, event)``; pop the earliest, handle it, push what
it makes (Vidur's shape). ``seq`` breaks time ties in push order, so a run is deterministic.

An event is a zero-argument callable; handlers push follow-ups with ``at`` / ``after``. The
clock only moves forward: pushing an event in the past raises.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable

Event = Callable[[], None]


class EventLoop:
    """A virtual clock and the pending events. Not thread-safe; one per simulation."""

    def __init__(self) -> None:
        self.now_s = 0.0
        self._heap: list[tuple[float, int, Event]] = []
        self._num_pushed = 0
        self.num_handled = 0

    def at(self, time_s: float, event: Event) -> None:
        """Run ``event`` at ``time_s`` (>= now)."""
        if time_s < self.now_s:
            raise ValueError(f"event at {time_s} s is before now ({self.now_s} s)")
        heapq.heappush(self._heap, (time_s, self._num_pushed, event))
        self._num_pushed += 1

    def after(self, delay_s: float, event: Event) -> None:
        self.at(self.now_s + delay_s, event)

    def __len__(self) -> int:
        return len(self._heap)

    def run(self, until_s: float = float("inf")) -> float:
        """Handle events in time order until none is left or the next is after ``until_s``.
        Returns the clock."""
        heap = self._heap
        while heap and heap[0][0] <= until_s:
            time_s, _, event = heapq.heappop(heap)
            self.now_s = time_s
            event()
            self.num_handled += 1
        return self.now_s
