"""The load generator against a small real aiohttp server that streams OpenAI-format chunks.

The fixture server's behaviour is chosen by the prompt text: "ok" streams ``max_tokens`` chunks
``TOKEN_GAP_S`` apart (the first after ``FIRST_TOKEN_S``), then a usage chunk and [DONE], with
events split across and packed into TCP writes; other prompts fail in the ways servers fail.
"""

from __future__ import annotations

import asyncio
import io
import json
from collections.abc import AsyncIterator

import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from tetri_server.bench.client import ClientConfig, RequestRecord, _on_event, run_benchmark
from tetri_server.bench.progress import Progress
from tetri_server.bench.sse import SSEEvent, SSEParser
from tetri_server.bench.workload import BenchRequest

STATE = web.AppKey("state", dict)
FIRST_TOKEN_S = 0.15
TOKEN_GAP_S = 0.05


def _chunk(obj: object) -> bytes:
    return f"data: {json.dumps(obj)}\n\n".encode()


def _token(i: int, finish: str | None = None) -> dict[str, object]:
    return {
        "object": "text_completion",
        "choices": [{"index": 0, "text": f"t{i}", "finish_reason": finish}],
    }


async def completions(request: web.Request) -> web.StreamResponse:
    body = await request.json()
    state = request.app[STATE]
    state["bodies"].append(body)
    state["running"] += 1
    state["peak"] = max(state["peak"], state["running"])
    try:
        prompt, n = body["prompt"], body["max_tokens"]
        if prompt == "short":  # stops early (an abort, or ignore_eos not honoured), HTTP 200
            n = 2
        if prompt == "http-500":
            return web.json_response({"error": {"message": "boom"}}, status=500)
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await asyncio.sleep(FIRST_TOKEN_S)
        for i in range(n):
            if i:
                await asyncio.sleep(TOKEN_GAP_S)
            if prompt == "error-event" and i == 2:
                await resp.write(_chunk({"error": {"message": "worker died", "code": 500}}))
                break
            piece = _chunk(_token(i, "length" if i == n - 1 else None))
            if i == 1:  # one event split over two writes
                await resp.write(piece[:7])
                await asyncio.sleep(0.01)
                await resp.write(piece[7:])
            else:
                await resp.write(piece)
        if prompt == "stall":
            await asyncio.sleep(5.0)
        if prompt == "no-done":
            return resp
        usage = {"prompt_tokens": 3, "completion_tokens": n, "total_tokens": n + 3}
        # the usage chunk and [DONE] packed into one write; a keep-alive comment first
        await resp.write(
            b": ping\n\n" + _chunk({"choices": [], "usage": usage}) + b"data: [DONE]\n\n"
        )
        return resp
    finally:
        state["running"] -= 1


@pytest.fixture
async def server() -> AsyncIterator[tuple[str, dict[str, object]]]:
    app = web.Application()
    app[STATE] = {"bodies": [], "running": 0, "peak": 0}
    app.router.add_post("/v1/completions", completions)
    srv = TestServer(app, host="127.0.0.1")
    await srv.start_server()
    try:
        yield f"http://127.0.0.1:{srv.port}", app[STATE]
    finally:
        await srv.close()


def _req(i: int, prompt: str, n: int = 4, arrival_s: float = 0.0) -> BenchRequest:
    return BenchRequest(i, prompt, 3, n, arrival_s, "LPLD", "test")


async def test_streamed_tokens_are_timed(server: tuple[str, dict[str, object]]) -> None:
    url, state = server
    cfg = ClientConfig(url, "m", progress=False)
    run = await run_benchmark([_req(0, "ok", 5), _req(1, "ok", 1, arrival_s=0.2)], cfg, False)
    a, b = run.records
    assert a.ok and b.ok, (a.error, b.error)
    assert len(a.token_times_s) == 5 and a.num_output_tokens == 5 and a.num_prompt_tokens == 3
    assert a.send_s is not None and a.first_token_s is not None and a.end_s is not None
    assert a.first_token_s - a.send_s >= FIRST_TOKEN_S
    gaps = [y - x for x, y in zip(a.token_times_s, a.token_times_s[1:], strict=False)]
    # a busy client may read two tokens at once: their mean gap is the server's
    assert sum(gaps) / len(gaps) >= TOKEN_GAP_S * 0.8 and all(g < 1.0 for g in gaps)
    assert a.end_s >= a.token_times_s[-1]
    # sent at its arrival time, while the first still streams (open loop)
    assert b.send_s is not None and 0.19 <= b.send_s < a.end_s
    assert run.duration_s == pytest.approx(max(a.end_s, b.end_s or 0.0))
    body = state["bodies"][0]  # type: ignore[index]
    assert body["max_tokens"] == 5 and body["ignore_eos"] is True and body["stream"] is True
    assert body["stream_options"] == {"include_usage": True} and body["model"] == "m"


