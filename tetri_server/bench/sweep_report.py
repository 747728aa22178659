"""``bench sweep`` output: the Markdown table and the result JSON (pure but for
``report.machine_info``, which reads /proc/cpuinfo, when no machine block is given)."""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from typing import Any

from tetri_server.bench.report import BenchResult, machine_info
from tetri_server.bench.slo import Calibration, SLOScale, meets_slo, tpot_slo_s
from tetri_server.bench.sweep import ModeSweep

# summary fields computed against metrics.SLO's fixed objectives: not this sweep's SLO
_FIXED_SLO_KEYS = ("goodput_rps", "slo_attainment", "slo")


def _ms(x: float | None) -> str:
    return "n/a" if x is None else f"{x * 1e3:.0f}"


def _s(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.2f}"


def _others(r: BenchResult) -> str:
    """CPU other tenants used during the run, in cores (n/a for a server started elsewhere)."""
    s = r.summary
    return (
        "n/a"
        if s.other_cpu_s is None or s.duration_s <= 0
        else f"{s.other_cpu_s / s.duration_s:.2f}"
    )


def _cal_text(cal: Calibration) -> str:
    return (
        f"{cal.prefill_base_s * 1e3:.1f} ms + {cal.prefill_per_token_s * 1e3:.3f} ms/token, "
        f"floor {cal.prefill_floor_s * 1e3:.1f} ms, step {cal.step_s * 1e3:.1f} ms"
    )


def sweep_table(sweeps: Sequence[ModeSweep], cal: Calibration, scale: SLOScale) -> str:
    """Markdown: per mode, the goodput, attainment at each rate and the mean TTFT / TPOT."""
    rates = [r.spec.rate_rps for r in sweeps[0].results] if sweeps else []
    at = " / ".join(f"{r:g}" for r in rates)
    head = (
        f"| mode | goodput (req/s) | attainment at {at} req/s | TTFT mean (s) | TPOT mean (ms) "
        "| others' load (cores) | unloaded (own calibration) |\n" + "|---" * 7 + "|\n"
    )
    rows = []
    for sw in sweeps:
        atts = sw.attainments(cal, scale)
        # rounded down: 89.5% must not read as the 90% target met
        met = " / ".join(f"{math.floor(a * 1000) / 10:g}%" for a in atts)
        ttft = " / ".join(_s(r.summary.ttft_s.mean) for r in sw.results)
        tpot = " / ".join(_ms(r.summary.tpot_s.mean) for r in sw.results)
        others = " / ".join(_others(r) for r in sw.results)
        own = "loaded" if sw.calibration is None else _cal_text(sw.calibration)
        rows.append(
            f"| {sw.label} | **{sw.goodput_rps(cal, scale):g}** | {met} | {ttft} | {tpot} "
            f"| {others} | {own} |"
        )
    note = (
        f"\nSLO (from {cal.source or 'a loaded calibration'}: {_cal_text(cal)}): "
        f"TTFT <= {scale.ttft_x:g} x max({cal.prefill_base_s * 1e3:.1f} ms + "
        f"{cal.prefill_per_token_s * 1e3:.3f} ms x prompt tokens, "
        f"{cal.prefill_floor_s * 1e3:.1f} ms), "
        f"TPOT <= {scale.tpot_x:g} x step = {tpot_slo_s(cal, scale) * 1e3:.0f} ms; goodput = the "
        f"highest rate at which it and every lower rate had >= {scale.target * 100:.0f}% "
        "of requests within both (0 = below the lowest rate).\n"
    )
    return head + "\n".join(rows) + "\n" + note


def _result_dict(r: BenchResult, cal: Calibration, scale: SLOScale) -> dict[str, Any]:
    out = r.to_dict()
    for key in _FIXED_SLO_KEYS:
        out["summary"].pop(key, None)
    met = [meets_slo(q, cal, scale) for q in r.run.records]
    for rec, ok in zip(out["records"], met, strict=True):
        rec["met_slo"] = ok
    out["attainment"] = sum(met) / len(met) if met else 0.0
    out["num_met"] = sum(met)
    return out


def sweep_json(
    sweeps: Sequence[ModeSweep],
    cal: Calibration,
    scale: SLOScale,
    started_unix_s: float,
    extra: dict[str, Any] | None = None,
    machine: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Everything needed to recompute the goodput with other multipliers: the calibrations,
    and every request of every rate (each marked ``met_slo``)."""
    return {
        "kind": "slo_sweep",
        "definition": "goodput = highest rate r such that every tested rate <= r had >= target "
        "of requests with TTFT <= ttft_x * max(a + b * prompt_len, prefill_floor_s) and "
        "TPOT <= tpot_x * step",
        "scale": {"ttft_x": scale.ttft_x, "tpot_x": scale.tpot_x, "target": scale.target},
        "slo_calibration": cal.to_dict(),
        "started_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(started_unix_s)),
        "machine": machine if machine is not None else machine_info(),
        **(extra or {}),
        "modes": [
            {
                "mode": sw.label,
                "goodput_rps": sw.goodput_rps(cal, scale),
                "calibration": None if sw.calibration is None else sw.calibration.to_dict(),
                "rates": [r.spec.rate_rps for r in sw.results],
                "attainment": sw.attainments(cal, scale),
                "points": [_result_dict(r, cal, scale) for r in sw.results],
            }
            for sw in sweeps
        ],
    }

