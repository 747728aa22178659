"""``Metrics``: own registry, Prometheus text that parses, counters that never go down."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from tetri_server.bench.prom import parse_busy_seconds
from tetri_server.metrics import Metrics


def _samples(m: Metrics) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample by (name, labels without model_name); each tetri_ sample must carry
    ``model_name`` = the Metrics' model name."""
    text = m.render().decode()
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            labels = dict(s.labels)
            if s.name.startswith("tetri_"):
                assert labels.pop("model_name") == m.model_name, s
            out[(s.name, tuple(sorted(labels.items())))] = s.value
    return out


def test_two_servers_do_not_share_metrics() -> None:
    a, b = Metrics(), Metrics()
    a.inc_restarts()
    assert _samples(a)[("tetri_worker_restarts_total", ())] == 1
    assert _samples(b)[("tetri_worker_restarts_total", ())] == 0


def test_busy_seconds_from_cumulative_reports_survive_restarts_and_flips() -> None:
    m = Metrics()
    m.set_worker(0, "prefill", blocks_used=3, blocks_total=10, busy_s=5.0, num_preemptions=1)
    m.set_worker(0, "prefill", blocks_used=0, blocks_total=10, busy_s=8.0, num_preemptions=2)
    m.inc_restarts(0)
    m.set_worker(0, "prefill", blocks_used=0, blocks_total=10, busy_s=2.0)  # new process
    m.set_worker(0, "decode", blocks_used=4, blocks_total=10, busy_s=3.5)  # flipped
    s = _samples(m)
    assert s[("tetri_worker_busy_seconds_total", (("role", "prefill"), ("worker", "0")))] == 10
    assert s[("tetri_worker_busy_seconds_total", (("role", "decode"), ("worker", "0")))] == 1.5
    assert s[("tetri_preemptions_total", ())] == 2
    assert s[("tetri_kv_blocks_used", (("worker", "0"),))] == 4
    assert s[("tetri_worker_restarts_total", ())] == 1
    assert parse_busy_seconds(m.render().decode()) == {"0:prefill": 10.0, "0:decode": 1.5}


def test_a_report_that_goes_down_without_a_restart_call_is_treated_as_one() -> None:
    m = Metrics()
    m.set_worker(1, "decode", blocks_used=0, blocks_total=8, busy_s=4.0)
    m.set_worker(1, "decode", blocks_used=0, blocks_total=8, busy_s=1.0)
    assert (
        _samples(m)[("tetri_worker_busy_seconds_total", (("role", "decode"), ("worker", "1")))] == 5
    )


def test_request_latencies_and_outcomes() -> None:
    m = Metrics()
    m.set_requests(running=2, waiting=5)
    m.set_chunk_size(0, 256)
    m.observe_first_token(0.2)
    m.observe_finished("length", e2e_s=1.0, tpot_s=0.05)
    m.observe_finished("abort")
    m.inc_error("timeout")
    s = _samples(m)
    assert s[("tetri_requests_running", ())] == 2 and s[("tetri_requests_waiting", ())] == 5
    assert s[("tetri_time_to_first_token_seconds_count", ())] == 1
    assert s[("tetri_time_per_output_token_seconds_sum", ())] == 0.05
    assert s[("tetri_e2e_request_latency_seconds_count", ())] == 1
    assert s[("tetri_requests_total", (("finish_reason", "abort"),))] == 1
    assert s[("tetri_request_errors_total", (("kind", "timeout"),))] == 1
    assert s[("tetri_prefill_chunk_size", (("worker", "0"),))] == 256
    assert m.content_type.startswith("text/plain")


def test_vllm_names_only_when_asked() -> None:
    on, off = Metrics("m", vllm_aliases=True), Metrics("m")
    for m in (on, off):
        m.observe_first_token(0.1, num_prompt_tokens=12)
        m.observe_finished("stop", e2e_s=0.5, num_prompt_tokens=12, num_output_tokens=3)
        m.set_worker(0, "decode", blocks_used=1, blocks_total=4, busy_s=0.0)
    s = {(x.name, tuple(sorted(x.labels.items()))): x.value
         for fam in text_string_to_metric_families(on.render().decode()) for x in fam.samples}
    label = (("model_name", "m"),)
    assert s[("vllm:prompt_tokens_total", label)] == 12 == s[("tetri_prompt_tokens_total", label)]
    assert s[("vllm:request_success_total", (("finished_reason", "stop"), *label))] == 1
    assert s[("vllm:kv_cache_usage_perc", (("model_name", "m"), ("worker", "0")))] == 0.25
    assert s[("vllm:e2e_request_latency_seconds_count", label)] == 1
    assert "vllm:" not in off.render().decode()
