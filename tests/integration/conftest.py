"""A real multi-process cluster on a tiny model (real processes, shm rings, KV pools)."""

from __future__ import annotations

import asyncio
import os
import re
import subprocess
import sys
import threading
import time
from collections.abc import AsyncIterable, Awaitable, Callable
from pathlib import Path
from typing import TypeVar

import pytest

from tetri_server.config import load_config
from tetri_server.control.cluster import Cluster
from tetri_server.messages import SamplingParams, TokenDelta

BASE = ["predictor.kind=none", "decode.policy=greedy", "prefill.chunk_size=64",
        "kv.num_blocks=400", "cluster.workers=2", "server.request_timeout_s=60",
        "cluster.worker_start_timeout_s=120", "server.drain_timeout_s=5",
        # most requests here take at most 16 tokens: keep them on the hand-off path they test
        # (a prefill worker finishes them itself by default; tests/integration/test_elastic.py)
        "prefill.local_finish_tokens=0"]


# The paper's strict split (elastic P/D is on by default on both sides): for tests that need a
# prefill worker that only prefills and a decode worker that only decodes.
STRICT_SPLIT = ("prefill.local_decode_batch=0", "decode.local_prefill_tokens=0")


def start_server(tmp_path: Path, *overrides: str, argv: tuple[str, ...] = (),
                 env: dict[str, str] | None = None, new_session: bool = False,
                 log: list[str] | None = None) -> tuple[subprocess.Popen[str], str]:
    """`python -m tetri_server serve ARGV --set KEY=VALUE...` on a free port, its cache under
    ``tmp_path``: (the process, its base URL) once it prints the URL (at most 180 s).
    ``new_session``: in a process group of its own (a test may signal the group); ``log``
    receives its output lines, read on a thread."""
    env = dict(os.environ, TETRI_CACHE_DIR=str(tmp_path / "cache"), **(env or {}))
    args = [sys.executable, "-m", "tetri_server", "serve", *argv, "--set", "server.port=0"]
    for o in overrides:
        args += ["--set", o]
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=env, start_new_session=new_session)
    lines: list[str] = [] if log is None else log
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        lines.append(line)
        m = re.search(r"at (http://\S+)/v1", line)
        if m:
            threading.Thread(target=lines.extend if log is not None else proc.stdout.read,
                             args=(proc.stdout,) if log is not None else (),
                             daemon=True).start()  # keep draining
            return proc, m.group(1)
    proc.kill()
    raise AssertionError("server did not print its URL:\n" + "".join(lines[-40:]))


def make_cluster(model: Path, mode: str, *extra: str) -> Cluster:
    cfg = load_config(None, [f"cluster.mode={mode}", f"model.path={model}", *BASE, *extra])
    return Cluster(cfg.resolve(cpu_count=os.cpu_count() or 1))


def api_cluster_factory(*sets: str):  # noqa: ANN201 - an ApiHarness backend factory
    """For ``ApiHarness``: a real cluster with ``sets`` (key=value) on the model it is given,
    and its close."""

    async def make(model_path, metrics):  # noqa: ANN001, ANN202
        cfg = load_config(None, [f"model.path={model_path}", *sets])
        cluster = Cluster(cfg.resolve(cpu_count=os.cpu_count() or 1), metrics)
        await cluster.start()

        async def close() -> None:
            await cluster.stop(drain_timeout_s=0)

        return cluster, close

    return make


async def collect(cluster: Cluster, prompt: list[int], params: SamplingParams) -> list[int]:
    """The output token ids of one request, streamed from the real cluster."""
    return await tokens_of(cluster.submit(prompt, params))


async def tokens_of(stream: AsyncIterable[TokenDelta]) -> list[int]:
    """The output token ids of a submitted request's stream (``Cluster.submit``)."""
    out: list[int] = []
    async for d in stream:
        out.extend(d.token_ids)
    return out


async def until(check: Callable[[], object], timeout_s: float, what: str) -> None:
    """Poll ``check`` (every 10 ms) until it is true; AssertionError after ``timeout_s``."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while not check():
        if loop.time() > deadline:
            raise AssertionError(f"not within {timeout_s} s: {what}")
        await asyncio.sleep(0.01)


T = TypeVar("T")


async def conclusive(run: Callable[[int], Awaitable[T]], happened: Callable[[T], bool],
                     why: str, runs: int = 3) -> T:
    """What ``run(attempt)`` (a scenario on a cluster of its own) returned once ``happened``
    holds of it. A scenario that needs a kept request still decoding when the control process
    sends the next requests is inconclusive when that process, late on a busy machine, sends
    them after it ended; it runs again, at most ``runs`` times, then AssertionError
    ``in {runs} runs {why}``."""
    for attempt in range(runs):
        result = await run(attempt)
        if happened(result):
            return result
    raise AssertionError(f"in {runs} runs {why}")


async def next_view(cluster: Cluster, timeout_s: float = 30) -> None:
    """Until the monitor has posted a decode view built after this call: the prefill workers
    read it before any request submitted from now on (one ordered ring each), and it holds the
    reports control has now."""
    seen = cluster.monitor.view_seq
    await until(lambda: cluster.monitor.view_seq > seen, timeout_s, "a new decode view")


async def first_on_the_decode_worker(cluster: Cluster, prompt: list[int],
                                     params: SamplingParams) -> asyncio.Future[list[int]]:
    """Submit ``prompt`` once the prefill worker has a view of the idle decode worker (so it is
    handed off there), wait until the decode worker reports it running and for a view that
    shows it (a prefill worker with elastic P/D then keeps the next request); returns the
    running collection of its tokens."""
    await next_view(cluster)
    run = asyncio.ensure_future(collect(cluster, prompt, params))
    await until(lambda: any(r.role == "decode" and r.num_running
                            for r in cluster.reports.values()), 60,
                "the first request decoding on the decode worker")
    await next_view(cluster)
    return run


def segments(run_id: str) -> list[str]:
    return [n for n in os.listdir("/dev/shm") if n.startswith(run_id)]


@pytest.fixture
def tiny_llama(model_dir):
    return model_dir("llama")
