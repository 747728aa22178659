"""Chunk-size calibration: find the knee of the prefill throughput curve.

Prefill throughput (tokens/s) rises with tokens per forward pass until the device saturates,
then stays flat. TetriInfer's ``chunk_size`` is the smallest size that already runs at the
plateau: larger chunks only add latency, smaller ones waste the device.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable


def throughput_curve(samples: Iterable[tuple[int, float]]) -> list[tuple[int, float]]:
    """``(num_tokens, tokens_per_s)`` sorted by size; repeated sizes use their median time."""
    times_s: dict[int, list[float]] = {}
    for num_tokens, seconds in samples:
        if num_tokens < 1:
            raise ValueError(f"num_tokens must be >= 1, got {num_tokens}")
        if not seconds > 0:
            raise ValueError(f"seconds must be > 0, got {seconds} for {num_tokens} tokens")
        times_s.setdefault(num_tokens, []).append(seconds)
    if not times_s:
        raise ValueError("no samples")
    return [(n, n / statistics.median(ts)) for n, ts in sorted(times_s.items())]


def _smooth(values: list[float]) -> list[float]:
    """3-point moving median: a single outlier inside the curve never survives it, and a
    monotone curve comes out unchanged. Edges have one neighbour: the first point is capped by
    its neighbour (a lucky first measurement must not win), the last is kept as measured (a
    curve still rising at the largest size must not lose its top)."""
    if len(values) < 3:
        return [min(values[:2]), *values[1:]]
    inner = [statistics.median(values[i - 1 : i + 2]) for i in range(1, len(values) - 1)]
    return [min(values[0], values[1]), *inner, values[-1]]


def pick_chunk_size(samples: Iterable[tuple[int, float]], tolerance: float = 0.05) -> int:
    """The smallest measured size whose smoothed throughput is within ``tolerance`` of the
    plateau.

    ``samples``: measured ``(num_tokens, seconds per forward pass)`` pairs, e.g. over 32 ... 4096
    (repeats allowed: each size uses its median time). The curve is smoothed with a 3-point
    moving median and the plateau is its maximum, so one lucky or unlucky measurement inside the
    range moves neither the plateau nor the pick. The largest size has no right neighbour:
    measure it (like every size) a few times. A curve that never flattens returns its largest
    size (or the first within tolerance of it).
    """
    if not 0 <= tolerance < 1:
        raise ValueError(f"tolerance must be in [0, 1), got {tolerance}")
    curve = throughput_curve(samples)
    smooth = _smooth([tps for _, tps in curve])
    plateau = max(smooth)
    for (num_tokens, _), tps in zip(curve, smooth, strict=True):
        if tps >= (1.0 - tolerance) * plateau:
            return num_tokens
    raise AssertionError("unreachable: the plateau itself is within tolerance")
