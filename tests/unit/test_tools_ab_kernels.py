"""tools/ab_kernels.py: its "cold" calls find their data in DRAM."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))
import ab_kernels  # noqa: E402
from ab_kernels import eviction_buffer, hot_cold_ms  # noqa: E402


def resident_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@pytest.mark.skipif(not Path("/proc/self/statm").exists(), reason="needs Linux /proc")
def test_the_buffer_read_before_a_cold_call_is_real_memory():
    """An untouched buffer's pages all map the one zero page: reading it evicts nothing, and
    the "cold" call ran from L3 (session 55). Its whole size must be resident."""
    nbytes = 64 << 20
    before = resident_bytes()
    buf = eviction_buffer(nbytes)
    buf.sum()
    assert resident_bytes() - before >= 0.9 * nbytes


def test_every_cold_call_comes_after_reading_the_eviction_buffer(monkeypatch):
    import torch

    events: list[str] = []

    class Buffer:
        def sum(self) -> torch.Tensor:
            events.append("evict")
            return torch.zeros(())

    monkeypatch.setattr(ab_kernels, "eviction_buffer", lambda nbytes=0: Buffer())

    def call(key: str):
        return lambda r: events.append(f"{key} {'hot' if r is None else 'cold'}")

    hot_cold_ms({"A": call("A"), "B": call("B")}, 2)
    colds = [i for i, e in enumerate(events) if e.endswith("cold")]
    assert len(colds) == 4 and all(events[i - 1] == "evict" for i in colds)
