"""The breakdown table (bench/breakdown.py): which prompts a mode starts late and its gap
percentiles, from a saved sweep.json or a compare/ablation results.json."""

from __future__ import annotations

import json

from tetri_server.bench.breakdown import breakdown_table, results_as_sweep
from tetri_server.bench.client import RequestRecord, RunResult
from tetri_server.bench.metrics import SLO, summarize
from tetri_server.bench.report import BenchResult
from tetri_server.bench.slo import Calibration, SLOScale
from tetri_server.bench.sweep import ModeSweep
from tetri_server.bench.sweep_report import sweep_json
from tetri_server.bench.workload import WorkloadSpec


def _banded(rate: float, ttft_by_len: dict[int, float], gap: float,
            mode: str = "m") -> BenchResult:
    """Two requests of each prompt length, first token after ``ttft_by_len[len]``, then two
    more tokens ``gap`` apart."""
    recs = [
        RequestRecord(i, "Mixed", n, 3, 0.0, 0.0, t, [t, t + gap, t + 2 * gap], t + 2 * gap,
                      num_output_tokens=3)
        for i, (n, t) in enumerate(sorted(ttft_by_len.items()) * 2)
    ]
    run = RunResult(recs, 10.0, 0.0)
    spec = WorkloadSpec("Mixed", num_requests=len(recs), rate_rps=rate)
    return BenchResult(mode, spec, summarize(run, SLO()), run)


def test_breakdown_shows_which_prompts_start_late_and_the_gap_percentiles() -> None:
    """From the sweep's JSON (as saved): per rate and mode, the mean TTFT per prompt band with
    its ratio to the SLO's reference mode, and the gaps' p50 / p90 / p99."""
    cal = Calibration(0.01, 0.001, 0.02, source="coupled")
    ref = ModeSweep("coupled", cal, [_banded(1.0, {50: 0.04, 300: 0.10, 800: 0.30}, 0.02)])
    split = ModeSweep("disaggregated", None,
                      [_banded(1.0, {50: 0.04, 300: 0.16, 800: 0.45}, 0.03)])
    saved = json.loads(json.dumps(sweep_json([ref, split], cal, SLOScale(), 0.0)))
    table = breakdown_table(saved)
    assert "| 1 req/s | coupled | 0.040 (n=2) | 0.100 (n=2) | 0.300 (n=2) | 20.0 / 20.0 / 20.0 |" \
        in table
    assert ("| 1 req/s | disaggregated | 0.040 (n=2), 1.00x | 0.160 (n=2), 1.60x | "
            "0.450 (n=2), 1.50x | 30.0 / 30.0 / 30.0 |") in table
    assert "against coupled's mean TTFT" in table
    failed = saved["modes"][1]["points"][0]["records"][0]
    failed.update(error="HTTP 500", first_token_s=None, token_times_s=[], end_s=None)
    assert "0.040 (n=1), 1.00x" in breakdown_table(saved)  # failed requests are left out


def test_results_of_an_ablation_pool_the_repeats_per_workload_and_rate() -> None:
    """A results.json list (two repeats of two rows at one load): one row per mode, every
    request of both repeats counted, ratios against coupled."""
    runs = [_banded(1.5, {50: 0.04, 800: 0.30}, 0.02, "coupled"),
            _banded(1.5, {50: 0.06, 800: 0.50}, 0.02, "default"),
            _banded(1.5, {50: 0.04, 800: 0.30}, 0.02, "coupled"),
            _banded(1.5, {50: 0.02, 800: 0.40}, 0.04, "default")]
    saved = json.loads(json.dumps([r.to_dict() for r in runs]))
    table = breakdown_table(results_as_sweep(saved))
    assert "| Mixed 1.5 req/s | coupled | 0.040 (n=4) | - | 0.300 (n=4) |" in table
    assert "| Mixed 1.5 req/s | default | 0.040 (n=4), 1.00x | - | 0.450 (n=4), 1.50x |" in table
    assert table.count("| Mixed 1.5 req/s |") == 2


