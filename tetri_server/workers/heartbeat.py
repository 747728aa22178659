"""A worker's heartbeat. While the worker's loop works (a step, a message), a thread stamps the
outbox's beat word (``Channel.beat``) every ``period_s``, so the control process's stall check
(``Monitor.check_stalls``) tells a long step (a long prompt on a CPU) from a stopped or frozen
process: a stopped process stamps nothing (its threads stop too), and a loop turn that runs
past ``max_s`` stops the stamps, so a stuck kernel or an endless loop is still a stall."""

from __future__ import annotations

import threading
import time
from typing import Any

from tetri_server.channel import Channel


class Heartbeat:
    def __init__(self, channel: Channel[Any], period_s: float, max_s: float) -> None:
        self._channel = channel
        self.period_s = period_s
        self.max_s = max_s
        self._busy_since: float | None = None  # monotonic start of the loop turn at work
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="heartbeat", daemon=True)
        self._thread.start()

    def busy(self) -> None:
        """A loop turn starts working: stamps go on for at most ``max_s`` from now."""
        self._busy_since = time.monotonic()

    def idle(self) -> None:
        """The loop waits for a message (it reports on its own while idle): no stamps."""
        self._busy_since = None

    def _run(self) -> None:
        while not self._stop.wait(self.period_s):
            since = self._busy_since
            if since is not None and time.monotonic() - since < self.max_s:
                self._channel.beat()

    def close(self) -> None:
        """Stop the thread (before the channel is closed)."""
        self._stop.set()
        self._thread.join(timeout=5)
