"""Benchmark client: the paper's workloads from real data, an open-loop streaming load
generator, metrics (TTFT/TPOT/ITL/JCT, goodput, resource usage, perf/$), reports and a
side-by-side runner for our modes and vLLM-CPU. Entry point: ``python -m tetri_server.bench``.

Layout: data (file readers) → workload (+ prompts, arrivals) → client (+ sse, progress, prom)
→ metrics → report; compare starts servers; slo (attainment, goodput) + sweep (calibration,
rate sweep) + sweep_report find the SLO goodput; cli wires them.
"""

from __future__ import annotations

from tetri_server.bench.client import ClientConfig, RequestRecord, RunResult, run_benchmark
from tetri_server.bench.metrics import SLO, Stats, Summary, summarize
from tetri_server.bench.report import BenchResult, markdown_table, ratio_table
from tetri_server.bench.workload import (
    BenchRequest,
    WorkloadSpec,
    build_workload,
    fit_to_context,
    length_class,
)

__all__ = [
    "SLO",
    "BenchRequest",
    "BenchResult",
    "ClientConfig",
    "RequestRecord",
    "RunResult",
    "Stats",
    "Summary",
    "WorkloadSpec",
    "build_workload",
    "fit_to_context",
    "length_class",
    "markdown_table",
    "ratio_table",
    "run_benchmark",
    "summarize",
]
