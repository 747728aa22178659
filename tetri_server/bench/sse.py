"""Incremental Server-Sent Events parser (the subset OpenAI-compatible servers use).

Bytes arrive in arbitrary pieces; ``feed`` returns the events completed by this piece. An event
ends at a blank line; its ``data:`` lines are joined with newlines; ``event:`` sets its type;
lines starting with ``:`` are comments. CRLF and LF line ends are both accepted.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class SSEEvent:
    data: str
    event: str = "message"


class SSEParser:
    def __init__(self) -> None:
        self._buf = b""
        self._data: list[str] = []
        self._event = "message"

    def feed(self, chunk: bytes) -> list[SSEEvent]:
        self._buf += chunk
        out: list[SSEEvent] = []
        while True:
            nl = self._buf.find(b"\n")
            if nl < 0:
                return out
            raw, self._buf = self._buf[:nl], self._buf[nl + 1 :]
            line = raw.rstrip(b"\r").decode("utf-8", errors="replace")
            if not line:
                if self._data:
                    out.append(SSEEvent("\n".join(self._data), self._event))
                self._data, self._event = [], "message"
                continue
            if line.startswith(":"):
                continue
            field, _, value = line.partition(":")
            value = value[1:] if value.startswith(" ") else value
            if field == "data":
                self._data.append(value)
            elif field == "event":
                self._event = value

    def close(self) -> list[SSEEvent]:
        """Flush an event the stream ended without a blank line after."""
        out = self.feed(b"\n\n") if self._buf or self._data else []
        return out