async def test_failures_are_errors_not_hangs(server: tuple[str, dict[str, object]]) -> None:
    url, _ = server
    cfg = ClientConfig(url, "m", read_timeout_s=1.0, progress=False)
    prompts = ["http-500", "error-event", "no-done", "stall", "short"]
    run = await run_benchmark([_req(i, p) for i, p in enumerate(prompts)], cfg, False)
    errors = {p: r.error for p, r in zip(prompts, run.records, strict=True)}
    assert errors["http-500"] is not None and errors["http-500"].startswith("HTTP 500")
    assert errors["error-event"] == "stream error: worker died"
    assert errors["no-done"] == "stream ended without [DONE]"
    assert errors["stall"] is not None  # silent for 5 s > read timeout of 1 s
    # regression: a complete-looking stream of 2 of the 4 tokens asked for was a fast success
    assert errors["short"] == "short reply: 2 of 4 tokens"
    assert all(not r.ok and r.end_s is not None for r in run.records)
    assert run.records[3].end_s < 4.5  # type: ignore[operator]  # before the 5 s stall ends


async def test_concurrency_cap_delays_sends(server: tuple[str, dict[str, object]]) -> None:
    url, state = server
    cfg = ClientConfig(url, "m", max_concurrency=2, progress=False)
    run = await run_benchmark([_req(i, "ok", 2) for i in range(6)], cfg, False)
    assert all(r.ok for r in run.records) and state["peak"] == 2
    waits = sorted((r.send_s or 0.0) - r.arrival_s for r in run.records)
    assert waits[-1] >= 2 * FIRST_TOKEN_S  # the last pair waited for two earlier pairs


