"""Elastic P/D (``prefill.local_decode_batch``): the prefill worker keeps some prefilled
requests and decodes them itself, the others go to the decode worker; every output still equals
transformers and nothing is left held."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from tests.conftest import hf_greedy, random_prompts
from tests.integration.conftest import (
    collect,
    conclusive,
    first_on_the_decode_worker,
    make_cluster,
    segments,
    tokens_of,
    until,
)
from tests.integration.test_cluster import wait_all_free
from tetri_server.messages import SamplingParams

GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)


async def assert_all_freed(cluster) -> None:
    usage = await wait_all_free(cluster)
    assert all(u == 0 for u, _ in usage.values()), usage


def decisions(tmp_path, worker: int = 0) -> list[dict]:
    return [json.loads(line) for line in (tmp_path / f"decisions.w{worker}.jsonl").open()]


def placed(tmp_path) -> set[int]:
    """The requests the prefill worker has kept or dispatched so far, from the decision log
    written so far (a line being written is left out)."""
    path = tmp_path / "decisions.w0.jsonl"
    if not path.exists():
        return set()
    lines = [line for line in path.read_text().splitlines(keepends=True) if line.endswith("\n")]
    return {r["req"] for r in map(json.loads, lines) if r["kind"] in ("keep", "dispatch")}


async def run_long_then_crowd(tiny_llama, tmp_path, *sets: str,
                              steps_s: list[float] | None = None) -> tuple[set, set, int, list]:
    """A long first request (300 tokens) decoding on the decode worker (the prefill worker has
    its view first), then a second one, placed alone once the prefill worker's view shows the
    first, then a crowd of short ones (24 tokens, the second too); every output is
    checked against transformers. The decode side's rule is off (every prompt is prefilled on
    the prefill worker, the rule under test). Returns (kept ids, ids dispatched by the prefill
    worker, first id, the prefill worker's records); ``steps_s`` gets the decode worker's
    reported recent step just before the crowd."""
    long_one = SamplingParams(max_tokens=300, temperature=0.0, ignore_eos=True)
    first, second = random_prompts(2, 8000, (10, 30), seed=22)
    crowd = random_prompts(16, 8000, (1, 200), seed=23)
    ref_first = hf_greedy(tiny_llama, [first], long_one.max_tokens)
    ref = hf_greedy(tiny_llama, [second, *crowd], GREEDY.max_tokens)
    log = tmp_path / "decisions"
    cluster = make_cluster(tiny_llama, "disaggregated", "prefill.local_decode_batch=3",
                           "decode.local_prefill_tokens=0", "monitor.interval_ms=20",
                           f"monitor.decision_log={log}", *sets)
    await cluster.start()
    try:
        run_first = await first_on_the_decode_worker(cluster, first, long_one)
        if steps_s is not None:
            steps_s += [r.step_s for r in cluster.reports.values() if r.role == "decode"]
        run_second = asyncio.ensure_future(collect(cluster, second, GREEDY))
        # the second is placed (kept or sent) before the crowd queues behind it
        await until(lambda: len(placed(tmp_path)) >= 2, 60, "the second placed")
        got = await asyncio.wait_for(
            asyncio.gather(run_second, *(collect(cluster, p, GREEDY) for p in crowd)), 180)
        assert got == ref
        assert [await asyncio.wait_for(run_first, 180)] == ref_first
        await assert_all_freed(cluster)
    finally:
        run_id = cluster.run_id
        await cluster.stop()
    assert segments(run_id) == []
    records = decisions(tmp_path)
    kept = {r["req"] for r in records if r["kind"] == "keep"}
    sent = {r["req"] for r in records if r["kind"] == "dispatch"}
    assert not kept & sent
    return kept, sent, min(kept | sent), records


async def test_kept_and_handed_off_requests_both_equal_transformers(tiny_llama, tmp_path):
    """With any request worth keeping (min_tokens 0, whatever the load, balance off): the first
    decodes on the decode worker, the next one is kept; then the crowd. All equal transformers,
    and no request takes both paths."""
    kept, sent, first_id, records = await run_long_then_crowd(
        tiny_llama, tmp_path, "prefill.local_decode_min_tokens=0",
        "prefill.local_decode_max_prompt_share=1", "prefill.local_decode_balance=false")
    assert first_id in sent and first_id + 1 in kept  # the second went the other way
    assert kept and sent
    assert any(r["kind"] == "mixed_step" and r["run"] for r in records)
    assert max(len(r["run"]) for r in records if r["kind"] == "mixed_step") <= 3


async def run_kept_pair_then_crowd(tiny_llama, tmp_path, *sets: str) -> list[dict]:
    """Two long requests (one kept by the prefill worker: 3 at most, a 12-token mixed step),
    then a crowd of short prompts at once while they decode; every output must equal
    transformers. Returns the decision records."""
    long_one = SamplingParams(max_tokens=800, temperature=0.0, ignore_eos=True)
    pair = random_prompts(2, 8000, (10, 30), seed=24)
    crowd = random_prompts(8, 8000, (20, 60), seed=25)
    ref_pair = hf_greedy(tiny_llama, pair, long_one.max_tokens)
    ref = hf_greedy(tiny_llama, crowd, GREEDY.max_tokens)
    log = tmp_path / "decisions"
    cluster = make_cluster(tiny_llama, "disaggregated", "prefill.local_decode_batch=3",
                           "prefill.local_decode_min_tokens=0",
                           "prefill.local_decode_balance=false", "prefill.local_decode_chunk=12",
                           "decode.local_prefill_tokens=0",
                           "monitor.interval_ms=20", f"monitor.decision_log={log}", *sets)
    await cluster.start()
    try:
        first = await first_on_the_decode_worker(cluster, pair[0], long_one)
        # the second is kept
        second = cluster.submit(pair[1], long_one).__aiter__()
        head: list[int] = []
        while not head:  # its first token: prefilled, and kept or handed off
            head = list((await asyncio.wait_for(second.__anext__(), 60)).token_ids)
        rest = asyncio.ensure_future(tokens_of(second))
        # at once, while the long ones decode (the second kept)
        runs = [collect(cluster, p, GREEDY) for p in crowd]
        assert await asyncio.wait_for(asyncio.gather(*runs), 180) == ref
        second_out = head + await asyncio.wait_for(rest, 180)
        assert [await asyncio.wait_for(first, 180), second_out] == ref_pair
        await assert_all_freed(cluster)
    finally:
        await cluster.stop()
    records = decisions(tmp_path)
    assert {r["req"] for r in records if r["kind"] == "keep"}
    return records


async def test_steps_with_kept_rows_take_at_most_the_local_decode_chunk(tiny_llama, tmp_path):
    """``prefill.local_decode_chunk``: while the prefill worker decodes a request it kept,
    prompts arriving meanwhile are prefilled in its steps beside the kept row, at most that
    many tokens a step, row and slices together (the 64-token chunk would take more), and
    every output equals transformers."""
    records = await run_kept_pair_then_crowd(tiny_llama, tmp_path)
    mixed = [r for r in records if r["kind"] == "mixed_step" and r["run"] and r["slices"]]
    assert mixed, "no prompt slice rode beside a kept request's row"
    for r in mixed:
        assert len(r["run"]) + sum(n for _, _, n in r["slices"]) <= 12, r


async def test_past_the_backlog_bound_steps_with_kept_rows_take_the_whole_chunk(tiny_llama,
                                                                              tmp_path):
    """``prefill.local_decode_full_chunk_backlog``: while the crowd's backlog exceeds it, a step
    beside the kept row takes the 64-token chunk, not the 12-token mixed step; once it is down
    to the bound, 12 again; every output equals transformers."""
    records = await run_kept_pair_then_crowd(tiny_llama, tmp_path,
                                             "prefill.local_decode_full_chunk_backlog=100")
    sizes = [len(r["run"]) + sum(n for _, _, n in r["slices"]) for r in records
             if r["kind"] == "mixed_step" and r["run"] and r["slices"]]
    assert max(sizes) > 12, sizes  # the crowd (8 prompts of 20-60 tokens) is over 100 tokens
    assert max(sizes) <= 64 and min(sizes) <= 12, sizes


async def test_while_prompts_took_under_the_share_steps_with_kept_rows_take_the_chunk(
        tiny_llama, tmp_path):
    """``prefill.local_decode_full_chunk_share``: steps with prompt tokens took well under the
    whole of the last 10 s (the tiny model prefills in milliseconds), so with a share of 1 a
    step beside the kept row takes up to the 64-token chunk, not the 12-token mixed step; every
    output equals transformers."""
    records = await run_kept_pair_then_crowd(tiny_llama, tmp_path,
                                             "prefill.local_decode_full_chunk_share=1")
    sizes = [len(r["run"]) + sum(n for _, _, n in r["slices"]) for r in records
             if r["kind"] == "mixed_step" and r["run"] and r["slices"]]
    assert max(sizes) > 12, sizes  # the crowd (8 prompts of 20-60 tokens) is over 12 tokens
    assert max(sizes) <= 64, sizes


async def test_with_prompt_first_a_small_backlog_runs_alone(tiny_llama, tmp_path):
    """``prefill.local_decode_prompt_first``: while a kept request decodes, the crowd's backlog
    beyond a 40-token mixed step still goes in mixed steps, and one that fits runs alone, in a
    pure prefill chunk; every output equals transformers."""
    records = await run_kept_pair_then_crowd(tiny_llama, tmp_path,
                                             "prefill.local_decode_prompt_first=true",
                                             "prefill.local_decode_chunk=40")
    steps = [r for r in records if r["kind"] in ("chunk", "mixed_step")]

    def beside_a_kept_one(i: int) -> bool:  # a request decoded here in a step before and after
        before = {q for r in steps[:i] if r["kind"] == "mixed_step" for q in r["run"]}
        return any(q in before for r in steps[i + 1:] if r["kind"] == "mixed_step"
                   for q in r["run"])

    alone = [i for i, r in enumerate(steps) if r["kind"] == "chunk" and beside_a_kept_one(i)]
    assert alone, "no chunk ran alone while a kept request waited"
    mixed = [r for r in steps if r["kind"] == "mixed_step" and r["run"] and r["slices"]]
    assert mixed, "the backlog beyond a mixed step did not mix"
    for r in mixed:
        assert len(r["run"]) + sum(n for _, _, n in r["slices"]) <= 40, r


async def test_with_balance_a_request_is_kept_only_where_it_decodes_faster(tiny_llama, tmp_path):
    """``prefill.local_decode_balance``: the decode worker reports its recent decode step
    while it decodes; the prefill worker keeps a request only while its own expected gap is
    shorter than that step, in the live numbers it logged with each keep; outputs equal
    transformers either way."""
    steps_s: list[float] = []
    kept, sent, first_id, records = await run_long_then_crowd(
        tiny_llama, tmp_path, "prefill.local_decode_min_tokens=0",
        "prefill.local_decode_balance=true", steps_s=steps_s)
    assert len(kept | sent) == 18 and len(steps_s) == 1
    if first_id in sent:  # the decode worker decodes it: its step is reported, in seconds
        assert 0 < steps_s[0] < 5
    else:  # kept (no view yet): the decode worker is idle
        assert steps_s[0] == 0
    for r in records:  # (no decode worker in the view yet: kept, as without balance)
        if r["kind"] == "keep" and r["decode_step_s"]:
            assert r["gap_s"] < min(r["decode_step_s"]), r
    # past a chunk of queued prompt tokens the chunks are the prompts' (balance_backlog off)
    assert not [r for r in records if r["kind"] == "keep" and r["queued"] > r["chunk"]]


async def test_with_balance_backlog_a_request_is_kept_past_the_backlog_where_it_is_faster(
        tiny_llama, tmp_path):
    """``prefill.local_decode_balance_backlog``: while more than a chunk of the crowd's prompt
    tokens waits, the prefill worker still keeps a request whose expected gap here is below the
    decode worker's reported step (the test above keeps none there), and only such a one;
    every output equals transformers (``run_long_then_crowd``). A run in which nothing was kept
    past the backlog is inconclusive (the crowd's prompts were all prefilled before a keep was
    decided, or the decode worker was faster) and runs again."""

    async def run(attempt: int) -> list[dict]:
        run_dir = tmp_path / f"run{attempt}"
        run_dir.mkdir()
        return (await run_long_then_crowd(
            tiny_llama, run_dir, "prefill.local_decode_min_tokens=0",
            "prefill.local_decode_balance=true",
            "prefill.local_decode_balance_backlog=true"))[3]

    def past(records: list[dict]) -> list[dict]:
        return [r for r in records if r["kind"] == "keep" and r["queued"] > r["chunk"]]

    records = await conclusive(run, lambda rs: bool(past(rs)),
                               "no request was kept past a chunk of backlog")
    for r in past(records):
        assert r["decode_step_s"] and r["gap_s"] < min(r["decode_step_s"]), r


async def test_short_requests_are_handed_off_by_default(tiny_llama, tmp_path):
    """The same flow with the default local_decode_min_tokens (128): the 24-token requests,
    which the test above keeps, are all handed off to the decode worker; only the long one
    may stay."""
    kept, sent, first_id, _ = await run_long_then_crowd(tiny_llama, tmp_path)
    assert kept <= {first_id}
    assert len(sent) >= 17


async def test_requests_of_at_most_finish_tokens_finish_on_the_prefill_worker(tiny_llama,
                                                                              tmp_path):
    """``prefill.local_finish_tokens=24``: the 24-token requests, which the default hands off
    (the test above), finish on the prefill worker while its batch (3) has room, whatever the
    prompts queued behind them; its steps beside one take at most 24 prompt tokens, the rows
    beside them, and every output equals transformers."""
    kept, _, first_id, records = await run_long_then_crowd(
        tiny_llama, tmp_path, "prefill.local_finish_tokens=24")
    short = kept - {first_id}
    assert len(short) >= 3
    beside = [r for r in records if r["kind"] == "mixed_step" and set(r["run"]) & short]
    assert beside and any(r["slices"] for r in beside)  # prompts went on beside them
    for r in beside:
        assert sum(n for _, _, n in r["slices"]) <= 24, r


@pytest.mark.parametrize(("setting", "most"), [("decode.local_prefill_tokens=48", 48),
                                               ("prefill.chunk_size=32", 32),
                                               ("prefill.local_decode_chunk=40", 40)])
async def test_prompts_prefilled_on_the_decode_worker_equal_transformers(tiny_llama, tmp_path,
                                                                        setting, most):
    """Prompts sent while the prefill worker's backlog is more than a chunk beyond the decode
    worker's go to the decode worker, which prefills them in slices riding in its decode steps,
    at most ``decode.local_prefill_tokens`` and at most the prefill worker's chunk capped at
    ``prefill.local_decode_chunk`` (control sends it with the prompt; before, a 32-token chunk
    left slices of over 300 tokens); every output equals transformers and both workers prefill
    some.

    All prompts are submitted in one go, so control routes each against the backlog of the
    prompts sent before it (``GlobalPicker.queued_tokens``), not against a worker report: a
    fast core drains a few hundred tokens between two reports (the old version waited for a
    report of the backlog and timed out on a Zen 5 core)."""
    heavy = random_prompts(6, 8000, (300, 400), seed=31)
    light = random_prompts(8, 8000, (1, 48), seed=32)
    ref = hf_greedy(tiny_llama, heavy + light, GREEDY.max_tokens)
    log = tmp_path / "decisions"
    # prompts go to a decode worker by load with a margin >= 0 (-1 by default since session 41)
    cluster = make_cluster(tiny_llama, "disaggregated", "decode.local_prefill_margin=1",
                           setting, "monitor.interval_ms=20", f"monitor.decision_log={log}")
    await cluster.start()
    try:
        streams = [cluster.submit(p, GREEDY) for p in heavy + light]  # routed here, in order
        got = await asyncio.wait_for(asyncio.gather(*map(tokens_of, streams)), 180)
        assert got == ref
        await assert_all_freed(cluster)
    finally:
        await cluster.stop()
    records = decisions(tmp_path, 1)
    prefilled = {s[0] for r in records for s in r.get("slices", [])}
    assert prefilled, "no prompt was prefilled on the decode worker"
    assert len(prefilled) < len(heavy + light), "the prefill worker prefilled none"
    sizes = [n for r in records for _, _, n in r.get("slices", [])]
    assert max(sizes) <= most


async def test_a_kept_request_handed_back_mid_decode_equals_transformers(tiny_llama, tmp_path):
    """``prefill.local_decode_hand_back``: a request kept and decoding on the prefill worker
    goes to the decode worker once long prompts queue behind it, its hand-off carrying the KV
    of the tokens decoded so far; it, the request before it and the prompts all equal
    transformers, and no block is left held."""
    # long enough that both still decode when the burst comes (~1 s each on a fast core)
    long_one = SamplingParams(max_tokens=1500, temperature=0.0, ignore_eos=True)
    first, second = random_prompts(2, 8000, (10, 30), seed=22)
    burst = random_prompts(3, 8000, (150, 250), seed=24)
    ref = hf_greedy(tiny_llama, [first, second], long_one.max_tokens)
    ref_burst = hf_greedy(tiny_llama, burst, GREEDY.max_tokens)

    def kept_kinds(records: list[dict]) -> tuple[int, list[str]]:
        """The kept request (the second: the first went to the decode worker) and the kinds of
        the decisions on it."""
        kept_id = 1 + min(r["req"] for r in records if r["kind"] == "dispatch")
        return kept_id, [r["kind"] for r in records if r.get("req") == kept_id]

    # kept to its end: either it ended before the burst queued (the control process sent the
    # burst late on a busy machine: nothing to hand back in that run) or the hand-back failed
    records = await conclusive(
        lambda attempt: kept_then_burst(tiny_llama, tmp_path / f"run{attempt}", long_one,
                                        [first, second], ref, burst, ref_burst),
        lambda records: kept_kinds(records)[1] != ["keep"],
        "the kept request was never handed back (it ended before the burst queued, or the "
        "hand-back did not happen)")
    # the second was kept, then handed back once the burst queued, then dispatched (burst
    # requests may be kept too, once the backlog is gone)
    kept_id, kinds = kept_kinds(records)
    assert kinds == ["keep", "hand_back", "dispatch"], kinds
    back = next(i for i, r in enumerate(records) if r["kind"] == "hand_back")
    decoded_here = [r for r in records[:back] if r["kind"] == "mixed_step"
                    and kept_id in r["run"]]
    assert len(decoded_here) >= 2, "the request decoded no tokens before it was handed back"


async def kept_then_burst(model: Path, run_dir: Path, long_one: SamplingParams,
                          pair: list[list[int]], ref: list[list[int]], burst: list[list[int]],
                          ref_burst: list[list[int]]) -> list[dict]:
    """On a cluster of its own that hands kept requests back: the first of ``pair`` decoding on
    the decode worker, the second kept by the prefill worker and a few tokens into its decode
    when ``burst`` is sent; every output equals its reference, no block or segment is left;
    returns the prefill worker's decisions."""
    run_dir.mkdir()
    cluster = make_cluster(model, "disaggregated", "prefill.local_decode_batch=3",
                           "prefill.local_decode_min_tokens=0",
                           "prefill.local_decode_max_prompt_share=1",
                           "prefill.local_decode_hand_back=true",
                           "prefill.local_decode_balance=false",
                           "monitor.interval_ms=20",
                           f"monitor.decision_log={run_dir / 'decisions'}")
    await cluster.start()
    try:
        run_first = await first_on_the_decode_worker(cluster, pair[0], long_one)
        # the prefill worker keeps the second
        second_out: list[int] = []

        async def stream_second() -> list[int]:
            async for d in cluster.submit(pair[1], long_one):
                second_out.extend(d.token_ids)
            return second_out

        run_second = asyncio.ensure_future(stream_second())
        await until(lambda: any(r.role == "prefill" and r.num_running
                                for r in cluster.reports.values()), 60,
                    "the second request kept on the prefill worker")
        # it has decoded a few tokens there before the burst (a slow machine may take a while)
        await until(lambda: len(second_out) >= 4, 60, "the kept request decoding")
        got_burst = await asyncio.wait_for(
            asyncio.gather(*(collect(cluster, p, GREEDY) for p in burst)), 180)
        got = [await asyncio.wait_for(r, 180) for r in (run_first, run_second)]
        assert got == ref
        assert got_burst == ref_burst
        await assert_all_freed(cluster)
    finally:
        run_id = cluster.run_id
        await cluster.stop()
    assert segments(run_id) == []
    return decisions(run_dir)


async def test_a_flip_of_a_prefill_worker_hands_its_kept_requests_back(tiny_llama, tmp_path):
    """Regression: a prefill worker draining for a flip decoded the requests it kept to their
    end (a long one could hold the flip past its timeout) and could keep new ones meanwhile.
    Draining, it now hands them to a decode worker: its decision log shows the kept request
    handed back and dispatched, and every output equals transformers. A run in which nothing
    was kept (the report that named the keeper came while the request waited for its dispatch,
    which then sent it on) or the kept request ended before the flip began (a busy machine) has
    nothing to hand back and runs again; in 3 such runs the test fails."""
    long_one = SamplingParams(max_tokens=1900, temperature=0.0, ignore_eos=True)
    first, second = random_prompts(2, 8000, (10, 30), seed=22)
    ref = hf_greedy(tiny_llama, [first, second], long_one.max_tokens)

    async def run(attempt: int) -> list[str]:
        """The kinds of the keeper's decisions on the kept request."""
        run_dir = tmp_path / f"run{attempt}"
        run_dir.mkdir()
        cluster = make_cluster(tiny_llama, "disaggregated", "cluster.prefill_workers=2",
                               "cluster.threads_per_worker=1", "prefill.local_decode_batch=3",
                               "prefill.local_decode_min_tokens=0",
                               "prefill.local_decode_max_prompt_share=1",
                               "prefill.local_decode_balance=false", "flip.min_interval_s=0",
                               "monitor.interval_ms=20",
                               f"monitor.decision_log={run_dir / 'decisions'}")
        await cluster.start()
        try:
            run_first = await first_on_the_decode_worker(cluster, first, long_one)
            # a prefill worker keeps the second
            run_second = asyncio.ensure_future(collect(cluster, second, long_one))
            await until(lambda: any(r.role == "prefill" and r.num_running
                                    for r in cluster.reports.values()), 60,
                        "the second request kept on a prefill worker")
            keeper = next(w for w, r in cluster.reports.items()
                          if r.role == "prefill" and r.num_running)
            result = await asyncio.wait_for(cluster.flip(keeper, "decode"), 120)
            assert result.to_role == "decode"
            got = [await asyncio.wait_for(r, 180) for r in (run_first, run_second)]
            assert got == ref
            await assert_all_freed(cluster)
        finally:
            await cluster.stop()
        records = decisions(run_dir, keeper)
        kept = [r["req"] for r in records if r["kind"] == "keep"]
        if not kept:  # the report came while it was held before its dispatch: nothing kept
            return []
        return [r["kind"] for r in records if r.get("req") == kept[0]]

    kinds = await conclusive(run, lambda kinds: kinds not in ([], ["keep"]),
                             "the kept request was never handed back (nothing was kept, it "
                             "ended before the flip, or the draining worker decoded it to its "
                             "end)")
    assert kinds == ["keep", "hand_back", "dispatch"], kinds
