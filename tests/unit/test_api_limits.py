"""Limits and failures: API key, body size, queue limit (429 + Retry-After), request timeout,
failed generations (never a 200), health, drain, and the /metrics page."""

from __future__ import annotations

import asyncio
import socket

import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.unit.test_api_double import MODEL_NAME
from tests.unit.test_api_support import (
    ApiHarness,
    double,
    metric,
    open_stream,
    raw_request,
    read_events,
    slow_generation,
    sse_data,
    wait_until,
)
from tetri_server.api import drain

pytest_plugins = ["tests.unit.test_api_support"]

C = "/v1/completions"
LONG = {"prompt": "Count", "max_tokens": 240, "temperature": 0, "ignore_eos": True}
LONG_EOS = {"ignore_eos": True}


def _client(base_url: str, key: str = "unused") -> openai.OpenAI:
    return openai.OpenAI(base_url=base_url + "/v1", api_key=key, max_retries=0)


def _blocks_free(api: ApiHarness) -> bool:
    return metric(api.base_url, "tetri_kv_blocks_used") == 0


def test_api_key_guards_v1_only(api: ApiHarness) -> None:
    url = api.serve(api_key="s3cret")
    with pytest.raises(openai.AuthenticationError) as e:
        _client(url, "wrong").completions.create(model=MODEL_NAME, prompt="hi", max_tokens=1)
    assert e.value.status_code == 401 and e.value.body["code"] == "invalid_api_key"
    reply = raw_request(url, "GET", "/v1/models")
    assert reply.status == 401 and reply.headers["www-authenticate"] == "Bearer"
    out = _client(url, "s3cret").completions.create(model=MODEL_NAME, prompt="hi", max_tokens=1)
    assert out.usage.completion_tokens == 1
    assert raw_request(url, "GET", "/health").status == 200
    assert raw_request(url, "GET", "/metrics").status == 200


def test_body_size_limit_is_413(api: ApiHarness) -> None:
    url = api.serve(max_body_bytes=2000)
    reply = raw_request(url, "POST", C, {"prompt": "x" * 5000, "max_tokens": 1})
    assert reply.status == 413 and reply.json()["error"]["code"] == "request_too_large"
    assert raw_request(url, "POST", C, {"prompt": "x", "max_tokens": 1}).status == 200


def test_queue_limit_is_429_with_retry_after(api: ApiHarness) -> None:
    url = api.serve(max_queued_requests=1)
    with slow_generation(api):
        sock = open_stream(url, C, {**LONG, "stream": True})
        try:
            assert b"data: " in read_events(sock, until=b"data: ")
            with pytest.raises(openai.RateLimitError) as e:
                _client(url).completions.create(model=MODEL_NAME, prompt="hi", max_tokens=1)
            assert int(e.value.response.headers["retry-after"]) >= 1
        finally:
            sock.close()
    assert wait_until(lambda: _blocks_free(api))
    assert raw_request(url, "POST", C, {"prompt": "x", "max_tokens": 1}).status == 200


def test_backend_queue_full_is_429(api: ApiHarness) -> None:
    backend = double(api)
    backend.queue_full = True
    try:
        reply = raw_request(api.base_url, "POST", C, {"prompt": "x", "max_tokens": 1})
    finally:
        backend.queue_full = False
    assert reply.status == 429 and reply.headers["retry-after"] == "2"
    assert reply.json()["error"]["type"] == "rate_limit_error"


def test_request_timeout_is_an_error_and_aborts(api: ApiHarness) -> None:
    url = api.serve(request_timeout_s=2.0)  # the first streamed token comes well within it
    with slow_generation(api, 0.05):  # 240 tokens take far longer than 2 s
        reply = raw_request(url, "POST", C, LONG)
        assert reply.status == 504 and reply.json()["error"]["code"] == "timeout"
        reply = raw_request(url, "POST", C, {**LONG, "stream": True})
    assert reply.status == 200  # tokens had been sent: the error is an event
    events = sse_data(reply.body)
    assert '"text":' in events[0]
    assert '"code":"timeout"' in events[-1] and "[DONE]" not in events
    assert wait_until(lambda: _blocks_free(api))


def test_failed_generation_is_never_a_200(api: ApiHarness) -> None:
    backend = double(api)
    client = _client(api.base_url)
    messages = [{"role": "user", "content": "hi"}]
    try:
        backend.fail_after = 2
        with pytest.raises(openai.InternalServerError) as e:
            client.completions.create(
                model=MODEL_NAME, prompt="hi", max_tokens=20, extra_body=LONG_EOS
            )
        assert "injected failure" in e.value.body["message"]
        stream = client.chat.completions.create(
            model=MODEL_NAME, messages=messages, max_tokens=20, stream=True, extra_body=LONG_EOS
        )
        with pytest.raises(openai.APIError, match="generation failed"):
            list(stream)  # mid-stream: an error event, no [DONE]
        backend.fail_after = 0
        reply = raw_request(api.base_url, "POST", C, {**LONG, "stream": True})
        assert reply.status == 500  # nothing was sent yet: a real status
        assert reply.json()["error"]["code"] == "generation_failed"
    finally:
        backend.fail_after = None
    assert metric(api.base_url, "tetri_request_errors_total", kind="generation_failed") >= 3


