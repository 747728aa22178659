"""Prometheus metrics of one server, in a registry the ``Metrics`` object owns (no globals).

Every metric carries a ``model_name`` label (the served name), so dashboards built for vLLM
(which filter on ``{model_name="$model_name"}``) work with the ``vllm:`` prefix changed to
``tetri_``: token counters, prompt/generation length histograms, TTFT, inter-token latency,
per-request TPOT, e2e latency, decode time, success by ``finished_reason``, running/waiting
requests and ``kv_cache_usage_perc``; the standard ``process_*``/``python_*`` collectors are
registered too. Older tetri names (``tetri_requests_total{finish_reason}``,
``tetri_requests_running``, ``tetri_time_per_output_token_seconds``, ...) are kept beside their
vLLM-shaped twins. Queue time (arrival -> first chunk scheduled) and prefill time (-> first
token) split at the time stamp the prefilling worker sends with a request's first delta;
``tetri_request_queue_prefill_time_seconds`` is their sum. TetriInfer's own: phases, flips and
roles, hand-off bytes, predictor outcomes (predicted vs actual length bucket).

Who writes what:
    backend (control process)  ``set_requests``, ``set_worker``, ``set_chunk_size``,
                               ``inc_restarts``, ``inc_stalls``, ``set_up``, ``set_role``,
                               ``observe_phase``, ``observe_handoff_bytes``, ``observe_flip``,
                               ``observe_request_times``, ``observe_prediction``
    API layer                  ``observe_first_token``, ``observe_tokens``, ``observe_finished``,
                               ``inc_error``
    GET /metrics               ``render``

Workers report *cumulative* busy seconds and preemptions (``LoadReport``); ``set_worker`` turns
them into increments of true Prometheus counters, so the exported counters never go down even
when a worker restarts (its report starts again from 0) or flips role (increments go to the
role it reports now).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    GCCollector,
    Histogram,
    PlatformCollector,
    ProcessCollector,
    generate_latest,
)
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector

TTFT_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
TPOT_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5)
ITL_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 1, 2.5)
E2E_BUCKETS_S = (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)
# tokens per request, 1-2-5 steps as vLLM's, up to 1M
LENGTH_BUCKETS = tuple(m * 10**e for e in range(7) for m in (1, 2, 5))
FLIP_BUCKETS_S = (0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
FINISHED_REASONS = ("stop", "length", "abort")
ROLES = ("prefill", "decode", "coupled")
OUTCOMES = ("exact", "under", "over")  # predicted bucket = / < / > the actual one
# APIError codes present at 0 from the start: rate() misses a counter's first increment when
# the series only appears with it
ERROR_KINDS = ("invalid_parameter", "rate_limit_exceeded", "timeout", "request_too_large",
               "service_unavailable", "generation_failed")
MODEL = "model_name"
# exported again as vllm:<suffix> when asked (server.vllm_metric_names)
VLLM_ALIASED = (
    "tetri_num_requests_running", "tetri_num_requests_waiting", "tetri_kv_cache_usage_perc",
    "tetri_prompt_tokens", "tetri_generation_tokens", "tetri_request_prompt_tokens",
    "tetri_request_generation_tokens", "tetri_time_to_first_token_seconds",
    "tetri_inter_token_latency_seconds", "tetri_request_time_per_output_token_seconds",
    "tetri_e2e_request_latency_seconds", "tetri_request_success",
    "tetri_request_decode_time_seconds", "tetri_request_queue_time_seconds",
    "tetri_request_prefill_time_seconds",
)


class _VllmAliases(Collector):
    """The ``VLLM_ALIASED`` families of ``source``, renamed ``tetri_`` -> ``vllm:``."""

    def __init__(self, source: CollectorRegistry) -> None:
        self.source = source

    def collect(self) -> Iterator[Metric]:
        for family in self.source.collect():
            if family.name not in VLLM_ALIASED:
                continue
            alias = Metric("vllm:" + family.name.removeprefix("tetri_"), family.documentation,
                           family.type)
            alias.samples = [s._replace(name="vllm:" + s.name.removeprefix("tetri_"))
                             for s in family.samples]
            yield alias


@dataclass
class _WorkerTotals:
    """Last cumulative values one worker reported (to turn them into increments)."""

    busy_s: float = 0.0
    preemptions: int = 0
    kv_drops: int = 0


def _increment(last: float, now: float) -> float:
    """Counter increment from two cumulative reports; a drop means the reporter restarted."""
    return now - last if now >= last else now


class Metrics:
    """Every ``tetri_*`` metric of one server; ``model_name`` is the label value on all."""

    content_type = CONTENT_TYPE_LATEST

    def __init__(self, model_name: str = "", *, vllm_aliases: bool = False) -> None:
        """``vllm_aliases``: also export the vLLM-shaped metrics under vLLM's own ``vllm:``
        names, for tools that hard-code them (off by default: vLLM renames its metrics between
        releases and reserves colon names for recording rules)."""
        self.model_name = model_name
        r = self.registry = CollectorRegistry()
        self._aliases: CollectorRegistry | None = None
        if vllm_aliases:
            self._aliases = CollectorRegistry()
            self._aliases.register(_VllmAliases(r))
        ProcessCollector(registry=r)
        PlatformCollector(registry=r)
        GCCollector(registry=r)
        m = model_name

        def gauge(name: str, doc: str, *labels: str) -> Gauge:
            return Gauge(name, doc, [MODEL, *labels], registry=r)

        def counter(name: str, doc: str, *labels: str) -> Counter:
            return Counter(name, doc, [MODEL, *labels], registry=r)

        def histogram(name: str, doc: str, buckets: tuple[float, ...], *labels: str) -> Histogram:
            return Histogram(name, doc, [MODEL, *labels], buckets=buckets, registry=r)

        running_doc, waiting_doc = "Requests being prefilled or decoded.", "Requests queued."
        self._running = [gauge("tetri_requests_running", running_doc).labels(m),
                         gauge("tetri_num_requests_running", running_doc).labels(m)]
        self._waiting = [gauge("tetri_requests_waiting", waiting_doc).labels(m),
                         gauge("tetri_num_requests_waiting", waiting_doc).labels(m)]
        self.kv_blocks_used = gauge("tetri_kv_blocks_used", "KV blocks in use.", "worker")
        self.kv_blocks_total = gauge("tetri_kv_blocks_total", "KV blocks in the pool.", "worker")
        self.kv_usage = gauge("tetri_kv_cache_usage_perc",
                              "KV cache usage of each worker, 0 to 1 (1 = full).", "worker")
        self.worker_restarts = counter(
            "tetri_worker_restarts", "Worker processes restarted after dying.").labels(m)
        self.worker_stalls = counter(
            "tetri_worker_stalls",
            "Workers killed because they sent nothing for monitor.stall_timeout_s.").labels(m)
        self.workers_up = gauge("tetri_worker_up",
                                "1 while the worker is ready and serving, else 0.", "worker")
        self.preemptions = counter(
            "tetri_preemptions",
            "Running requests preempted (KV dropped, recomputed later).").labels(m)
        self.kv_drops = counter(
            "tetri_waiting_kv_drops",
            "Requests waiting for admission whose KV was dropped (for the running batch's blocks, "
            "or for the head of the queue when nothing runs; recomputed when admitted; not "
            "preemptions: they were not running).").labels(m)
        self.worker_busy = counter(
            "tetri_worker_busy_seconds",
            "Seconds each worker spent executing model steps, by the role it had.",
            "worker", "role")
        self.prefill_chunk_size = gauge(
            "tetri_prefill_chunk_size",
            "Tokens per prefill forward pass (the calibrated knee) of each prefill worker.",
            "worker")
        self.decode_step = gauge(
            "tetri_decode_step_seconds",
            "Each decode worker's recent decode step (an average; 0 = idle): its requests' "
            "inter-token gap. With prefill.local_decode_balance a prefill worker keeps a "
            "request only where its gap would be shorter.", "worker")
        self.ttft = histogram("tetri_time_to_first_token_seconds",
                              "Arrival to the first generated token.", TTFT_BUCKETS_S).labels(m)
        tpot_doc = "Per request: (last token - first token) / (output tokens - 1)."
        self._tpot = [
            histogram("tetri_time_per_output_token_seconds", tpot_doc, TPOT_BUCKETS_S).labels(m),
            histogram("tetri_request_time_per_output_token_seconds", tpot_doc,
                      TPOT_BUCKETS_S).labels(m),
        ]
        self.itl = histogram("tetri_inter_token_latency_seconds",
                             "Time between consecutive output tokens (a delta of k tokens "
                             "counts k gaps of 1/k its wait).", ITL_BUCKETS_S).labels(m)
        self.e2e = histogram(
            "tetri_e2e_request_latency_seconds",
            "Arrival to the last token of requests that finished (stop or length).",
            E2E_BUCKETS_S).labels(m)
        self.prompt_tokens = counter("tetri_prompt_tokens",
                                     "Prompt tokens prefilled (counted at the first token).")
        self.generation_tokens = counter("tetri_generation_tokens", "Output tokens generated.")
        self.request_prompt_tokens = histogram(
            "tetri_request_prompt_tokens", "Prompt length of finished requests.",
            LENGTH_BUCKETS).labels(m)
        self.request_generation_tokens = histogram(
            "tetri_request_generation_tokens", "Output length of finished requests.",
            LENGTH_BUCKETS).labels(m)
        self.requests = counter("tetri_requests", "Requests ended, by finish reason.",
                                "finish_reason")
        self.request_success = counter(
            "tetri_request_success", "Requests ended, by finished_reason (vLLM's name).",
            "finished_reason")
        for reason in FINISHED_REASONS:  # present at 0, so rate() works from the first scrape
            self.request_success.labels(m, reason)
        self.prompt_tokens.labels(m)
        self.generation_tokens.labels(m)
        self.request_errors = counter("tetri_request_errors",
                                      "Requests answered with an error, by kind.", "kind")
        for kind in ERROR_KINDS:
            self.request_errors.labels(m, kind)
        self.phase = histogram(
            "tetri_request_phase_seconds",
            "Disaggregated phases per request: prefill (arrival to the Handoff: queue, chunks, "
            "dispatch hold) and handoff (Handoff forwarded to KVPulled: the KV copy).",
            TTFT_BUCKETS_S, "phase")
        self._add_control_metrics(gauge, counter, histogram)
        self._workers: dict[str, _WorkerTotals] = {}

    def _add_control_metrics(self, gauge: Any, counter: Any, histogram: Any) -> None:
        """What only the control process sees: request times, flips, hand-offs, predictions."""
        m = self.model_name
        self.queue_prefill = histogram(
            "tetri_request_queue_prefill_time_seconds",
            "Arrival at the control process to the first token: queue + prefill.",
            TTFT_BUCKETS_S).labels(m)
        self.queue_time = histogram(
            "tetri_request_queue_time_seconds",
            "Arrival at the control process to the first prompt chunk scheduled on a worker.",
            TTFT_BUCKETS_S).labels(m)
        self.prefill_time = histogram(
            "tetri_request_prefill_time_seconds",
            "First prompt chunk scheduled to the first token at the control process.",
            TTFT_BUCKETS_S).labels(m)
        self.decode_time = histogram(
            "tetri_request_decode_time_seconds",
            "First token to last token of requests that finished (stop or length).",
            E2E_BUCKETS_S).labels(m)
        self.worker_role = gauge("tetri_worker_role",
                                 "1 for the role each worker has now, 0 for the others.",
                                 "worker", "role")
        self.flips = counter("tetri_flips", "Instance flips completed.", "from_role", "to_role")
        self.flip_seconds = histogram(
            "tetri_flip_seconds",
            "Flip durations: total (decision to serving in the new role) and switch (drained to "
            "serving).", FLIP_BUCKETS_S, "part")
        for a, b in (("prefill", "decode"), ("decode", "prefill")):
            self.flips.labels(m, a, b)  # present at 0, so rate() works before the first flip
        for part in ("total", "switch"):
            self.flip_seconds.labels(m, part)
        self.handoff_bytes = counter(
            "tetri_handoff_bytes",
            "KV bytes handed from prefill to decode workers (whole blocks, as copied).").labels(m)
        self.predictor_outcomes = counter(
            "tetri_predictor_outcomes",
            "Finished requests by predicted vs actual output-length bucket: exact, under "
            "(predicted < actual), over; for finished_reason=length the actual length is a cap.",
            "outcome", "finished_reason")
        for outcome in OUTCOMES:
            for reason in ("stop", "length"):
                self.predictor_outcomes.labels(m, outcome, reason)
        self.predictor_buckets = counter(
            "tetri_predictor_buckets",
            "Finished requests by predicted and actual output-length bucket.",
            "predicted_bucket", "actual_bucket", "finished_reason")

    # ------------------------------------------------------------------ backend side

    def set_requests(self, *, running: int, waiting: int) -> None:
        """Current requests running (in a worker batch) and waiting (queued anywhere)."""
        for g in self._running:
            g.set(running)
        for g in self._waiting:
            g.set(waiting)

    def set_worker(
        self,
        worker: int | str,
        role: str,
        *,
        blocks_used: int,
        blocks_total: int,
        busy_s: float,
        num_preemptions: int = 0,
        num_kv_drops: int = 0,
        step_s: float | None = None,
    ) -> None:
        """One worker's load report: KV usage now, and its *cumulative* busy seconds,
        preemptions and waiting requests' KV drops since it started (as in ``LoadReport``); a
        decode worker's ``step_s``."""
        key, m = str(worker), self.model_name
        if step_s is not None:
            self.decode_step.labels(m, key).set(step_s)
        self.kv_blocks_used.labels(m, key).set(blocks_used)
        self.kv_blocks_total.labels(m, key).set(blocks_total)
        self.kv_usage.labels(m, key).set(blocks_used / blocks_total if blocks_total else 0.0)
        last = self._workers.setdefault(key, _WorkerTotals())
        self.worker_busy.labels(m, key, role).inc(_increment(last.busy_s, busy_s))
        self.preemptions.inc(_increment(last.preemptions, num_preemptions))
        self.kv_drops.inc(_increment(last.kv_drops, num_kv_drops))
        last.busy_s, last.preemptions, last.kv_drops = busy_s, num_preemptions, num_kv_drops

    def observe_phase(self, phase: str, seconds: float) -> None:
        """One request's time in ``phase`` (``prefill`` or ``handoff``)."""
        self.phase.labels(self.model_name, phase).observe(seconds)

    def set_role(self, worker: int | str, role: str) -> None:
        """The worker's role now (at start-up, a restart, a flip); the gauges of a role it no
        longer has (a decode worker's step, a prefill worker's chunk) drop its series."""
        key, m = str(worker), self.model_name
        for r in ROLES:
            self.worker_role.labels(m, key, r).set(1 if r == role else 0)
        for gauge, kept_by in ((self.decode_step, "decode"), (self.prefill_chunk_size, "prefill")):
            if role != kept_by:
                with contextlib.suppress(KeyError):  # never set for this worker
                    gauge.remove(m, key)

    def observe_flip(self, from_role: str, to_role: str, *, total_s: float,
                     switch_s: float) -> None:
        """A flip completed (``FlipResult``)."""
        m = self.model_name
        self.flips.labels(m, from_role, to_role).inc()
        self.flip_seconds.labels(m, "total").observe(total_s)
        self.flip_seconds.labels(m, "switch").observe(switch_s)

    def observe_handoff_bytes(self, num_bytes: int) -> None:
        """One request's KV handed to a decode worker."""
        self.handoff_bytes.inc(num_bytes)

    def observe_request_times(self, *, queue_prefill_s: float, decode_s: float,
                              queue_s: float | None = None) -> None:
        """A request finished (stop or length): arrival -> first token, first -> last token,
        and, when its worker stamped it, arrival -> first chunk scheduled (the rest of
        ``queue_prefill_s`` is prefill time)."""
        self.queue_prefill.observe(queue_prefill_s)
        self.decode_time.observe(decode_s)
        if queue_s is not None:
            queue_s = min(max(0.0, queue_s), queue_prefill_s)
            self.queue_time.observe(queue_s)
            self.prefill_time.observe(queue_prefill_s - queue_s)

    def observe_prediction(self, predicted_bucket: int, actual_bucket: int,
                           finish_reason: str) -> None:
        """A finished request's predicted output-length bucket against its actual one."""
        m = self.model_name
        outcome = ("exact" if predicted_bucket == actual_bucket
                   else "under" if predicted_bucket < actual_bucket else "over")
        self.predictor_outcomes.labels(m, outcome, finish_reason).inc()
        self.predictor_buckets.labels(m, str(predicted_bucket), str(actual_bucket),
                                      finish_reason).inc()

    def set_chunk_size(self, worker: int | str, chunk_size: int) -> None:
        """A prefill worker's chunk size (from its ``Ready``; after calibration)."""
        self.prefill_chunk_size.labels(self.model_name, str(worker)).set(chunk_size)

    def inc_restarts(self, worker: int | str | None = None) -> None:
        """A dead worker was replaced; its next report starts its cumulative totals from 0."""
        self.worker_restarts.inc()
        if worker is not None:
            self._workers.pop(str(worker), None)

    def inc_stalls(self) -> None:
        self.worker_stalls.inc()

    def set_up(self, worker: int | str, up: bool) -> None:
        """A worker is up or gone. A gone worker's pool is gone: its KV gauges read 0 and its
        recent decode step is dropped (they showed its last report until a restart reported,
        forever without one)."""
        key, m = str(worker), self.model_name
        self.workers_up.labels(m, key).set(1 if up else 0)
        if not up:
            self.kv_blocks_used.labels(m, key).set(0)
            self.kv_usage.labels(m, key).set(0.0)
            with contextlib.suppress(KeyError):  # never set for this worker
                self.decode_step.remove(m, key)

    # ------------------------------------------------------------------ API side

    def observe_first_token(self, ttft_s: float, num_prompt_tokens: int = 0) -> None:
        """The first output token arrived: the prompt is prefilled."""
        self.ttft.observe(ttft_s)
        if num_prompt_tokens:
            self.prompt_tokens.labels(self.model_name).inc(num_prompt_tokens)

    def observe_tokens(self, num_tokens: int, gap_s: float | None) -> None:
        """``num_tokens`` output tokens arrived ``gap_s`` after the previous ones (None: they
        include the first token, whose wait is the TTFT)."""
        self.generation_tokens.labels(self.model_name).inc(num_tokens)
        if gap_s is not None and num_tokens > 0:
            for _ in range(num_tokens):
                self.itl.observe(gap_s / num_tokens)

    def observe_finished(
        self,
        finish_reason: str,
        *,
        e2e_s: float | None = None,
        tpot_s: float | None = None,
        num_prompt_tokens: int | None = None,
        num_output_tokens: int | None = None,
    ) -> None:
        """A request ended: ``stop``/``length`` (with latencies and lengths) or ``abort``."""
        m = self.model_name
        self.requests.labels(m, finish_reason).inc()
        self.request_success.labels(m, finish_reason).inc()
        if e2e_s is not None:
            self.e2e.observe(e2e_s)
        if tpot_s is not None:
            for h in self._tpot:
                h.observe(tpot_s)
        if num_prompt_tokens is not None:
            self.request_prompt_tokens.observe(num_prompt_tokens)
        if num_output_tokens is not None:
            self.request_generation_tokens.observe(num_output_tokens)

    def inc_error(self, kind: str) -> None:
        """A request answered with an error (``invalid_parameter``, ``timeout``, ...)."""
        self.request_errors.labels(self.model_name, kind).inc()

    def render(self) -> bytes:
        """The Prometheus text exposition of every metric."""
        text = generate_latest(self.registry)
        return text if self._aliases is None else text + generate_latest(self._aliases)
