"""``bench sweep`` output: the Markdown tables and the result JSON (pure but for
``machine_info``, which reads /proc/cpuinfo).

``python -m tetri_server.bench.sweep_report SWEEP_JSON`` prints the breakdown table of a saved
sweep (any sweep.json, also one written before the table existed)."""

from __future__ import annotations

import os
import platform
import sys
import time
from collections.abc import Sequence
from dataclasses import fields
from typing import Any

import numpy as np

from tetri_server.bench.client import RequestRecord
from tetri_server.bench.metrics import itls_s, ttft_s
from tetri_server.bench.report import BenchResult
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
        met = " / ".join(f"{a * 100:.0f}%" for a in atts)
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


PROMPT_BANDS = (128, 512)  # prompt tokens: < 128, 128-511, >= 512


def _records(point: dict[str, Any]) -> list[RequestRecord]:
    names = {f.name for f in fields(RequestRecord)}
    recs = [RequestRecord(**{k: v for k, v in r.items() if k in names}) for r in point["records"]]
    return [r for r in recs if r.ok]


def _band_ttfts(recs: Sequence[RequestRecord]) -> list[list[float]]:
    bands: list[list[float]] = [[] for _ in range(len(PROMPT_BANDS) + 1)]
    for r in recs:
        bands[sum(r.prompt_len >= b for b in PROMPT_BANDS)].append(ttft_s(r))
    return bands


def breakdown_table(result: dict[str, Any]) -> str:
    """Markdown, from a sweep's JSON: at each rate and for each mode, the mean TTFT of the
    requests whose prompt falls in each band of ``PROMPT_BANDS`` (and its ratio to the
    reference mode's, the one that set the SLOs, where it ran), and the inter-token gaps'
    p50 / p90 / p99 over all requests. It says which prompts a mode is slow to start and
    whether its tail gaps are rare spikes or its steady pace."""
    modes = result["modes"]
    ref_label = (result.get("slo_calibration") or {}).get("source")
    ref = next((m for m in modes if m["mode"] == ref_label), None)
    lo, hi = PROMPT_BANDS
    names = [f"< {lo}", f"{lo}-{hi - 1}", f">= {hi}"]
    head = ("| rate (req/s) | mode | " + " | ".join(f"TTFT mean, prompt {n} tokens (s)"
                                                    for n in names)
            + " | gap p50 / p90 / p99 (ms) |\n" + "|---" * (3 + len(names)) + "|\n")
    rows = []
    for i, rate in enumerate(modes[0]["rates"] if modes else []):
        ref_bands = _band_ttfts(_records(ref["points"][i])) if ref is not None else None
        for m in modes:
            recs = _records(m["points"][i])
            cells = []
            for j, band in enumerate(_band_ttfts(recs)):
                if not band:
                    cells.append("-")
                    continue
                mean = float(np.mean(band))
                cell = f"{mean:.3f} (n={len(band)})"
                if ref_bands is not None and ref_bands[j] and m is not ref:
                    cell += f", {mean / float(np.mean(ref_bands[j])):.2f}x"
                cells.append(cell)
            gaps = [g for r in recs for g in itls_s(r)]
            pct = " / ".join(f"{x * 1e3:.1f}" for x in np.percentile(gaps, [50, 90, 99])) \
                if gaps else "n/a"
            rows.append(f"| {rate:g} | {m['mode']} | " + " | ".join(cells) + f" | {pct} |")
    note = (f"\nRatios against {ref_label}'s mean TTFT in the same band at the same rate.\n"
            if ref is not None else "")
    return head + "\n".join(rows) + "\n" + note


def machine_info() -> dict[str, Any]:
    """nproc, CPU model and load average now (take it before the runs)."""
    model = platform.processor()
    try:
        for line in open("/proc/cpuinfo").read().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {"nproc": os.cpu_count(), "cpu_model": model, "load_avg": os.getloadavg()}


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
        "of requests with TTFT <= ttft_x * (a + b * prompt_len) and TPOT <= tpot_x * step",
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


if __name__ == "__main__":
    import json

    if len(sys.argv) != 2:
        sys.exit("usage: python -m tetri_server.bench.sweep_report SWEEP_JSON")
    with open(sys.argv[1]) as f:
        print(breakdown_table(json.load(f)))