def test_health_follows_backend_readiness(api: ApiHarness) -> None:
    backend = double(api)
    backend.ready = False
    try:
        reply = raw_request(api.base_url, "GET", "/health")
        assert reply.status == 503 and reply.json()["error"]["code"] == "not_ready"
    finally:
        backend.ready = True
    assert raw_request(api.base_url, "GET", "/health").status == 200


def test_drain_refuses_new_and_waits_for_in_flight(api: ApiHarness) -> None:
    url = api.serve()
    with (
        slow_generation(api),
        open_stream(url, C, {**LONG, "max_tokens": 30, "stream": True}) as sock,
    ):
        read_events(sock, until=b"data: ")
        done = asyncio.run_coroutine_threadsafe(drain(api.apps[url], 30), api.loop)
        assert raw_request(url, "POST", C, {"prompt": "x", "max_tokens": 1}).status == 503
        assert raw_request(url, "GET", "/health").status == 503
        assert b"data: [DONE]" in read_events(sock, until=b"data: [DONE]")
        assert done.result(30) is True


def test_drain_waits_for_a_request_still_sending_its_body(api: ApiHarness) -> None:
    """Regression: a request counted as in flight only once its body was read and parsed. A
    drain starting while a client still sent its body found nothing in flight and returned at
    once; the request, accepted, was then cut off with an empty reply."""
    import json as jsonlib

    url = api.serve()
    port = int(url.rsplit(":", 1)[1])
    body = jsonlib.dumps({**LONG, "max_tokens": 20}).encode()
    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
        sock.sendall(f"POST {C} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n"
                     f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n"
                     "Connection: close\r\n\r\n".encode() + body[:10])
        api.run(asyncio.sleep(0.3))  # the handler is reading the body
        done = asyncio.run_coroutine_threadsafe(drain(api.apps[url], 30), api.loop)
        api.run(asyncio.sleep(0.3))
        assert not done.done(), "the drain did not wait for the request being sent"
        sock.sendall(body[10:])
        reply = b""
        while chunk := sock.recv(65536):
            reply += chunk
    assert reply.startswith(b"HTTP/1.1 200") and b'"completion_tokens": 20' in reply, reply[:300]
    assert done.result(30) is True


def test_metrics_page_parses_and_has_every_metric(api: ApiHarness) -> None:
    _client(api.base_url).completions.create(
        model=MODEL_NAME, prompt="hi", max_tokens=3, extra_body=LONG_EOS
    )
    text = raw_request(api.base_url, "GET", "/metrics").body.decode()
    names = {s.name for fam in text_string_to_metric_families(text) for s in fam.samples}
    for want in (
        "tetri_requests_running",
        "tetri_requests_waiting",
        "tetri_kv_blocks_used",
        "tetri_kv_blocks_total",
        "tetri_worker_restarts_total",
        "tetri_time_to_first_token_seconds_count",
        "tetri_time_per_output_token_seconds_count",
        "tetri_e2e_request_latency_seconds_count",
        "tetri_worker_busy_seconds_total",
        "tetri_preemptions_total",
        "tetri_waiting_kv_drops_total",
        "tetri_requests_total",
    ):
        assert want in names, want
    assert metric(api.base_url, "tetri_time_to_first_token_seconds_count") >= 1
    assert metric(api.base_url, "tetri_requests_total", finish_reason="length") >= 1
    assert metric(api.base_url, "tetri_worker_busy_seconds_total", worker="0") > 0


def test_a_body_that_never_arrives_times_out(api: ApiHarness) -> None:
    url = api.serve(body_timeout_s=0.3)
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        sock.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
            b"Content-Type: application/json\r\nContent-Length: 100\r\n\r\n{"
        )
        head = sock.recv(65536)
    assert head.startswith(b"HTTP/1.1 408") and b'"code": "timeout"' in head


def test_an_unexpected_error_mid_stream_is_an_error_event_not_a_cut_stream(
        api: ApiHarness, monkeypatch: pytest.MonkeyPatch) -> None:
    """Regression: an exception other than the API's own (a tokenizer's decode error, a bug)
    after the first chunk ended a 200 stream with no error event and no [DONE]: a client
    could take the cut text for the whole reply."""
    from tetri_server.api.generation import Generation

    on_delta, seen = Generation._on_delta, []

    def flaky(self, delta):  # noqa: ANN001, ANN202
        seen.append(1)
        if len(seen) == 3:
            raise RuntimeError("Invalid prefix encountered")
        return on_delta(self, delta)

    monkeypatch.setattr(Generation, "_on_delta", flaky)
    stream = _client(api.base_url).completions.create(
        model=MODEL_NAME, prompt="hi", max_tokens=40, stream=True, extra_body=LONG_EOS)
    with pytest.raises(openai.APIError, match="internal error"):
        list(stream)
    assert metric(api.base_url, "tetri_request_errors_total", kind="generation_failed") >= 1

