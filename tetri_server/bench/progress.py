"""A plain-text progress bar on stderr (no tqdm): redrawn in place on a terminal, a line per
10% otherwise (so logs stay readable)."""

from __future__ import annotations

import sys
import time
from typing import TextIO

BAR_WIDTH = 30
REDRAW_INTERVAL_S = 0.25


class Progress:
    def __init__(
        self, total: int, stream: TextIO | None = None, enabled: bool = True, label: str = ""
    ) -> None:
        self.total = total
        self.done = 0
        self.errors = 0
        self._stream = stream if stream is not None else sys.stderr
        self._enabled = enabled and total > 0
        self._tty = self._stream.isatty()
        self._label = label
        self._t0 = time.monotonic()
        self._last_draw = 0.0
        self._last_decile = -1

    def render(self) -> str:
        frac = self.done / self.total if self.total else 1.0
        fill = int(frac * BAR_WIDTH)
        bar = "=" * fill + (">" if fill < BAR_WIDTH else "") + " " * (BAR_WIDTH - fill - 1)
        elapsed_s = time.monotonic() - self._t0
        head = f"{self._label} " if self._label else ""
        return (
            f"{head}{self.done}/{self.total} [{bar[:BAR_WIDTH]}] {frac * 100:3.0f}% "
            f"errors {self.errors} {elapsed_s:.1f}s"
        )

    def update(self, ok: bool) -> None:
        self.done += 1
        self.errors += 0 if ok else 1
        if not self._enabled:
            return
        now = time.monotonic()
        if self._tty:
            if now - self._last_draw >= REDRAW_INTERVAL_S or self.done == self.total:
                self._stream.write("\r" + self.render())
                self._stream.flush()
                self._last_draw = now
            return
        decile = self.done * 10 // self.total
        if decile != self._last_decile:
            self._last_decile = decile
            self._stream.write(self.render() + "\n")
            self._stream.flush()

    def close(self) -> None:
        if self._enabled and self._tty:
            self._stream.write("\r" + self.render() + "\n")
            self._stream.flush()
