"""Arrival times (seconds from the start of a run): Poisson at a rate, evenly spaced at a rate
(``constant``: what ``vllm bench serve --burstiness inf`` sends), or a real trace replayed.

Trace replay keeps the trace's order and relative gaps and multiplies every gap by one factor:
the scaled span is the original span times ``time_scale`` (factor < 1 compresses, i.e. a higher
rate). ``scale_for_rate`` gives the factor that makes a window of the trace run at a target mean
rate, which is how a one-hour production trace is made to load a 2-core machine for a minute.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np


def poisson_arrivals(num_requests: int, rate_rps: float, rng: np.random.Generator) -> list[float]:
    """A Poisson process at ``rate_rps`` given its span: exponential gaps scaled so that the
    mean rate, (n - 1) / span, is ``rate_rps`` exactly (the gaps keep their Poisson shape;
    unscaled, 60 draws with the default seed came 1.33x as fast as the rate a result is
    labelled with). The first request arrives at 0. ``inf`` = all at 0."""
    if num_requests <= 0:
        return []
    if rate_rps <= 0:
        raise ValueError("rate must be > 0 (use inf for a burst)")
    if math.isinf(rate_rps):
        return [0.0] * num_requests
    if num_requests == 1:
        return [0.0]
    times = np.cumsum(rng.exponential(1.0, size=num_requests - 1))
    times *= (num_requests - 1) / rate_rps / times[-1]
    return [0.0, *(float(t) for t in times)]


def constant_arrivals(num_requests: int, rate_rps: float) -> list[float]:
    """Evenly spaced, ``1 / rate_rps`` apart; the first request arrives at 0. ``inf`` = all at 0."""
    if rate_rps <= 0:
        raise ValueError("rate must be > 0 (use inf for a burst)")
    if math.isinf(rate_rps):
        return [0.0] * num_requests
    return [i / rate_rps for i in range(num_requests)]


def trace_window(times_s: Sequence[float], num_requests: int, start_index: int = 0) -> list[float]:
    """``num_requests`` consecutive trace stamps from ``start_index``, shifted to start at 0."""
    if start_index < 0 or start_index + num_requests > len(times_s):
        raise ValueError(
            f"trace has {len(times_s)} rows; cannot take {num_requests} from row {start_index}"
        )
    window = list(times_s[start_index : start_index + num_requests])
    if any(b < a for a, b in zip(window, window[1:], strict=False)):
        raise ValueError("trace stamps are not sorted")
    t0 = window[0] if window else 0.0
    return [t - t0 for t in window]


def scale_times(times_s: Sequence[float], time_scale: float) -> list[float]:
    """Every stamp (relative to the first) times ``time_scale``; order is kept."""
    if time_scale <= 0:
        raise ValueError("time_scale must be > 0")
    t0 = times_s[0] if times_s else 0.0
    return [(t - t0) * time_scale for t in times_s]


def scale_for_rate(times_s: Sequence[float], rate_rps: float) -> float:
    """The ``time_scale`` that makes these stamps arrive at a mean of ``rate_rps``.

    Mean rate of a window = (n - 1) / span; a window with zero span cannot be stretched.
    """
    if len(times_s) < 2:
        return 1.0
    span_s = times_s[-1] - times_s[0]
    if span_s <= 0:
        raise ValueError("trace window has zero span; use time_scale instead of a rate")
    return (len(times_s) - 1) / span_s / rate_rps
