"""SLO attainment and goodput from request records (pure: no I/O, no clock).

Definition (DistServe): the **SLO goodput** of a server on a workload is the highest request rate
at which at least ``target`` (90%) of the requests meet *both* latency objectives:

  TTFT(request) <= ttft_x * unloaded_prefill_s(prompt_len)      (default ttft_x = 5)
  TPOT(request) <= tpot_x * unloaded_step_s                     (default tpot_x = 3)

The unloaded latencies come from a ``Calibration`` measured against the server itself (a few
sequential requests, see ``sweep.calibrate``): unloaded prefill = max(a + b x prompt tokens,
floor), the line fitted by least squares on the lone requests' TTFTs and the floor the median
lone TTFT of the shortest prompt probed (a few tokens: one HTTP round trip and one step, which
no prompt beats; without it a line whose intercept fits to 0 gives a 7-token prompt an SLO
shorter than that); the unloaded step is the median TPOT of a lone stream. TTFT and TPOT are
measured as in ``metrics`` (TTFT from send; a one-token request has no TPOT and meets that
objective). A request that failed or did not finish misses both, and attainment divides by *all*
requests sent at that rate.

Goodput from a sweep: rates are sorted ascending; the goodput is the highest tested rate such
that it **and every lower tested rate** reached the target (no interpolation). A pass above a
failing rate is noise on a shared machine and is not counted. 0.0 means even the lowest rate
failed: the goodput is below the lowest rate tested.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from tetri_server.bench.client import RequestRecord
from tetri_server.bench.metrics import tpot_s, ttft_s

ATTAINMENT_TARGET = 0.9


@dataclass(frozen=True)
class SLOScale:
    """Multipliers on the unloaded latencies, and the fraction of requests that must meet both."""

    ttft_x: float = 5.0
    tpot_x: float = 3.0
    target: float = ATTAINMENT_TARGET

    def __post_init__(self) -> None:
        if self.ttft_x <= 0 or self.tpot_x <= 0:
            raise ValueError("SLO multipliers must be > 0")
        if not 0.0 < self.target <= 1.0:
            raise ValueError("attainment target must be in (0, 1]")


@dataclass(frozen=True)
class Calibration:
    """Unloaded latencies of one server: prefill_s(p) = prefill_base_s + prefill_per_token_s x p,
    floored at ``prefill_floor_s``, and one decode step ``step_s``. The samples it was fitted on
    are kept for the record."""

    prefill_base_s: float
    prefill_per_token_s: float
    step_s: float
    prefill_samples: tuple[tuple[int, float], ...] = ()  # (prompt_len, lone TTFT in s)
    step_samples: tuple[float, ...] = ()  # lone-stream TPOTs in s
    source: str = ""  # the server (label or URL) it was measured on
    prefill_floor_s: float = 0.0  # lone TTFT of the shortest probe (0: none was measured)

    def prefill_s(self, prompt_len: int) -> float:
        line = self.prefill_base_s + self.prefill_per_token_s * prompt_len
        return max(line, self.prefill_floor_s)

    def to_dict(self) -> dict[str, object]:
        return {
            "prefill_base_s": self.prefill_base_s,
            "prefill_per_token_s": self.prefill_per_token_s,
            "step_s": self.step_s,
            "prefill_samples": [list(s) for s in self.prefill_samples],
            "step_samples": list(self.step_samples),
            "source": self.source,
            "prefill_floor_s": self.prefill_floor_s,
        }

    @staticmethod
    def from_dict(d: dict[str, object]) -> Calibration:
        pre = d.get("prefill_samples", [])
        steps = d.get("step_samples", [])
        assert isinstance(pre, list) and isinstance(steps, list)
        return Calibration(
            float(d["prefill_base_s"]),  # type: ignore[arg-type]
            float(d["prefill_per_token_s"]),  # type: ignore[arg-type]
            float(d["step_s"]),  # type: ignore[arg-type]
            tuple((int(p), float(t)) for p, t in pre),
            tuple(float(t) for t in steps),
            str(d.get("source", "")),
            float(d.get("prefill_floor_s", 0.0)),  # type: ignore[arg-type]
        )


def fit_prefill(samples: Sequence[tuple[int, float]]) -> tuple[float, float]:
    """(a, b) of prefill_s = a + b x tokens, least squares over (prompt_len, seconds) samples.

    Guards against noise, so every prompt gets a positive prediction: a negative slope falls
    back to a flat line at the median; a negative intercept to a line through the origin.
    """
    if not samples:
        raise ValueError("no prefill samples")
    xs = np.asarray([p for p, _ in samples], dtype=np.float64)
    ys = np.asarray([t for _, t in samples], dtype=np.float64)
    if len(set(xs.tolist())) < 2:
        return float(np.median(ys)), 0.0
    b, a = (float(v) for v in np.polyfit(xs, ys, 1))
    if b < 0:
        return float(np.median(ys)), 0.0
    if a < 0:
        return 0.0, float((xs * ys).sum() / (xs * xs).sum())
    return a, b


def calibration_from_samples(
    prefill_samples: Sequence[tuple[int, float]], step_samples: Sequence[float], source: str = ""
) -> Calibration:
    """Fit the prefill line, floored at the median TTFT of the shortest prompt sampled; the
    step is the median lone-stream TPOT."""
    if not step_samples:
        raise ValueError("no decode-step samples")
    a, b = fit_prefill(prefill_samples)
    shortest = min(p for p, _ in prefill_samples)
    floor = statistics.median(t for p, t in prefill_samples if p == shortest)
    return Calibration(
        a,
        b,
        statistics.median(step_samples),
        tuple((int(p), float(t)) for p, t in prefill_samples),
        tuple(float(t) for t in step_samples),
        source,
        prefill_floor_s=floor,
    )


def ttft_slo_s(cal: Calibration, scale: SLOScale, prompt_len: int) -> float:
    return scale.ttft_x * cal.prefill_s(prompt_len)


def tpot_slo_s(cal: Calibration, scale: SLOScale) -> float:
    return scale.tpot_x * cal.step_s


def meets_slo(rec: RequestRecord, cal: Calibration, scale: SLOScale) -> bool:
    """Completed, TTFT within its prompt's objective, and TPOT (if any) within the step's."""
    if not rec.ok:
        return False
    if ttft_s(rec) > ttft_slo_s(cal, scale, rec.prompt_len):
        return False
    tp = tpot_s(rec)
    return tp is None or tp <= tpot_slo_s(cal, scale)


def attainment(records: Sequence[RequestRecord], cal: Calibration, scale: SLOScale) -> float:
    """Fraction of all requests (failed ones included, as misses) that met both objectives."""
    if not records:
        return 0.0
    return sum(meets_slo(r, cal, scale) for r in records) / len(records)


def goodput_rps(points: Sequence[tuple[float, float]], target: float = ATTAINMENT_TARGET) -> float:
    """Highest rate of (rate_rps, attainment) points below which every tested rate passed
    ``target``; 0.0 when the lowest rate already failed (rule in the module doc)."""
    best = 0.0
    for rate, att in sorted(points):
        if att < target:
            break
        best = rate
    return best
