"""Per-run metrics from request records (pure: no I/O, no clock).

Definitions (times in seconds, per completed request; vllm bench serve uses the same ones):
  TTFT = first_token_s - send_s          JCT  = end_s - send_s (stream end)
  TPOT = (end_s - first_token_s) / (output_tokens - 1), for output_tokens > 1
  ITL  = gaps between consecutive token arrivals, pooled over all requests
  client wait = send_s - arrival_s (non-zero only when the concurrency cap held a request)
Throughput divides by ``duration_s`` (run start to the last end). Goodput counts completed
requests with TTFT <= slo.ttft_s and TPOT <= slo.tpot_s (a one-token request has no TPOT and
meets it). Resource usage: worker busy seconds between the two /metrics scrapes. Held
worker-seconds = num_workers x duration_s (a worker is paid for while it exists, busy or not);
perf/$ = completed requests per held worker-second; utilization = busy / held. Server CPU
seconds (``compare`` only): CPU time of all the server's processes during the run, a resource
measure that also exists for servers without a busy metric (vLLM). Other CPU seconds: what
every other process on the machine used meanwhile (machine busy - server - client), the noise
of a shared machine.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass

import numpy as np

from tetri_server.bench.client import RequestRecord, RunResult
from tetri_server.bench.prom import busy_delta
from tetri_server.bench.prom import num_workers as workers_in


@dataclass(frozen=True)
class Stats:
    mean: float | None
    p50: float | None
    p90: float | None
    p99: float | None

    @staticmethod
    def of(values: Sequence[float]) -> Stats:
        if not values:
            return Stats(None, None, None, None)
        arr = np.asarray(values, dtype=np.float64)
        p50, p90, p99 = (float(x) for x in np.percentile(arr, [50, 90, 99]))
        return Stats(float(arr.mean()), p50, p90, p99)


@dataclass(frozen=True)
class SLO:
    """Latency objectives for goodput. Defaults are for the tiny CPU model; state yours."""

    ttft_s: float = 2.0
    tpot_s: float = 0.2


def output_tokens(rec: RequestRecord) -> int:
    """Generated tokens: the server's usage count, else the token arrivals we saw."""
    return rec.num_output_tokens if rec.num_output_tokens is not None else len(rec.token_times_s)


def ttft_s(rec: RequestRecord) -> float:
    assert rec.first_token_s is not None and rec.send_s is not None
    return rec.first_token_s - rec.send_s


def jct_s(rec: RequestRecord) -> float:
    assert rec.end_s is not None and rec.send_s is not None
    return rec.end_s - rec.send_s


def tpot_s(rec: RequestRecord) -> float | None:
    n = output_tokens(rec)
    if n <= 1:
        return None
    assert rec.end_s is not None and rec.first_token_s is not None
    return (rec.end_s - rec.first_token_s) / (n - 1)


def itls_s(rec: RequestRecord) -> list[float]:
    t = rec.token_times_s
    return [b - a for a, b in zip(t, t[1:], strict=False)]


@dataclass(frozen=True)
class Summary:
    num_requests: int
    num_completed: int
    num_errors: int
    duration_s: float
    request_throughput_rps: float
    output_throughput_tps: float
    total_token_throughput_tps: float
    goodput_rps: float
    slo_attainment: float  # fraction of all requests that completed within both SLOs
    slo: SLO
    ttft_s: Stats
    tpot_s: Stats
    itl_s: Stats
    jct_s: Stats
    client_wait_s: Stats
    num_output_mismatch: int  # completed with a token count != max_tokens (ignore_eos broken?)
    busy_s: dict[str, float] | None  # "worker:role" -> busy seconds during the run
    busy_s_total: float | None
    num_workers: int | None
    held_worker_s: float | None
    utilization: float | None
    perf_per_dollar: float | None  # completed requests per worker-second held
    top_errors: dict[str, int]
    server_cpu_s: dict[str, float] | None = None  # per process, during the run (compare only)
    server_cpu_s_total: float | None = None
    client_cpu_s: float | None = None
    other_cpu_s: float | None = None  # machine busy - server - client: other tenants' load

    def to_dict(self) -> dict[str, object]:
        return asdict(self)


def summarize(run: RunResult, slo: SLO, num_workers: int | None = None) -> Summary:
    """All metrics of one run. ``num_workers`` defaults to the workers seen in /metrics."""
    done = [r for r in run.records if r.ok]
    dur_s = run.duration_s
    ttfts = [ttft_s(r) for r in done]
    tpots = [tpot_s(r) for r in done]
    good = sum(
        1
        for t1, tp in zip(ttfts, tpots, strict=True)
        if t1 <= slo.ttft_s and (tp is None or tp <= slo.tpot_s)
    )
    out_tokens = sum(output_tokens(r) for r in done)
    in_tokens = sum(
        r.num_prompt_tokens if r.num_prompt_tokens is not None else r.prompt_len for r in done
    )
    busy = busy_delta(run.busy_before, run.busy_after)
    workers = num_workers if num_workers is not None else workers_in(run.busy_after)
    held_s = workers * dur_s if workers else None
    busy_total = sum(busy.values()) if busy is not None else None
    waits = [r.send_s - r.arrival_s for r in run.records if r.send_s is not None]
    errors = Counter((r.error or "")[:120] for r in run.records if not r.ok)
    server_cpu = None if run.server_cpu_s is None else sum(run.server_cpu_s.values())
    other_cpu = None
    if run.machine_cpu_s is not None and server_cpu is not None and run.client_cpu_s is not None:
        other_cpu = run.machine_cpu_s - server_cpu - run.client_cpu_s

    def per_s(x: float) -> float:
        return x / dur_s if dur_s > 0 else 0.0

    return Summary(
        num_requests=len(run.records),
        num_completed=len(done),
        num_errors=len(run.records) - len(done),
        duration_s=dur_s,
        request_throughput_rps=per_s(len(done)),
        output_throughput_tps=per_s(out_tokens),
        total_token_throughput_tps=per_s(out_tokens + in_tokens),
        goodput_rps=per_s(good),
        slo_attainment=good / len(run.records) if run.records else 0.0,
        slo=slo,
        ttft_s=Stats.of(ttfts),
        tpot_s=Stats.of([t for t in tpots if t is not None]),
        itl_s=Stats.of([g for r in done for g in itls_s(r)]),
        jct_s=Stats.of([jct_s(r) for r in done]),
        client_wait_s=Stats.of(waits),
        num_output_mismatch=sum(1 for r in done if output_tokens(r) != r.output_len),
        busy_s=busy,
        busy_s_total=busy_total,
        num_workers=workers,
        held_worker_s=held_s,
        utilization=busy_total / held_s if busy_total is not None and held_s else None,
        perf_per_dollar=len(done) / held_s if held_s else None,
        top_errors=dict(errors.most_common(5)),
        server_cpu_s=run.server_cpu_s,
        server_cpu_s_total=server_cpu,
        client_cpu_s=run.client_cpu_s,
        other_cpu_s=other_cpu,
    )
