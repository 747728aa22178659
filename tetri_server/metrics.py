"""Prometheus metrics of one server, in a registry the ``Metrics`` object owns (no globals).

Who writes what:
    backend (control process)  ``set_requests``, ``set_worker``, ``set_chunk_size``,
                               ``inc_restarts``, ``remove_worker``
    API layer                  ``observe_first_token``, ``observe_finished``, ``inc_error``
    GET /metrics               ``render``

Workers report *cumulative* busy seconds and preemptions (``LoadReport``); ``set_worker`` turns
them into increments of true Prometheus counters, so the exported counters never go down even
when a worker restarts (its report starts again from 0) or flips role (increments go to the
role it reports now).
"""

from __future__ import annotations

from dataclasses import dataclass

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)

TTFT_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
TPOT_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5)
E2E_BUCKETS_S = (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)


@dataclass
class _WorkerTotals:
    """Last cumulative values one worker reported (to turn them into increments)."""

    busy_s: float = 0.0
    preemptions: int = 0


def _increment(last: float, now: float) -> float:
    """Counter increment from two cumulative reports; a drop means the reporter restarted."""
    return now - last if now >= last else now


class Metrics:
    """Every ``tetri_*`` metric of one server."""

    content_type = CONTENT_TYPE_LATEST

    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.requests_running = Gauge(
            "tetri_requests_running", "Requests being prefilled or decoded.", registry=r
        )
        self.requests_waiting = Gauge(
            "tetri_requests_waiting", "Requests queued, not yet running.", registry=r
        )
        self.kv_blocks_used = Gauge(
            "tetri_kv_blocks_used", "KV blocks in use.", ["worker"], registry=r
        )
        self.kv_blocks_total = Gauge(
            "tetri_kv_blocks_total", "KV blocks in the pool.", ["worker"], registry=r
        )
        self.worker_restarts = Counter(
            "tetri_worker_restarts", "Worker processes restarted after dying.", registry=r
        )
        self.worker_stalls = Counter(
            "tetri_worker_stalls",
            "Workers killed because they sent nothing for monitor.stall_timeout_s.",
            registry=r,
        )
        self.workers_up = Gauge(
            "tetri_worker_up", "1 while the worker is ready and serving, else 0.", ["worker"],
            registry=r,
        )
        self.preemptions = Counter(
            "tetri_preemptions", "Requests preempted (KV dropped, recomputed later).", registry=r
        )
        self.worker_busy = Counter(
            "tetri_worker_busy_seconds",
            "Seconds each worker spent executing model steps, by the role it had.",
            ["worker", "role"],
            registry=r,
        )
        self.prefill_chunk_size = Gauge(
            "tetri_prefill_chunk_size",
            "Tokens per prefill forward pass (the calibrated knee) of each prefill worker.",
            ["worker"],
            registry=r,
        )
        self.ttft = Histogram(
            "tetri_time_to_first_token_seconds",
            "Arrival to the first generated token.",
            buckets=TTFT_BUCKETS_S,
            registry=r,
        )
        self.tpot = Histogram(
            "tetri_time_per_output_token_seconds",
            "Per request: (last token - first token) / (output tokens - 1).",
            buckets=TPOT_BUCKETS_S,
            registry=r,
        )
        self.e2e = Histogram(
            "tetri_e2e_request_latency_seconds",
            "Arrival to the last token of requests that finished (stop or length).",
            buckets=E2E_BUCKETS_S,
            registry=r,
        )
        self.requests = Counter(
            "tetri_requests", "Requests ended, by finish reason.", ["finish_reason"], registry=r
        )
        self.request_errors = Counter(
            "tetri_request_errors",
            "Requests answered with an error, by kind.",
            ["kind"],
            registry=r,
        )
        self.phase = Histogram(
            "tetri_request_phase_seconds",
            "Disaggregated phases per request: prefill (arrival to the Handoff: queue, chunks, "
            "dispatch hold) and handoff (Handoff forwarded to KVPulled: the KV copy).",
            ["phase"],
            buckets=TTFT_BUCKETS_S,
            registry=r,
        )
        self._workers: dict[str, _WorkerTotals] = {}

    # ------------------------------------------------------------------ backend side

    def set_requests(self, *, running: int, waiting: int) -> None:
        """Current requests running (in a worker batch) and waiting (queued anywhere)."""
        self.requests_running.set(running)
        self.requests_waiting.set(waiting)

    def set_worker(
        self,
        worker: int | str,
        role: str,
        *,
        blocks_used: int,
        blocks_total: int,
        busy_s: float,
        num_preemptions: int = 0,
    ) -> None:
        """One worker's load report: KV usage now, and its *cumulative* busy seconds and
        preemptions since it started (as in ``LoadReport``)."""
        key = str(worker)
        self.kv_blocks_used.labels(key).set(blocks_used)
        self.kv_blocks_total.labels(key).set(blocks_total)
        last = self._workers.setdefault(key, _WorkerTotals())
        self.worker_busy.labels(key, role).inc(_increment(last.busy_s, busy_s))
        self.preemptions.inc(_increment(last.preemptions, num_preemptions))
        last.busy_s, last.preemptions = busy_s, num_preemptions

    def observe_phase(self, phase: str, seconds: float) -> None:
        """One request's time in ``phase`` (``prefill`` or ``handoff``)."""
        self.phase.labels(phase).observe(seconds)

    def set_chunk_size(self, worker: int | str, chunk_size: int) -> None:
        """A prefill worker's chunk size (from its ``Ready``; after calibration)."""
        self.prefill_chunk_size.labels(str(worker)).set(chunk_size)

    def inc_restarts(self, worker: int | str | None = None) -> None:
        """A dead worker was replaced; its next report starts its cumulative totals from 0."""
        self.worker_restarts.inc()
        if worker is not None:
            self._workers.pop(str(worker), None)

    def inc_stalls(self) -> None:
        self.worker_stalls.inc()

    def set_up(self, worker: int | str, up: bool) -> None:
        self.workers_up.labels(str(worker)).set(1 if up else 0)

    def remove_worker(self, worker: int | str) -> None:
        """Drop a worker's gauges (it is gone for good); its counters keep their totals."""
        key = str(worker)
        for gauge in (self.kv_blocks_used, self.kv_blocks_total, self.prefill_chunk_size):
            try:
                gauge.remove(key)
            except KeyError:  # the worker never reported this gauge
                continue
        self._workers.pop(key, None)

    # ------------------------------------------------------------------ API side

    def observe_first_token(self, ttft_s: float) -> None:
        self.ttft.observe(ttft_s)

    def observe_finished(
        self, finish_reason: str, *, e2e_s: float | None = None, tpot_s: float | None = None
    ) -> None:
        """A request ended: ``stop``/``length`` (with latencies) or ``abort`` (client left)."""
        self.requests.labels(finish_reason).inc()
        if e2e_s is not None:
            self.e2e.observe(e2e_s)
        if tpot_s is not None:
            self.tpot.observe(tpot_s)

    def inc_error(self, kind: str) -> None:
        """A request answered with an error (``invalid_parameter``, ``timeout``, ...)."""
        self.request_errors.labels(kind).inc()

    def render(self) -> bytes:
        """The Prometheus text exposition of every metric."""
        return generate_latest(self.registry)
