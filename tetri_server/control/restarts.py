"""When to restart a dead worker, and when to give up: exponential back-off per worker id and
a limit on deaths in a row, after which the server exits non-zero (systemd or the operator acts
instead of a restart loop that never serves). Pure: times are passed in."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class RestartPolicy:
    backoff_s: float
    backoff_max_s: float
    max_restarts: int  # deaths in a row of one worker id that are still restarted
    reset_s: float  # up this long after becoming ready: the next death counts as the first
    _deaths: dict[int, int] = field(default_factory=dict)  # worker id -> deaths in a row
    _ready_s: dict[int, float] = field(default_factory=dict)  # worker id -> when it was ready

    def on_ready(self, worker_id: int, now_s: float) -> None:
        self._ready_s[worker_id] = now_s

    def on_death(self, worker_id: int, now_s: float) -> float | None:
        """Seconds to wait before restarting ``worker_id``; None: too many deaths in a row."""
        ready_s = self._ready_s.pop(worker_id, None)
        if ready_s is not None and now_s - ready_s >= self.reset_s:
            self._deaths[worker_id] = 0
        n = self._deaths.get(worker_id, 0) + 1
        self._deaths[worker_id] = n
        if n > self.max_restarts:
            return None
        return min(self.backoff_max_s, self.backoff_s * 2 ** (n - 1))

    def deaths_in_a_row(self, worker_id: int) -> int:
        return self._deaths.get(worker_id, 0)
