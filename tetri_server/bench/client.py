"""Open-loop load generator for any OpenAI-compatible ``/v1/completions`` (streaming SSE).

Each request is sent at its ``arrival_s`` whether or not earlier ones have finished (open loop);
an optional concurrency cap delays sending, and that delay is recorded (``send_s - arrival_s``).
Times are seconds from the run's start on ``time.perf_counter``. Token arrivals are counted the
way ``vllm bench serve`` counts them: every streamed chunk that carries a choice is one arrival,
except a terminal chunk with no text and a ``finish_reason`` after other arrivals. Every wait is
bounded: connect, silence inside a stream, whole request, whole run (with a concurrency cap,
long enough for every request to wait its turn).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import time
from dataclasses import dataclass, field, fields
from typing import Any

import aiohttp

from tetri_server.bench.progress import Progress
from tetri_server.bench.prom import scrape_busy_seconds
from tetri_server.bench.sse import SSEEvent, SSEParser
from tetri_server.bench.workload import BenchRequest

RUN_DEADLINE_MARGIN_S = 30.0


@dataclass(frozen=True)
class ClientConfig:
    base_url: str  # e.g. http://127.0.0.1:8010 (no /v1)
    model: str
    max_concurrency: int | None = None  # None: open loop without a cap
    request_timeout_s: float = 600.0  # one request, send to end of stream
    read_timeout_s: float = 120.0  # longest silence inside one stream
    connect_timeout_s: float = 10.0
    extra_body: dict[str, Any] = field(default_factory=dict)  # merged into every request body
    api_key: str | None = None
    progress: bool = True
    label: str = ""  # shown before the progress bar
    # send each request's true output length as ``true_output_len`` (tetri_server's extension
    # for predictor.kind = oracle; other servers may reject or ignore the field)
    send_true_output_len: bool = False
    # The true length hidden from the server (``--hide-output-len``): each request asks for
    # max_tokens = this context length - its prompt (what a client with no length in mind
    # gets) with continuous usage stats, and the client stops reading and disconnects once
    # the true output length has streamed (the server sees an abort, as at an EOS it could
    # not foresee). None: max_tokens = the true length, with ignore_eos (vllm bench serve's).
    hidden_len_context: int | None = None


@dataclass
class RequestRecord:
    """What happened to one request. Times in seconds from the start of the run."""

    request_id: int
    kind: str
    prompt_len: int
    output_len: int  # the true length: max_tokens, or where --hide-output-len stops reading
    arrival_s: float  # scheduled send time
    send_s: float | None = None
    first_token_s: float | None = None
    token_times_s: list[float] = field(default_factory=list)
    end_s: float | None = None
    num_output_tokens: int | None = None  # usage.completion_tokens
    num_prompt_tokens: int | None = None  # usage.prompt_tokens
    http_status: int | None = None
    error: str | None = None
    ended_without_text: bool = False  # the last chunk: a finish_reason and no text

    @property
    def ok(self) -> bool:
        return self.error is None and self.end_s is not None and self.first_token_s is not None

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> RequestRecord:
        """A record as a benchmark's JSON stores it; the keys added beside the fields (such as
        ``met_slo``) are left out."""
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})


@dataclass
class RunResult:
    records: list[RequestRecord]
    duration_s: float  # run start to the last request's end
    started_unix_s: float
    busy_before: dict[str, float] | None = None  # "worker:role" -> busy seconds
    busy_after: dict[str, float] | None = None
    # CPU seconds the server's processes used during the run, per process ("name[pid]"); set
    # by ``compare`` (it knows the server's process session), None for ``run``
    server_cpu_s: dict[str, float] | None = None
    client_cpu_s: float | None = None  # this process (the load generator), compare only
    machine_cpu_s: float | None = None  # every core's busy time, any process (compare only)


def request_body(req: BenchRequest, cfg: ClientConfig) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": cfg.model,
        "prompt": req.prompt,
        "max_tokens": req.output_len,
        "ignore_eos": True,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if cfg.send_true_output_len:
        body["true_output_len"] = req.output_len
    if cfg.hidden_len_context is not None:
        body["max_tokens"] = max(req.output_len, cfg.hidden_len_context - req.prompt_len)
        body["stream_options"] = {"include_usage": True, "continuous_usage_stats": True}
    body.update(cfg.extra_body)
    return body


def _on_event(ev: SSEEvent, rec: RequestRecord, now_s: float) -> bool:
    """Apply one SSE event to ``rec``; True when the stream says it is done."""
    if ev.data.strip() == "[DONE]":
        if (rec.ended_without_text and rec.num_output_tokens is not None
                and len(rec.token_times_s) > rec.num_output_tokens):
            rec.token_times_s.pop()  # a finish chunk that carried no token (usage says so)
        return True
    try:
        obj = json.loads(ev.data)
    except ValueError:
        rec.error = rec.error or f"bad JSON in stream: {ev.data[:100]!r}"
        return False
    if not isinstance(obj, dict):
        rec.error = rec.error or f"unexpected chunk in stream: {ev.data[:100]!r}"
        return False
    if ev.event == "error" or "error" in obj:
        err = obj.get("error", obj)
        msg = err.get("message", err) if isinstance(err, dict) else err
        rec.error = rec.error or f"stream error: {msg}"
        return False
    choices = obj.get("choices") or []
    if choices and rec.error is None:
        choice = choices[0]
        # every chunk with a choice is a token's arrival, as ``vllm bench serve`` counts them:
        # a token's text may be empty (held back: part of a character; a skipped special
        # token), the last one's too; a server that sends its finish_reason in a chunk of its
        # own is told by the usage at the end ([DONE])
        rec.token_times_s.append(now_s)
        rec.ended_without_text = not choice.get("text") and choice.get("finish_reason") is not None
        if rec.first_token_s is None:
            rec.first_token_s = now_s
    usage = obj.get("usage")
    if usage:
        rec.num_output_tokens = usage.get("completion_tokens")
        rec.num_prompt_tokens = usage.get("prompt_tokens")
    return False


def _cut(rec: RequestRecord) -> bool:
    """``--hide-output-len``: True once ``rec.output_len`` tokens have streamed (the client
    stops there); a token chunk without the usage so far is an error (a server without
    continuous usage stats would stream the whole context)."""
    if rec.error is not None:
        return True
    n = rec.num_output_tokens
    if n is None:
        if rec.token_times_s:
            rec.error = ("no continuous usage stats in the stream: --hide-output-len needs "
                         "stream_options.continuous_usage_stats")
            return True
        return False
    if n < rec.output_len:
        return False
    rec.num_output_tokens = rec.output_len  # what the client wanted; it stops here
    return True


async def _read_stream(resp: aiohttp.ClientResponse, rec: RequestRecord, t0: float,
                       hidden: bool = False) -> None:
    """Read the SSE stream into ``rec``. ``hidden``: stop at ``rec.output_len`` tokens (the
    chunks' continuous usage counts them) and close the connection, which aborts the rest."""
    parser, done = SSEParser(), False
    async for chunk in resp.content.iter_any():
        now_s = time.perf_counter() - t0
        for ev in parser.feed(chunk):
            done = _on_event(ev, rec, now_s) or done
            if hidden and not done and _cut(rec):
                done = True  # the events after the cut in this read are not the client's
                resp.close()
                break
        if done:
            break
    if not done:
        now_s = time.perf_counter() - t0
        for ev in parser.close():
            done = _on_event(ev, rec, now_s) or done
    rec.end_s = time.perf_counter() - t0
    if rec.error is None and not done:
        rec.error = "stream ended without [DONE]"
    if rec.error is None and not rec.token_times_s:
        rec.error = "stream finished with no tokens"
    n = rec.num_output_tokens
    if rec.error is None and n is not None and n != rec.output_len:
        # every request asks for exactly output_len (ignore_eos): a shorter reply (an abort
        # with HTTP 200, a server ignoring ignore_eos) must not count as a fast success
        rec.error = f"short reply: {n} of {rec.output_len} tokens"


async def _send(
    session: aiohttp.ClientSession,
    cfg: ClientConfig,
    req: BenchRequest,
    rec: RequestRecord,
    t0: float,
    cap: asyncio.Semaphore | None,
) -> None:
    delay_s = t0 + req.arrival_s - time.perf_counter()
    if delay_s > 0:
        await asyncio.sleep(delay_s)
    timeout = aiohttp.ClientTimeout(
        total=cfg.request_timeout_s,
        sock_connect=cfg.connect_timeout_s,
        sock_read=cfg.read_timeout_s,
    )
    headers = {"Authorization": f"Bearer {cfg.api_key}"} if cfg.api_key else None
    async with cap if cap is not None else contextlib.nullcontext():
        rec.send_s = time.perf_counter() - t0
        try:
            async with session.post(
                f"{cfg.base_url}/v1/completions",
                json=request_body(req, cfg),
                timeout=timeout,
                headers=headers,
            ) as resp:
                rec.http_status = resp.status
                if resp.status != 200:
                    rec.error = f"HTTP {resp.status}: {(await resp.text())[:300]}"
                else:
                    await _read_stream(resp, rec, t0, cfg.hidden_len_context is not None)
        except TimeoutError:
            rec.error = rec.error or "timeout"
        except aiohttp.ClientError as exc:
            rec.error = rec.error or f"{type(exc).__name__}: {exc}"
        except asyncio.CancelledError:
            rec.error = rec.error or "cancelled at the run deadline"
            raise
        finally:
            if rec.end_s is None:
                rec.end_s = time.perf_counter() - t0


async def run_benchmark(
    requests: list[BenchRequest], cfg: ClientConfig, scrape_metrics: bool = True
) -> RunResult:
    """Send ``requests`` open-loop at their arrival times; return one record per request."""
    records = [
        RequestRecord(r.request_id, r.kind, r.prompt_len, r.output_len, r.arrival_s)
        for r in requests
    ]
    cap = asyncio.Semaphore(cfg.max_concurrency) if cfg.max_concurrency else None
    deadline_s = max((r.arrival_s for r in requests), default=0.0)
    # a request waits for the cap at most as long as the ones before it take (each bounded)
    turns = 1 if cap is None else -(-len(requests) // cfg.max_concurrency)
    deadline_s += turns * cfg.request_timeout_s + RUN_DEADLINE_MARGIN_S
    # limit=0: the connector must not become a hidden concurrency cap (aiohttp's default is 100)
    connector = aiohttp.TCPConnector(limit=0)
    progress = Progress(len(requests), enabled=cfg.progress, label=cfg.label)
    async with aiohttp.ClientSession(connector=connector) as session:
        before = await scrape_busy_seconds(session, cfg.base_url) if scrape_metrics else None
        started_unix_s = time.time()
        t0 = time.perf_counter()

        async def one(req: BenchRequest, rec: RequestRecord) -> None:
            try:
                await _send(session, cfg, req, rec, t0, cap)
            finally:
                progress.update(ok=rec.ok)

        tasks = [asyncio.ensure_future(one(q, r)) for q, r in zip(requests, records, strict=True)]
        try:
            async with asyncio.timeout(deadline_s):
                await asyncio.gather(*tasks)
        except TimeoutError:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            for rec in records:
                if rec.send_s is None:
                    rec.error = rec.error or "not sent before the run deadline"
        finally:
            progress.close()
        ends = [r.end_s for r in records if r.end_s is not None]
        duration_s = max(ends, default=time.perf_counter() - t0)
        after = await scrape_busy_seconds(session, cfg.base_url) if scrape_metrics else None
    return RunResult(records, duration_s, started_unix_s, before, after)


async def fetch_model_name(base_url: str, timeout_s: float = 10.0) -> str:
    """The first model id the server lists under ``/v1/models``."""
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout_s)) as session:
        async with session.get(f"{base_url}/v1/models") as resp:
            resp.raise_for_status()
            listing = await resp.json()
    return str(listing["data"][0]["id"])


def add_server_arguments(p: argparse.ArgumentParser, when: str = "") -> None:
    """The options that describe a running server to benchmark; ``when`` prefixes their help
    (e.g. ``"--url: "`` where the command can also start the servers itself)."""
    p.add_argument("--label", default="server", help=f"{when}name of the server in the tables")
    p.add_argument("--model-name", help=f"{when}model field to send; default: first of /v1/models")
    p.add_argument("--server-config", help=f"{when}JSON object (or @file) recorded with results")
    p.add_argument("--num-workers", type=int, help=f"{when}for perf/$; default: from /metrics")
    p.add_argument("--api-key")
