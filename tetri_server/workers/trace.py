"""Decision logs: what a role decided at each step (prompt slices, dispatches, admissions,
preemptions), one JSON object per line. Off by default (``monitor.decision_log``). A log a
worker opens stamps each record with ``t``, ``time.monotonic()`` (one clock for every process on
the machine, so the workers' logs line up: a step's record comes just before it runs). A golden
test replays a fixed trace through the coupled loop with a fake runner and compares the log
with a committed file, so a scheduling change is a visible diff; the simulator issue builds on
the same records."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from typing import IO, Any


class DecisionLog:
    def __init__(self, write: Callable[[str], Any] | None = None,
                 clock: Callable[[], float] | None = None) -> None:
        self._write = write
        self._clock = clock  # None: records carry no time (the golden traces)
        self._file: IO[str] | None = None
        self.step = 0  # the caller's step counter, stamped on every record

    @classmethod
    def open(cls, prefix: str, worker_id: int) -> DecisionLog:
        """``<prefix>.w<worker_id>.jsonl`` (appended to), or a log that records nothing. Line
        buffered: a worker stopped by a signal (a server stopped with SIGTERM to its process
        group) leaves every record it made, not all but its last buffer's worth."""
        if not prefix:
            return cls()
        f = open(f"{prefix}.w{worker_id}.jsonl", "a", buffering=1,  # noqa: SIM115
                 encoding="utf-8")
        log = cls(f.write, time.monotonic)
        log._file = f
        return log

    @property
    def enabled(self) -> bool:
        return self._write is not None

    def record(self, kind: str, **fields: Any) -> None:
        if self._write is not None:
            stamp = {} if self._clock is None else {"t": round(self._clock(), 4)}
            self._write(json.dumps({"step": self.step, "kind": kind, **stamp, **fields},
                                   separators=(",", ":")) + "\n")

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
