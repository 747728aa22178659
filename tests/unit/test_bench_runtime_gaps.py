"""tools/bench_runtime.py's stall measure: the inter-token gaps of a load window."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))

from bench_runtime import window_gaps  # noqa: E402


def test_a_stream_that_finished_in_the_window_has_no_stall_after_its_last_token() -> None:
    """Regression: a decode stream that ended inside the window got a gap from its last token
    to the end of the tail wait, counted as a stall seconds long (the p99 gap showed it)."""
    times = [1.0, 1.1, 1.2]
    assert window_gaps(times, 1.05, 5.0, end=9.0, finished=True) == pytest.approx([0.1, 0.1])
    # one still streaming, silent since 1.2, is a stall still open at the end: a lower bound
    assert window_gaps(times, 1.05, 5.0, end=9.0)[-1] == 9.0 - 1.2