def test_a_trace_at_its_own_timing_is_named_by_its_workload() -> None:
    """A results.json run without a rate (a trace replayed at its own timing) still gets its
    row, named by the workload alone."""
    run = _banded(1.0, {50: 0.04}, 0.02, "coupled").to_dict()
    run["workload"]["rate_rps"] = None
    assert "| Mixed | coupled | 0.040 (n=2) |" in breakdown_table(results_as_sweep([run]))


def test_cdfs_are_drawn_per_load_with_a_line_per_mode(tmp_path, monkeypatch) -> None:
    """From a results.json list: one PNG per workload and rate, named after it; the CLI prints
    the table and the files it wrote."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    from tetri_server.bench import breakdown, report

    runs = [_banded(1.5, {50: 0.04, 800: 0.30}, 0.02, "coupled"),
            _banded(1.5, {50: 0.06, 800: 0.50}, 0.02, "default"),
            _banded(2.2, {50: 0.05, 800: 0.40}, 0.02, "coupled"),
            _banded(2.2, {50: 0.07, 800: 0.60}, 0.02, "default")]
    saved = tmp_path / "results.json"
    saved.write_text(json.dumps([r.to_dict() for r in runs]))
    drawn: list[dict[str, list[float]]] = []
    real = report.plot_record_cdfs

    def spy(curves, title, path):  # the TTFTs each line is drawn from
        drawn.append({m: sorted(r.first_token_s for r in recs) for m, recs in curves.items()})
        real(curves, title, path)

    monkeypatch.setattr(breakdown, "plot_record_cdfs", spy)
    assert breakdown.main([str(saved), "--cdf-dir", str(tmp_path / "png")]) == 0
    files = sorted(p.name for p in (tmp_path / "png").iterdir())
    assert files == ["cdf_Mixed_1.5_req_s.png", "cdf_Mixed_2.2_req_s.png"]
    assert all((tmp_path / "png" / f).read_bytes()[:4] == b"\x89PNG" for f in files)
    assert drawn[0] == {"coupled": [0.04, 0.04, 0.30, 0.30], "default": [0.06, 0.06, 0.50, 0.50]}
    assert drawn[1]["default"] == [0.07, 0.07, 0.60, 0.60]
    plt.close("all")


def test_a_load_cdf_stays_below_one_by_its_failed_requests(tmp_path, monkeypatch) -> None:
    """Regression (review of session 64): the sweep's and ablation's CDFs were drawn from the
    completed requests only, so every curve reached 1 and hid the failed ones."""
    import pytest

    from tetri_server.bench import breakdown
    from tetri_server.bench.report import cdf_points

    runs = [_banded(1.5, {50: 0.04}, 0.02, "coupled").to_dict(),
            _banded(1.5, {50: 0.05}, 0.02, "default").to_dict()]
    failed = dict(runs[0]["records"][0], error="HTTP 503", first_token_s=None, end_s=None)
    runs[0]["records"].append(failed)
    tops: dict[str, float] = {}

    def spy(curves, title, path):  # noqa: ANN001, ANN202 - where each TTFT curve ends
        for mode, recs in curves.items():
            tops[mode] = cdf_points([1.0 for r in recs if r.ok], len(recs))[1][-1]

    monkeypatch.setattr(breakdown, "plot_record_cdfs", spy)
    breakdown.plot_load_cdfs(results_as_sweep(runs), tmp_path)
    assert tops == {"coupled": pytest.approx(2 / 3), "default": 1.0}


def test_compare_cdfs_pool_the_runs_of_a_mode(tmp_path, monkeypatch) -> None:
    """``report.plot_cdfs`` (bench compare): two runs of one mode are one line of both runs'
    requests, not two lines with the same label."""
    from tetri_server.bench import report

    seen: list[dict[str, int]] = []
    monkeypatch.setattr(report, "plot_record_cdfs",
                        lambda curves, title, path: seen.append(
                            {m: len(recs) for m, recs in curves.items()}))
    runs = [_banded(1.0, {50: 0.04}, 0.02, "coupled"), _banded(1.0, {50: 0.05}, 0.02, "coupled"),
            _banded(1.0, {50: 0.06}, 0.02, "default")]
    report.plot_cdfs(runs, tmp_path / "cdf.png")
    assert seen == [{"coupled": 4, "default": 2}]
