"""``prefill.overtake_share``: short prompts queued behind a long one that is being prefilled
ride in its next steps instead of waiting for the rest of it; every output still equals
transformers, on a real cluster: in the prefill worker's chunks (the strict split) and in the
mixed steps it runs beside a request it kept (elastic P/D)."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections import Counter
from collections.abc import AsyncIterator
from pathlib import Path

from tests.conftest import hf_greedy, random_prompts
from tests.integration.conftest import (
    STRICT_SPLIT,
    collect,
    conclusive,
    first_on_the_decode_worker,
    make_cluster,
    segments,
    until,
)
from tests.integration.test_elastic import assert_all_freed
from tetri_server.control.cluster import Cluster
from tetri_server.messages import SamplingParams

GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
LONG = 1500  # tokens: some 50 prefill steps of 32; the short ones are queued behind its first
# FCFS order, so the long prompt starts first (srpt, the default, would start the short ones)
# the kept request decodes this many tokens, a step each (some 0.5 ms on the tiny model): the
# long prompt's 50 steps must come before it ends, though the control process that sends it
# may be late on a busy machine
KEPT_TOKENS = 1600
SETS = ("prefill.chunk_size=32", "prefill.overtake_share=0.5", "kv.num_blocks=800",
        "prefill.policy=fcfs", "prefill.finish_alone=false")


def steps(log: Path) -> list[dict]:
    """The prefill worker's steps that carried prompt tokens."""
    return [r for r in map(json.loads, log.read_text().splitlines())
            if r["kind"] in ("chunk", "mixed_step") and r["slices"]]


@contextlib.asynccontextmanager
async def running(cluster: Cluster) -> AsyncIterator[None]:
    """The cluster started; after the body, every block freed, and once stopped no shared
    memory segment of the run left."""
    await cluster.start()
    try:
        yield
        await assert_all_freed(cluster)
    finally:
        run_id = cluster.run_id
        await cluster.stop()
    assert segments(run_id) == []


def long_and_shorts(model: Path) -> tuple[list[list[int]], list[list[int]]]:
    """A 1500-token prompt and 8 of 3-12 tokens (each fits the 15-16 tokens of a step shared),
    and their transformers outputs."""
    [long_one] = random_prompts(1, 8000, (LONG, LONG), seed=31)
    prompts = [long_one, *random_prompts(8, 8000, (3, 12), seed=32)]
    return prompts, hf_greedy(model, prompts, GREEDY.max_tokens)


async def long_then_shorts(cluster: Cluster, prompts: list[list[int]],
                           ref: list[list[int]]) -> None:
    """Sent back to back, the long one first: it starts in the first step (FCFS), the short
    ones queue behind it; all equal transformers."""
    got = await asyncio.wait_for(
        asyncio.gather(*(collect(cluster, p, GREEDY) for p in prompts)), 120)
    assert got == ref


def long_id(records: list[dict]) -> int:
    """The request whose prompt the steps' slices add up to 1500 tokens."""
    totals: Counter[int] = Counter()
    for r in records:
        for req_id, _, n in r["slices"]:
            totals[req_id] += n
    return next(req_id for req_id, n in totals.items() if n == LONG)


def assert_overtaken(records: list[dict], long_id: int, min_kept: int) -> None:
    """Some step carried whole short prompts beside a slice from the middle of the long one,
    and each such step left the long one at least ``min_kept`` tokens."""
    overtaken = [r for r in records
                 if any(q == long_id and 0 < s and s + n < LONG for q, s, n in r["slices"])
                 and any(q != long_id and s == 0 for q, s, _ in r["slices"])]
    assert overtaken, "no short prompt rode in a step of the started long one"
    for r in overtaken:
        assert sum(n for q, _, n in r["slices"] if q == long_id) >= min_kept, r


async def test_short_prompts_overtake_a_started_long_one_in_its_chunks(tiny_llama, tmp_path):
    prompts, ref = long_and_shorts(tiny_llama)
    cluster = make_cluster(tiny_llama, "disaggregated", *SETS, *STRICT_SPLIT,
                           f"monitor.decision_log={tmp_path / 'decisions'}")
    async with running(cluster):
        await long_then_shorts(cluster, prompts, ref)
    records = steps(tmp_path / "decisions.w0.jsonl")
    assert all(r["kind"] == "chunk" for r in records)
    assert_overtaken(records, long_id(records), min_kept=16)


