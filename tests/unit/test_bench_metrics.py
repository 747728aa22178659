"""Metrics on hand-made timelines: every number below is worked out by hand."""

from __future__ import annotations

import pytest

from tetri_server.bench.client import RequestRecord, RunResult
from tetri_server.bench.metrics import SLO, Stats, summarize
from tetri_server.bench.prom import busy_delta, num_workers, parse_busy_seconds
from tetri_server.bench.report import BenchResult, markdown_table, ratio_table
from tetri_server.bench.workload import WorkloadSpec


def _records() -> list[RequestRecord]:
    a = RequestRecord(
        0,
        "LPLD",
        10,
        4,
        arrival_s=0.0,
        send_s=0.0,
        first_token_s=0.5,
        token_times_s=[0.5, 0.7, 1.0, 1.2],
        end_s=1.25,
        num_output_tokens=4,
        num_prompt_tokens=10,
    )
    # held 0.5 s by the concurrency cap
    b = RequestRecord(
        1,
        "LPLD",
        20,
        2,
        arrival_s=1.0,
        send_s=1.5,
        first_token_s=2.0,
        token_times_s=[2.0, 2.5],
        end_s=2.5,
        num_output_tokens=2,
        num_prompt_tokens=20,
    )
    c = RequestRecord(
        2,
        "LPLD",
        30,
        8,
        arrival_s=2.0,
        send_s=2.0,
        end_s=2.1,
        http_status=500,
        error="HTTP 500: boom",
    )
    # asked for 3 tokens, got 1 (ignore_eos not honoured); no usage prompt count
    d = RequestRecord(
        3,
        "LPLD",
        5,
        3,
        arrival_s=3.0,
        send_s=3.0,
        first_token_s=5.0,
        token_times_s=[5.0],
        end_s=5.0,
        num_output_tokens=1,
    )
    return [a, b, c, d]


def _run() -> RunResult:
    return RunResult(
        _records(),
        duration_s=5.0,
        started_unix_s=0.0,
        busy_before={"0:prefill": 10.0, "1:decode": 5.0},
        busy_after={"0:prefill": 12.0, "1:decode": 8.0},
    )


def test_latency_metrics() -> None:
    s = summarize(_run(), SLO(ttft_s=1.0, tpot_s=0.3))
    assert (s.num_requests, s.num_completed, s.num_errors) == (4, 3, 1)
    # TTFT 0.5, 0.5, 2.0 -> linear percentiles over [0.5, 0.5, 2.0]
    assert (s.ttft_s.mean, s.ttft_s.p50) == (1.0, 0.5)
    assert (s.ttft_s.p90, s.ttft_s.p99) == (pytest.approx(1.7), pytest.approx(1.97))
    # TPOT (1.25-0.5)/3 = 0.25 and (2.5-2.0)/1 = 0.5; the one-token request has none
    assert s.tpot_s.mean == pytest.approx(0.375)
    # ITL pooled: 0.2, 0.3, 0.2 and 0.5
    assert s.itl_s.mean == pytest.approx(0.3) and s.itl_s.p50 == pytest.approx(0.25)
    # JCT 1.25, 1.0, 2.0
    assert s.jct_s.mean == pytest.approx(4.25 / 3) and s.jct_s.p50 == pytest.approx(1.25)
    # client wait 0, 0.5, 0, 0 (the failed request was sent too)
    assert s.client_wait_s.mean == pytest.approx(0.125)
    assert s.num_output_mismatch == 1
    assert s.top_errors == {"HTTP 500: boom": 1}


def test_throughput_goodput_and_resources() -> None:
    s = summarize(_run(), SLO(ttft_s=1.0, tpot_s=0.3))
    assert s.request_throughput_rps == pytest.approx(3 / 5)
    assert s.output_throughput_tps == pytest.approx(7 / 5)  # 4 + 2 + 1 tokens
    assert s.total_token_throughput_tps == pytest.approx((7 + 10 + 20 + 5) / 5)
    # only A meets both SLOs (B: TPOT 0.5 > 0.3; D: TTFT 2.0 > 1.0)
    assert s.goodput_rps == pytest.approx(1 / 5) and s.slo_attainment == pytest.approx(1 / 4)
    assert s.busy_s == {"0:prefill": 2.0, "1:decode": 3.0} and s.busy_s_total == 5.0
    assert s.num_workers == 2 and s.held_worker_s == 10.0
    assert s.utilization == pytest.approx(0.5)
    assert s.perf_per_dollar == pytest.approx(3 / 10)
    loose = summarize(_run(), SLO(ttft_s=2.0, tpot_s=0.5), num_workers=4)
    assert loose.goodput_rps == pytest.approx(3 / 5)
    assert loose.held_worker_s == 20.0 and loose.perf_per_dollar == pytest.approx(3 / 20)


def test_server_without_busy_metric_has_no_resource_numbers() -> None:
    run = RunResult(_records(), duration_s=5.0, started_unix_s=0.0)
    s = summarize(run, SLO())
    assert s.busy_s is None and s.busy_s_total is None and s.perf_per_dollar is None
    assert summarize(run, SLO(), num_workers=1).perf_per_dollar == pytest.approx(3 / 5)


def test_empty_run() -> None:
    s = summarize(RunResult([], 0.0, 0.0), SLO())
    assert s.ttft_s == Stats(None, None, None, None) and s.request_throughput_rps == 0.0


