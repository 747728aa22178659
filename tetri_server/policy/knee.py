"""Chunk-size calibration: find the knee of the prefill throughput curve.

Prefill throughput (tokens/s) rises with tokens per forward pass until the device saturates,
then stays flat. TetriInfer's ``chunk_size`` is the smallest size that already runs at the
plateau: larger chunks only add latency, smaller ones waste the device.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable

# Tokens of context behind each decode row that rides in a calibration pass (``riders``)
RIDER_CONTEXT = 256
# The pass sizes a prefill worker calibrates its chunk over (the simulator too).
CALIBRATION_SIZES = (32, 64, 128, 256, 512, 1024, 2048, 4096)


def throughput_curve(samples: Iterable[tuple[int, float]],
                     riders: int = 0) -> list[tuple[int, float]]:
    """``(num_tokens, tokens_per_s)`` sorted by size; repeated sizes use their median time.
    With ``riders``, each pass of ``num_tokens`` held that many one-token decode rows besides
    its ``num_tokens - riders`` prompt tokens, and the rate counts the prompt tokens only."""
    times_s: dict[int, list[float]] = {}
    for num_tokens, seconds in samples:
        if num_tokens <= riders or num_tokens < 1:
            raise ValueError(f"num_tokens must be >= 1 and above the {riders} decode rows, "
                             f"got {num_tokens}")
        if not seconds > 0:
            raise ValueError(f"seconds must be > 0, got {seconds} for {num_tokens} tokens")
        times_s.setdefault(num_tokens, []).append(seconds)
    if not times_s:
        raise ValueError("no samples")
    return [(n, (n - riders) / statistics.median(ts)) for n, ts in sorted(times_s.items())]


def _smooth(values: list[float]) -> list[float]:
    """3-point moving median: a single outlier inside the curve never survives it, and a
    monotone curve comes out unchanged. Edges have one neighbour: the first point is capped by
    its neighbour (a lucky first measurement must not win), the last is kept as measured (a
    curve still rising at the largest size must not lose its top)."""
    if len(values) < 3:
        return [min(values[:2]), *values[1:]]
    inner = [statistics.median(values[i - 1 : i + 2]) for i in range(1, len(values) - 1)]
    return [min(values[0], values[1]), *inner, values[-1]]


def pick_chunk_size(samples: Iterable[tuple[int, float]], tolerance: float = 0.05,
                    multiple: int = 16, riders: int = 0) -> int:
    """The smallest size whose smoothed throughput is within ``tolerance`` of the plateau,
    read off the curve between the measured sizes and rounded up to a ``multiple`` of tokens.

    ``samples``: measured ``(num_tokens, seconds per forward pass)`` pairs, e.g. over 32 ... 4096
    (repeats allowed: each size uses its median time). The curve is smoothed with a 3-point
    moving median and the plateau is its maximum, so one lucky or unlucky measurement inside the
    range moves neither the plateau nor the pick. The largest size has no right neighbour:
    measure it (like every size) a few times.

    Where the curve crosses ``(1 - tolerance) x plateau`` between two measured sizes, the
    crossing is interpolated linearly in tokens. A pick limited to the measured sizes (powers
    of two) jumps by 2x when noise moves one point across the line: on a CPU whose curve
    approaches its plateau slowly it went 64 <-> 128 <-> 256 between runs of one build. The
    interpolated crossing moves with the noise instead, a few percent for a few percent.
    A curve that never flattens returns (about) its largest size.

    ``riders``: the decode rows that ride in every chunk (a prefill worker's own decode batch,
    ``prefill.local_decode_batch``): the samples are passes of ``num_tokens`` tokens in all,
    ``riders`` of them one-token decode rows, and the curve is the prompt tokens' rate. The
    rows cost a step about the same whatever the chunk, so a small chunk spends a larger share
    of its step on them: the knee of the prompt rate lies above the knee of bare prompt passes.
    """
    if not 0 <= tolerance < 1:
        raise ValueError(f"tolerance must be in [0, 1), got {tolerance}")
    if multiple < 1:
        raise ValueError(f"multiple must be >= 1, got {multiple}")
    curve = throughput_curve(samples, riders)
    smooth = _smooth([tps for _, tps in curve])
    line = (1.0 - tolerance) * max(smooth)
    below: tuple[int, float] | None = None
    for (num_tokens, _), tps in zip(curve, smooth, strict=True):
        if tps >= line:
            if below is None:
                return num_tokens
            n0, tps0 = below
            cross = n0 + (line - tps0) / (tps - tps0) * (num_tokens - n0)
            return min(num_tokens, max(n0 + 1, math.ceil(cross / multiple) * multiple))
        below = (num_tokens, tps)
    raise AssertionError("unreachable: the plateau itself is within tolerance")