async def test_short_prompts_overtake_it_in_steps_beside_a_kept_request(tiny_llama, tmp_path):
    """Elastic P/D: while the prefill worker decodes a request it kept, its steps (at most 32
    tokens) carry that row and prompt slices; the shorts still ride beside the long prompt."""
    decode_long = SamplingParams(max_tokens=KEPT_TOKENS, temperature=0.0, ignore_eos=True)
    pair = random_prompts(2, 8000, (10, 30), seed=24)
    ref_pair = hf_greedy(tiny_llama, pair, decode_long.max_tokens)
    prompts, ref = long_and_shorts(tiny_llama)

    async def kept_then_long(attempt: int) -> list[dict]:
        """On a cluster of its own: the first of ``pair`` decoding on the decode worker, the
        second kept, then the long prompt and the shorts; every output equals transformers;
        the prefill worker's steps."""
        log = tmp_path / f"decisions{attempt}"
        cluster = make_cluster(tiny_llama, "disaggregated", *SETS, "prefill.local_decode_batch=3",
                               "prefill.local_decode_min_tokens=0",
                               "prefill.local_decode_balance=false",
                               "prefill.local_decode_chunk=32", "decode.local_prefill_tokens=0",
                               "monitor.interval_ms=20", f"monitor.decision_log={log}")
        async with running(cluster):
            first = await first_on_the_decode_worker(cluster, pair[0], decode_long)
            # the second is kept
            second = asyncio.ensure_future(collect(cluster, pair[1], decode_long))
            await until(lambda: any(r.role == "prefill" and r.num_running
                                    for r in cluster.reports.values()), 60, "a request kept")
            await long_then_shorts(cluster, prompts, ref)
            assert [await asyncio.wait_for(first, 180), await asyncio.wait_for(second, 180)] \
                == ref_pair
        return steps(log.with_name(log.name + ".w0.jsonl"))

    def beside_the_kept_row(records: list[dict]) -> bool:
        """Every step of the long prompt carried the kept request's row."""
        long_req = long_id(records)
        return all(r["kind"] == "mixed_step" and r["run"] for r in records
                   if any(q == long_req for q, _, _ in r["slices"]))

    records = await conclusive(kept_then_long, beside_the_kept_row,
                               "the kept request ended before the long prompt's steps")
    assert_overtaken(records, long_id(records), min_kept=15)


async def test_srpt_pauses_a_started_long_prompt_and_resumes_it(tiny_llama, tmp_path):
    """``prefill.policy = "srpt"``: prompts of 40-60 tokens (two steps of 32 each: too long to
    ride whole in a step) sent while a 1500-token prompt is being prefilled run before the
    rest of it, in steps of their own; the long one resumes where it stopped and every output,
    its own included, equals transformers."""
    [long_one] = random_prompts(1, 8000, (LONG, LONG), seed=31)
    shorts = random_prompts(6, 8000, (40, 60), seed=33)
    ref = hf_greedy(tiny_llama, [long_one, *shorts], GREEDY.max_tokens)
    log = tmp_path / "decisions.w0.jsonl"
    cluster = make_cluster(tiny_llama, "disaggregated", "prefill.chunk_size=32",
                           "prefill.overtake_share=0", "prefill.policy=srpt",
                           "kv.num_blocks=800", *STRICT_SPLIT,
                           f"monitor.decision_log={tmp_path / 'decisions'}")
    async with running(cluster):
        first = asyncio.ensure_future(collect(cluster, long_one, GREEDY))
        await until(lambda: log.exists() and len(steps(log)) >= 3, 60,
                    "the long prompt started")
        got = await asyncio.wait_for(
            asyncio.gather(*(collect(cluster, p, GREEDY) for p in shorts)), 120)
        assert [await asyncio.wait_for(first, 120), *got] == ref
    records = steps(log)
    long_req = long_id(records)
    with_long = [i for i, r in enumerate(records) if any(q == long_req for q, _, _ in r["slices"])]
    paused = [r for r in records[with_long[0]:with_long[-1]]
              if all(q != long_req for q, _, _ in r["slices"])]
    # some 300 tokens of short prompts: steps of 32 without the long one in between its own
    assert len(paused) >= 4, paused
    assert any(s > 0 for r in paused for _, s, _ in r["slices"]), "no short one resumed"