PROM_PAGE = """\
# HELP tetri_worker_busy_seconds_total Seconds each worker spent in model steps.
# TYPE tetri_worker_busy_seconds_total counter
tetri_worker_busy_seconds_total{role="prefill",worker="0"} 12.5
tetri_worker_busy_seconds_total{role="decode",worker="1"} 3.0
tetri_worker_busy_seconds_total{role="prefill",worker="1"} 1.0
# TYPE tetri_requests_running gauge
tetri_requests_running 2.0
"""


def test_prometheus_busy_seconds_and_deltas() -> None:
    busy = parse_busy_seconds(PROM_PAGE)
    assert busy == {"0:prefill": 12.5, "1:decode": 3.0, "1:prefill": 1.0}
    assert num_workers(busy) == 2
    assert parse_busy_seconds("# TYPE x counter\nx_total 1.0\n") is None
    # a role that appeared during the run (a flip) counts from 0; a reset counts from 0
    assert busy_delta({"0:prefill": 10.0, "1:decode": 5.0}, busy) == {
        "0:prefill": 2.5,
        "1:decode": 3.0,
        "1:prefill": 1.0,
    }
    assert busy_delta({"0:prefill": 10.0}, {"0:prefill": 4.0}) == {"0:prefill": 4.0}


def test_tables_report_ratios_against_coupled() -> None:
    def result(mode: str, scale: float) -> BenchResult:
        run = _run()
        for r in run.records:  # every latency scaled by `scale`
            for attr in ("send_s", "first_token_s", "end_s"):
                if getattr(r, attr) is not None:
                    setattr(r, attr, getattr(r, attr) * scale)
            r.token_times_s = [t * scale for t in r.token_times_s]
        run.duration_s *= scale
        return BenchResult(mode, WorkloadSpec("LPLD"), summarize(run, SLO()), run)

    results = [result("coupled", 1.0), result("disaggregated", 0.5)]
    table = markdown_table(results)
    assert "| LPLD | coupled | 3/4 | 1.000 / 0.500 / 1.700 / 1.970 |" in table  # mean / p50 ...
    assert "| 1.417 / 1.250 / 1.850 / 1.985 |" in table  # JCT over [1.0, 1.25, 2.0]
    ratios = ratio_table(results)
    # half the latency and the same busy seconds in half the time: perf/$ doubles; no server
    # CPU numbers (those come from compare only)
    assert (
        "| LPLD | disaggregated | 0.50× (-50%) † 1/1 failed | 0.50× (-50%) † 1/1 failed "
        "| 1.00× (+0%) | n/a "
        "| 2.00× (+100%) | -44% / -40% |" in ratios
    )
    assert "| LPLD | coupled |" not in ratios


def test_ratio_table_against_another_baseline_and_server_cpu() -> None:
    def result(mode: str, cpu: float) -> BenchResult:
        run = _run()
        run.server_cpu_s = {"python[10]": cpu / 2, "python[11]": cpu / 2}
        run.client_cpu_s, run.machine_cpu_s = 1.0, cpu + 3.5
        return BenchResult(mode, WorkloadSpec("Mixed"), summarize(run, SLO()), run)

    results = [result("vllm-cpu", 4.0), result("disaggregated", 6.0), result("coupled", 5.0)]
    assert results[1].summary.server_cpu_s_total == 6.0
    assert results[1].summary.other_cpu_s == 2.5  # 9.5 machine - 6 server - 1 client
    # busy, server CPU, other CPU, held, perf/$
    assert "| 5.0 | 6.0 | 2.5 | 10.0 | 0.3000 |" in markdown_table(results)
    ratios = ratio_table(results, "vllm-cpu")
    assert "vs vllm-cpu" in ratios and "| Mixed | vllm-cpu |" not in ratios
    # same latencies, 1.5x the CPU seconds; the paper's deltas beside disaggregated only
    assert (
        "| Mixed | disaggregated | 1.00× (+0%) † 1/1 failed | 1.00× (+0%) † 1/1 failed "
        "| 1.00× (+0%) | 1.50× (+50%) "
        "| 1.00× (+0%) | -85% / -50% |" in ratios
    )
    assert ("| Mixed | coupled | 1.00× (+0%) † 1/1 failed | 1.00× (+0%) † 1/1 failed "
            "| 1.00× (+0%) | 1.25× (+25%) " in ratios)


def test_a_ratio_over_a_side_that_lost_requests_says_so() -> None:
    """Regression: means cover completed requests only, so a mode whose slowest requests
    failed showed a better TTFT/JCT ratio with nothing beside it; now the ratio names the
    failures and the table says why."""
    failed = _run()
    clean = _run()
    clean.records = [r for r in clean.records if r.ok]
    results = [BenchResult("coupled", WorkloadSpec("LPLD"), summarize(clean, SLO()), clean),
               BenchResult("disaggregated", WorkloadSpec("LPLD"), summarize(failed, SLO()),
                           failed)]
    ratios = ratio_table(results)
    assert "| LPLD | disaggregated | 1.00× (+0%) † 1/0 failed | 1.00× (+0%) † 1/0 failed " in ratios
    assert "cover the completed ones only" in ratios
    assert "†" not in ratio_table(results[:1] + [BenchResult(
        "disaggregated", WorkloadSpec("LPLD"), summarize(clean, SLO()), clean)])
