"""The metrics of a real disaggregated server (1 prefill + 1 decode worker, tiny model) after a
few requests: the numbers a dashboard shows are the requests' own, and every metric name that
``deploy/grafana.json`` queries is on ``/metrics`` (the dashboard stays honest)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.integration.conftest import STRICT_SPLIT, api_cluster_factory
from tests.unit.test_api_double import MODEL_NAME
from tests.unit.test_api_support import ApiHarness, raw_request, wait_until

pytest_plugins = ["tests.unit.test_api_support"]

DASHBOARD = Path(__file__).resolve().parents[2] / "deploy" / "grafana.json"
METRIC_RE = re.compile(r"\b((?:tetri|process)_[a-z0-9_]+)")
# (prompt token ids, max_tokens): outputs stay in the predictor's bucket 0 (< 200 tokens)
REQUESTS = [([5, 17, 300, 42], 6), ([9] * 30, 12), (list(range(100, 170)), 3),
            ([7, 8, 9, 10, 11], 9), ([400] * 12, 1)]


# strict split: the hand-off count below is exact only if no prompt is prefilled where it decodes
cluster_factory = api_cluster_factory(
    *STRICT_SPLIT, "cluster.mode=disaggregated", "predictor.kind=none", "decode.policy=greedy",
    "prefill.chunk_size=64", "kv.num_blocks=200", "monitor.interval_ms=50",
    "server.request_timeout_s=60", "server.drain_timeout_s=5",
    f"model.served_name={MODEL_NAME}")


@pytest.fixture(scope="module")
def api(model_dir):
    harness = ApiHarness(cluster_factory, model_dir("llama", "tiny"))
    yield harness
    harness.close()


def _samples(api: ApiHarness) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    text = raw_request(api.base_url, "GET", "/metrics").body.decode()
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            labels = dict(s.labels)
            if s.name.startswith("tetri_"):
                assert labels.pop("model_name") == MODEL_NAME, s
            out[(s.name, tuple(sorted(labels.items())))] = s.value
    return out


def _send(api: ApiHarness, requests: list[tuple[list[int], int]]) -> None:
    client = openai.OpenAI(base_url=api.base_url + "/v1", api_key="unused", max_retries=0)
    for i, (prompt, n) in enumerate(requests):
        kwargs = dict(model=MODEL_NAME, prompt=prompt, max_tokens=n, temperature=0,
                      extra_body={"ignore_eos": True})
        if i % 2:
            chunks = list(client.completions.create(**kwargs, stream=True))
            assert chunks[-1].choices[0].finish_reason == "length"
        else:
            assert client.completions.create(**kwargs).usage.completion_tokens == n


def test_after_n_requests_the_counters_are_the_requests_own(api: ApiHarness) -> None:
    _send(api, REQUESTS)
    s = _samples(api)
    num, prompt_total = len(REQUESTS), sum(len(p) for p, _ in REQUESTS)
    output_total = sum(n for _, n in REQUESTS)
    assert s[("tetri_prompt_tokens_total", ())] == prompt_total
    assert s[("tetri_generation_tokens_total", ())] == output_total
    assert s[("tetri_request_prompt_tokens_sum", ())] == prompt_total
    assert s[("tetri_request_generation_tokens_sum", ())] == output_total
    # every token after a request's first has one gap
    assert s[("tetri_inter_token_latency_seconds_count", ())] == output_total - num
    assert s[("tetri_request_success_total", (("finished_reason", "length"),))] == num
    for name in ("tetri_time_to_first_token_seconds", "tetri_e2e_request_latency_seconds",
                 "tetri_request_queue_prefill_time_seconds", "tetri_request_decode_time_seconds",
                 "tetri_request_queue_time_seconds", "tetri_request_prefill_time_seconds"):
        assert s[(f"{name}_count", ())] == num, name
    assert (s[("tetri_request_queue_time_seconds_sum", ())]
            + s[("tetri_request_prefill_time_seconds_sum", ())]
            == pytest.approx(s[("tetri_request_queue_prefill_time_seconds_sum", ())]))
    # a request of max_tokens 1 finishes on the prefill worker: no hand-off
    handed_off = sum(n > 1 for _, n in REQUESTS)
    assert handed_off < num
    assert s[("tetri_request_phase_seconds_count", (("phase", "handoff"),))] == handed_off
    assert s[("tetri_handoff_bytes_total", ())] > 0
    # predictor.kind = none says bucket 0, and every output is shorter than one bucket; the
    # bucket rides on the first delta, so the requests that never hand off count too
    assert s[("tetri_predictor_outcomes_total",
              (("finished_reason", "length"), ("outcome", "exact")))] == num
    roles = {(w, r) for (name, labels), v in s.items() if name == "tetri_worker_role" and v == 1
             for w, r in [(dict(labels)["worker"], dict(labels)["role"])]}
    assert roles == {("0", "prefill"), ("1", "decode")}
    usage = {dict(k)["worker"]: v for (name, k), v in s.items()
             if name == "tetri_kv_cache_usage_perc"}
    assert set(usage) == {"0", "1"} and all(0.0 <= u <= 1.0 for u in usage.values())
    assert wait_until(lambda: _samples(api)[("tetri_num_requests_running", ())] == 0, 20)


def test_a_request_ended_by_a_stop_string_is_in_every_request_metric(api: ApiHarness) -> None:
    """Regression: a stop string ends a request by aborting it on its workers; it was counted
    in the API's histograms (e2e, TTFT) but in none of control's (queue, prefill, decode time,
    the predictor's outcomes), so their counts fell behind vLLM's e2e count."""
    client = openai.OpenAI(base_url=api.base_url + "/v1", api_key="unused", max_retries=0)
    kwargs = dict(model=MODEL_NAME, prompt=[5, 17, 300, 42, 9], max_tokens=20, temperature=0,
                  extra_body={"ignore_eos": True})
    text = client.completions.create(**kwargs).choices[0].text
    stop = text[len(text) // 2:len(text) // 2 + 2]
    assert stop.strip(), text
    names = ("tetri_e2e_request_latency_seconds_count", "tetri_request_decode_time_seconds_count",
             "tetri_request_queue_time_seconds_count", "tetri_request_prefill_time_seconds_count")
    before = _samples(api)
    out = client.completions.create(**kwargs, stop=[stop]).choices[0]
    assert out.finish_reason == "stop" and len(out.text) < len(text)
    after = _samples(api)
    assert [after[(n, ())] - before[(n, ())] for n in names] == [1] * len(names)
    outcomes = [(k, v) for k, v in after.items() if k[0] == "tetri_predictor_outcomes_total"
                and dict(k[1])["finished_reason"] == "stop"]
    assert sum(v for _, v in outcomes) - sum(before.get(k, 0) for k, _ in outcomes) == 1


def test_every_metric_the_dashboard_queries_is_exported(api: ApiHarness) -> None:
    _send(api, REQUESTS[:2])
    # worker busy seconds come with the load reports (every monitor.interval_ms)
    assert wait_until(lambda: any(n == "tetri_worker_busy_seconds_total"
                                  for n, _ in _samples(api)), 20)
    exported = {name for name, _ in _samples(api)}
    dashboard = json.loads(DASHBOARD.read_text())
    queried = {m for p in dashboard["panels"] for t in p.get("targets", [])
               for m in METRIC_RE.findall(t["expr"])}
    assert len(queried) > 20
    assert sorted(queried - exported) == []
