"""``--hide-output-len`` against the real API: the server is asked for the rest of the context,
the client stops at the true length and disconnects, and the server aborts the rest. No policy
of the server can see the length (the runs where max_tokens = the true length gave it one)."""

from __future__ import annotations

import asyncio
import time

from tests.conftest import random_prompts
from tests.unit.test_api_double import MODEL_NAME
from tests.unit.test_api_support import ApiHarness, metric, slow_generation
from tetri_server.bench.client import ClientConfig, request_body, run_benchmark
from tetri_server.bench.workload import BenchRequest

pytest_plugins = ["tests.unit.test_api_support"]


def test_hidden_length_asks_for_the_context_and_stops_at_the_true_length(
        api: ApiHarness) -> None:
    prompts = random_prompts(2, 8000, (10, 20), seed=3)
    reqs = [BenchRequest(i, p, len(p), n, 0.0, "LPLD", "test")
            for i, (p, n) in enumerate(zip(prompts, (5, 9), strict=True))]
    # the tiny model's context is 256 tokens
    cfg = ClientConfig(api.base_url, MODEL_NAME, progress=False, hidden_len_context=256)
    assert request_body(reqs[0], cfg)["max_tokens"] == 256 - len(prompts[0])
    aborted = metric(api.base_url, "tetri_request_success_total", finished_reason="abort")
    length = metric(api.base_url, "tetri_request_success_total", finished_reason="length")
    with slow_generation(api):  # ~240 tokens left would take seconds: the cut is seen first
        run = asyncio.run(run_benchmark(reqs, cfg, scrape_metrics=False))
    assert [r.error for r in run.records] == [None, None]
    assert [r.num_output_tokens for r in run.records] == [5, 9]
    # no chunk after the cut is counted (a read may hold several events)
    assert all(1 <= len(r.token_times_s) <= r.output_len for r in run.records)
    deadline = time.monotonic() + 30
    while (metric(api.base_url, "tetri_request_success_total", finished_reason="abort")
           < aborted + 2 and time.monotonic() < deadline):
        time.sleep(0.05)
    # both were cut off by the client's disconnect, not finished at a length the server knew
    assert metric(api.base_url, "tetri_request_success_total",
                  finished_reason="abort") == aborted + 2
    assert metric(api.base_url, "tetri_request_success_total",
                  finished_reason="length") == length
