"""tools/ab_kernels.py: its "cold" calls find their data in DRAM."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))
from ab_kernels import eviction_buffer  # noqa: E402


def resident_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


@pytest.mark.skipif(not Path("/proc/self/statm").exists(), reason="needs Linux /proc")
def test_the_buffer_read_before_a_cold_call_is_real_memory():
    """An untouched buffer's pages all map the one zero page: reading it evicts nothing, and
    the "cold" call ran from L3 (session 55). Its whole size must be resident."""
    nbytes = 64 << 20
    before = resident_bytes()
    buf = eviction_buffer(nbytes)
    buf.sum()
    assert resident_bytes() - before >= 0.9 * nbytes
