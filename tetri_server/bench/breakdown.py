"""Where a mode is slow, from saved results: per load and mode, the mean TTFT of the requests
whose prompt falls in each band of ``PROMPT_BANDS`` (with its ratio to a reference mode's) and
the inter-token gaps' p50 / p90 / p99. ``bench sweep`` and ``bench ablation`` append it to their
table; ``python -m tetri_server.bench.breakdown FILE [--cdf-dir DIR]`` prints it for a
sweep.json or the results.json of ``bench compare`` / ``bench ablation`` (also ones written
before it existed) and, with ``--cdf-dir``, draws the TTFT and JCT CDFs of every load there
(``bench ablation`` draws them beside its table unless ``--no-plots``)."""

from __future__ import annotations

import argparse
import json
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from tetri_server.bench.client import RequestRecord
from tetri_server.bench.metrics import itls_s, ttft_s
from tetri_server.bench.report import plot_record_cdfs

PROMPT_BANDS = (128, 512)  # prompt tokens: < 128, 128-511, >= 512


def _records(point: dict[str, Any], *, ok_only: bool = True) -> list[RequestRecord]:
    recs = [RequestRecord.from_json(r) for r in point["records"]]
    return [r for r in recs if r.ok or not ok_only]


def _load_name(rate: float | str) -> str:
    return rate if isinstance(rate, str) else f"{rate:g} req/s"


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
    head = ("| load | mode | " + " | ".join(f"TTFT mean, prompt {n} tokens (s)" for n in names)
            + " | gap p50 / p90 / p99 (ms) |\n" + "|---" * (3 + len(names)) + "|\n")
    rows = []
    for i, rate in enumerate(modes[0]["rates"] if modes else []):
        at = _load_name(rate)
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
            rows.append(f"| {at} | {m['mode']} | " + " | ".join(cells) + f" | {pct} |")
    note = (f"\nRatios against {ref_label}'s mean TTFT in the same band at the same rate.\n"
            if ref is not None else "")
    return head + "\n".join(rows) + "\n" + note


def results_as_sweep(results: Sequence[dict[str, Any]],
                     reference: str = "coupled") -> dict[str, Any]:
    """A ``bench compare`` or ``bench ablation`` results.json (a list of runs, each with its
    records) in the shape ``breakdown_table`` reads: one point per workload and rate, the
    repeats of a mode there pooled."""
    loads: list[str] = []
    pooled: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for r in results:
        w = r["workload"]
        rate = w.get("rate_rps")  # None: a trace at its own timing
        load = w["name"] if rate is None else f"{w['name']} {rate:g} req/s"
        if load not in loads:
            loads.append(load)
        pooled.setdefault((r["mode"], load), []).extend(r["records"])
    labels = list(dict.fromkeys(r["mode"] for r in results))
    modes = [{"mode": m, "rates": loads,
              "points": [{"records": pooled.get((m, load), [])} for load in loads]}
             for m in labels]
    return {"modes": modes, "slo_calibration": {"source": reference}}


def plot_load_cdfs(result: dict[str, Any], out_dir: Path) -> list[Path]:
    """One PNG per load in ``result`` (the shape ``breakdown_table`` reads): the TTFT and JCT
    CDFs of every mode's requests there, repeats pooled. Returns the files written."""
    modes = result["modes"]
    paths = []
    for i, rate in enumerate(modes[0]["rates"] if modes else []):
        at = _load_name(rate)
        path = out_dir / f"cdf_{re.sub(r'[^A-Za-z0-9.]+', '_', at).strip('_')}.png"
        # every request: a curve that stays below 1 shows the failed ones
        plot_record_cdfs({m["mode"]: _records(m["points"][i], ok_only=False) for m in modes},
                         at, path)
        paths.append(path)
    return paths


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tetri_server.bench.breakdown",
                                description=(__doc__ or "").split("\n\n")[0])
    p.add_argument("file", type=Path, help="a sweep.json, or a compare/ablation results.json")
    p.add_argument("--cdf-dir", type=Path, help="also draw each load's TTFT/JCT CDFs here")
    args = p.parse_args(argv)
    saved = json.loads(args.file.read_text())
    result = saved if isinstance(saved, dict) else results_as_sweep(saved)
    print(breakdown_table(result))
    if args.cdf_dir is not None:
        for path in plot_load_cdfs(result, args.cdf_dir):
            print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