async def test_requests_waiting_for_the_cap_are_not_cut_by_the_run_deadline(
    server: tuple[str, dict[str, object]], monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Regression (review of session 64): the run's deadline was the last arrival plus one
    request's timeout, whatever the concurrency cap: six requests sent at once one at a time
    (as calibration and warm-up send theirs), each well inside its own timeout, lost the last
    ones to the deadline as failures (never-sent ones with no error at all)."""
    import tetri_server.bench.client as client

    monkeypatch.setattr(client, "RUN_DEADLINE_MARGIN_S", 0.0)
    url, _ = server
    cfg = ClientConfig(url, "m", max_concurrency=1, request_timeout_s=0.6, progress=False)
    run = await run_benchmark([_req(i, "ok", 2) for i in range(6)], cfg, False)  # 0.2 s each
    assert [r.error for r in run.records] == [None] * 6


def test_sse_parser_handles_any_split() -> None:
    stream = (
        b'data: {"a": 1}\r\n\r\n: comment\n\nevent: error\ndata: x\ndata: y\n\ndata: [DONE]\n\n'
    )
    want = [SSEEvent('{"a": 1}'), SSEEvent("x\ny", "error"), SSEEvent("[DONE]")]
    for size in (1, 2, 5, len(stream)):
        parser = SSEParser()
        got = [e for i in range(0, len(stream), size) for e in parser.feed(stream[i : i + size])]
        assert got == want
    parser = SSEParser()
    assert parser.feed(b"data: tail") == [] and parser.close() == [SSEEvent("tail")]


def test_progress_bar_text() -> None:
    out = io.StringIO()
    bar = Progress(4, stream=out, label="coupled/LPLD")
    for ok in (True, False, True, True):
        bar.update(ok)
    bar.close()
    lines = out.getvalue().splitlines()
    assert lines[0].startswith("coupled/LPLD 1/4 [") and "25%" in lines[0]
    assert lines[-1].startswith("coupled/LPLD 4/4 [" + "=" * 30 + "] 100% errors 1")


def test_a_one_token_reply_in_one_terminal_chunk_without_text_is_its_token() -> None:
    """Regression (review of session 64): max_tokens 1 streams one chunk with the token and
    its finish_reason; a token whose text is held back (part of a character, a skipped special
    token) has no text there, and the request counted as failed ("no tokens") though usage
    said 1, as ``vllm bench serve`` would not."""
    rec = RequestRecord(0, "HPLD", 3, 1, 0.0, send_s=0.0)
    for t, ev in enumerate([{"choices": [{"index": 0, "text": "", "finish_reason": "length"}]},
                            {"choices": [], "usage": {"prompt_tokens": 3,
                                                      "completion_tokens": 1}}]):
        assert _on_event(SSEEvent(json.dumps(ev)), rec, float(t)) is False
    assert _on_event(SSEEvent("[DONE]"), rec, 9.0) is True
    assert rec.token_times_s == [0.0] and rec.first_token_s == 0.0 and rec.error is None


def test_a_last_token_without_text_is_a_token_and_its_gap_counts() -> None:
    """Regression (review of session 64): a terminal chunk without text was never counted
    after the first token, so a reply whose last token's text was empty (a trailing U+FFFD
    held back, a skipped special token) lost its last inter-token gap; vLLM's bench counts
    every chunk. Usage (3 tokens) says all three chunks were tokens."""
    rec = RequestRecord(0, "LPLD", 3, 3, 0.0, send_s=0.0)
    events = [_token(0), _token(1),
              {"choices": [{"index": 0, "text": "", "finish_reason": "length"}]},
              {"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 3}}]
    for t, ev in enumerate(events):
        assert _on_event(SSEEvent(json.dumps(ev)), rec, float(t)) is False
    assert _on_event(SSEEvent("[DONE]"), rec, 9.0) is True
    assert rec.token_times_s == [0.0, 1.0, 2.0]


def test_a_finish_chunk_of_its_own_is_not_a_token() -> None:
    """A server that sends its finish_reason in a chunk without a token: the usage (2 tokens)
    says the last chunk carried none."""
    rec = RequestRecord(0, "LPLD", 3, 2, 0.0, send_s=0.0)
    events = [
        _token(0),
        {"choices": [{"index": 0, "text": "", "finish_reason": None}]},  # held-back UTF-8
        {"choices": [{"index": 0, "text": "", "finish_reason": "length"}]},
        {"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 2}},
    ]
    for t, ev in enumerate(events):
        assert _on_event(SSEEvent(json.dumps(ev)), rec, float(t)) is False
    assert _on_event(SSEEvent("[DONE]"), rec, 9.0) is True
    assert rec.token_times_s == [0.0, 1.0] and rec.first_token_s == 0.0
    assert (rec.num_output_tokens, rec.num_prompt_tokens, rec.error) == (2, 3, None)
    _on_event(SSEEvent("[1, 2]"), rec, 10.0)
    assert rec.error is not None and rec.error.startswith("unexpected chunk")


async def test_true_output_len_is_sent_only_when_asked(
    server: tuple[str, dict[str, object]],
) -> None:
    url, state = server
    plain = ClientConfig(url, "m", progress=False)
    oracle = ClientConfig(url, "m", progress=False, send_true_output_len=True)
    await run_benchmark([_req(0, "ok", 3)], plain, False)
    await run_benchmark([_req(1, "ok", 2)], oracle, False)
    first, second = state["bodies"]  # type: ignore[misc]
    assert "true_output_len" not in first and second["true_output_len"] == 2


async def test_a_hidden_length_needs_continuous_usage_and_says_so(
    server: tuple[str, dict[str, object]],
) -> None:
    """This fixture server sends usage only at the end: with --hide-output-len the client
    could not count tokens and would read the whole context; it stops with a clear error."""
    url, state = server
    cfg = ClientConfig(url, "m", progress=False, hidden_len_context=50)
    run = await run_benchmark([_req(0, "ok", 3)], cfg, False)
    [rec] = run.records
    assert rec.error is not None and "continuous_usage_stats" in rec.error
    [body] = state["bodies"]  # type: ignore[misc]
    assert body["max_tokens"] == 47 and body["stream_options"]["continuous_usage_stats"]
