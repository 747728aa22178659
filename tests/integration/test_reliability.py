"""Faults against the real multi-process cluster (tiny Llama, CPU): a hand-off whose KV the
prefill worker would have moved, a request that crashes its worker, flips under load, a stopped
(SIGSTOP) worker, killed prefill and decode workers, a restart loop. Every output is compared
with transformers; every bound is generous (a busy 2-core machine)."""

from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import Callable

import pytest

from tests.conftest import hf_greedy, random_prompts
from tests.integration.conftest import STRICT_SPLIT, collect, make_cluster, until
from tetri_server.control.protocol import (
    GenerationError,
    InvalidRequestError,
    WorkerUnavailableError,
)
from tetri_server.messages import SamplingParams

GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)


def kill(cluster, worker_id: int, sig: int = signal.SIGKILL) -> None:
    os.kill(cluster.workers[worker_id].proc.pid, sig)


async def handoffs_to_a_stopped_decode_worker(
        cluster, prompts: list[list[int]], enough: Callable[[int], bool],
        what: str) -> list[asyncio.Task[list[int]]]:
    """Stop the decode worker (1) once the prefill worker has its view, submit ``prompts`` and
    wait until ``enough`` of them wait in HANDOFF (``enough(count)``); their tasks."""
    await asyncio.sleep(1.0)  # the prefill worker has a view of the decode worker
    kill(cluster, 1, signal.SIGSTOP)
    jobs = [asyncio.create_task(collect(cluster, p, GREEDY)) for p in prompts]
    await until(lambda: enough(sum(r.state.value == "handoff"
                                   for r in cluster.requests.values())), 60, what)
    return jobs


async def test_compaction_under_waiting_handoffs_keeps_every_output_right(tiny_llama):
    """Regression (wrong text, HTTP 200): with the decode worker stopped, four hand-offs wait
    while requests that finish at the prefill worker fragment its pool; a long prompt then
    needs a run of blocks that only a compaction can make. The decode worker, resumed, must
    copy each request's own KV: every output equals transformers."""
    # round-robin: dispatch on the (stale) view's free blocks alone, so all four go out; the
    # strict split: every prompt is prefilled on the prefill worker (the stopped decode worker
    # would otherwise be sent those that finish sooner there, by its last report)
    cluster = make_cluster(tiny_llama, "disaggregated", "model.max_model_len=512",
                           "kv.num_blocks=48", "monitor.stall_timeout_s=120",
                           "dispatch.policy=round-robin", *STRICT_SPLIT)
    waiting = random_prompts(4, 8000, (50, 60), seed=31)
    fillers = random_prompts(4, 8000, (50, 60), seed=32)
    big = random_prompts(1, 8000, (330, 330), seed=33)[0]
    ref = hf_greedy(tiny_llama, waiting + [big], GREEDY.max_tokens)
    one = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    await cluster.start()
    try:
        await asyncio.sleep(1.0)  # the prefill worker has a view of the decode worker
        kill(cluster, 1, signal.SIGSTOP)
        first: list[asyncio.Event] = [asyncio.Event() for _ in waiting]

        async def run(i: int, prompt: list[int]) -> list[int]:
            out: list[int] = []
            async for d in cluster.submit(prompt, GREEDY):
                out.extend(d.token_ids)
                first[i].set()
            return out

        jobs = []
        for i, (w, f) in enumerate(zip(waiting, fillers, strict=True)):
            jobs.append(asyncio.create_task(run(i, w)))
            await asyncio.wait_for(first[i].wait(), 60)  # prefilled, handed off, waiting
            assert await asyncio.wait_for(collect(cluster, f, one), 60)  # leaves a hole
        big_job = asyncio.create_task(collect(cluster, big, GREEDY))
        await asyncio.sleep(2.0)  # the prefill worker tries to place the long prompt
        kill(cluster, 1, signal.SIGCONT)
        got = await asyncio.wait_for(asyncio.gather(*jobs, big_job), 120)
        assert got == ref
        assert cluster.num_restarts == 0
    finally:
        await cluster.stop()


async def test_many_concurrent_varied_requests_on_a_small_pool_are_all_right(tiny_llama):
    """Statistical companion: 60 concurrent prompts of 1-300 tokens on a pool that keeps the
    prefill worker compacting around in-flight hand-offs."""
    cluster = make_cluster(tiny_llama, "disaggregated", "model.max_model_len=512",
                           "kv.num_blocks=48")
    prompts = random_prompts(60, 8000, (1, 300), seed=34)
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    ref = hf_greedy(tiny_llama, prompts, params.max_tokens)
    await cluster.start()
    try:
        got = await asyncio.wait_for(
            asyncio.gather(*(collect(cluster, p, params) for p in prompts)), 240)
        assert got == ref
        # the decode worker's reports name the last hand-off it read from the prefill worker
        # (its plans are stamped 1, 2, ...), so the dispatcher counts the unread ones
        for _ in range(100):
            read = cluster.reports[1].handoffs_read
            if read and read.get(0, 0) >= 30:
                break
            await asyncio.sleep(0.1)
        assert read is not None and read.get(0, 0) >= 30, read
    finally:
        await cluster.stop()


async def test_a_request_that_crashes_its_worker_fails_alone(tiny_llama):
    """A token id past the embedding (sent straight to the backend, as a buggy client of the
    Python API could) raises inside the worker's step. That request fails with a clear error
    after one crash; it is not re-run onto the restarted worker; others are served."""
    cluster = make_cluster(tiny_llama, "disaggregated", "cluster.restart_backoff_s=0.1")
    prompt = random_prompts(1, 8000, (20, 20), seed=35)[0]
    ref = hf_greedy(tiny_llama, [prompt], GREEDY.max_tokens)[0]
    await cluster.start()
    try:
        with pytest.raises(GenerationError, match="crashed a worker"):
            await asyncio.wait_for(collect(cluster, [5, 6, cluster.vocab_size + 7], GREEDY), 60)
        await until(lambda: cluster.num_restarts == 1, 30, "the crashed worker is restarted")
        assert await asyncio.wait_for(collect(cluster, prompt, GREEDY), 120) == ref
        assert cluster.num_restarts == 1
    finally:
        await cluster.stop()


async def test_requests_sharing_a_crashed_step_with_the_culprit_are_served(tiny_llama):
    """Regression: a crashing request prefilled in one chunk with three others made all four
    suspects; re-run together they shared the restarted worker's first chunk again, crashed it
    again, and all four failed. Now suspects re-run one at a time (the next once the one before
    has streamed two tokens or ended): only the culprit fails, the others equal transformers."""
    cluster = make_cluster(tiny_llama, "disaggregated", "cluster.restart_backoff_s=0.1")
    prompts = random_prompts(3, 8000, (8, 12), seed=52)
    ref = hf_greedy(tiny_llama, prompts, GREEDY.max_tokens)
    await cluster.start()
    try:
        kill(cluster, 0, signal.SIGSTOP)  # all four wait in its inbox: one chunk
        bad = asyncio.ensure_future(collect(cluster, [5, 6, cluster.vocab_size + 7], GREEDY))
        good = [asyncio.ensure_future(collect(cluster, p, GREEDY)) for p in prompts]
        await asyncio.sleep(0.3)
        kill(cluster, 0, signal.SIGCONT)
        with pytest.raises(GenerationError, match="crashed a worker"):
            await asyncio.wait_for(bad, 120)
        assert await asyncio.wait_for(asyncio.gather(*good), 120) == ref
        await until(lambda: cluster.num_restarts == 2, 30, "both crashed workers restarted")
        await asyncio.sleep(0.5)
        assert cluster.num_restarts == 2  # the shared chunk, then the culprit alone
    finally:
        await cluster.stop()


async def test_a_step_longer_than_the_stall_bound_is_not_a_stall(model_dir):
    """Regression: a worker sent nothing during a forward pass, so a step longer than
    ``monitor.stall_timeout_s`` (a long prompt on a CPU: seconds with a 1B model) had it killed
    as stalled, again on each re-run, and the request failed. A worker now stamps a heartbeat
    while it works: a 1500-token prompt (about a second here) in one step, under a 0.3 s bound,
    equals transformers with no stall; a SIGSTOP is still one."""
    path = model_dir("llama", "bench")  # 34M parameters: a long prompt takes a while
    prompt = random_prompts(1, 8000, (1500, 1500), seed=53)[0]
    ref = hf_greedy(path, [prompt], 4)
    cluster = make_cluster(path, "coupled", "monitor.interval_ms=20",
                           "monitor.stall_timeout_s=0.3", "cluster.restart_backoff_s=0.1")
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    await cluster.start()
    try:
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        assert [await asyncio.wait_for(collect(cluster, prompt, params), 120)] == ref
        assert loop.time() - t0 > 0.3  # the step did outlast the bound
        assert cluster.num_restarts == 0 and not any(h.stalled for h in cluster.workers.values())
        kill(cluster, 0, signal.SIGSTOP)
        await until(lambda: cluster.workers[0].stalled or cluster.num_restarts, 10,
                    "a stopped worker is a stall")
    finally:
        await cluster.stop()


async def test_manual_flips_under_load_never_kill_a_worker(tiny_llama):
    """Regression: a DecodeView (or a Handoff) that reached a worker just after it switched
    roles raised TypeError and killed it. 10 flips back and forth while requests flow."""
    cluster = make_cluster(tiny_llama, "disaggregated", "cluster.decode_workers=2",
                           "cluster.threads_per_worker=1", "flip.min_interval_s=0",
                           "monitor.interval_ms=20")
    prompts = random_prompts(6, 8000, (5, 120), seed=36)
    params = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
    ref = hf_greedy(tiny_llama, prompts, params.max_tokens)
    await cluster.start()
    try:
        stop = asyncio.Event()

        async def load() -> list[list[int]]:
            outs = []
            while not stop.is_set():
                outs += await asyncio.gather(*(collect(cluster, p, params) for p in prompts))
            return outs

        job = asyncio.create_task(load())
        role = "prefill"
        for _ in range(10):
            await asyncio.wait_for(cluster.flip(2, role), 60)
            role = "decode" if role == "prefill" else "prefill"
        stop.set()
        outs = await asyncio.wait_for(job, 120)
        assert outs and all(o == ref[i % len(prompts)] for i, o in enumerate(outs))
        assert cluster.num_restarts == 0
        assert len(cluster.flipper.history) == 10
    finally:
        await cluster.stop()


async def test_manual_flips_obey_the_cooldown(tiny_llama):
    cluster = make_cluster(tiny_llama, "disaggregated", "cluster.decode_workers=2",
                           "flip.min_interval_s=600")
    await cluster.start()
    try:
        from tetri_server.control.flip import FlipRefused

        await asyncio.wait_for(cluster.flip(2, "prefill"), 60)
        with pytest.raises(FlipRefused, match="less than 600 s ago"):
            await cluster.flip(2, "decode")
    finally:
        await cluster.stop()


def with_a_stall_bound(tiny_llama, num: int, seed: int):  # noqa: ANN001, ANN201
    """Two decode workers, one silent for 2 s is stalled; ``num`` greedy prompts of 10-100
    tokens and their transformers outputs: (cluster, prompts, params, reference)."""
    cluster = make_cluster(tiny_llama, "disaggregated", "cluster.decode_workers=2",
                           "monitor.stall_timeout_s=2", "cluster.restart_backoff_s=0.1")
    prompts = random_prompts(num, 8000, (10, 100), seed=seed)
    params = SamplingParams(max_tokens=80, temperature=0.0, ignore_eos=True)
    return cluster, prompts, params, hf_greedy(tiny_llama, prompts, params.max_tokens)


async def a_decoding_worker(cluster) -> int:  # noqa: ANN001
    """Once a request decodes: the decode worker it is on."""
    await until(lambda: any(r.state.value == "decode" and r.output_ids
                            for r in cluster.requests.values()), 60, "a request decodes")
    return next(r.owner for r in cluster.requests.values() if r.state.value == "decode")


async def test_a_stopped_decode_worker_is_noticed_and_its_streams_move(tiny_llama):
    """SIGSTOP of one of two decode workers under 12 streams: within seconds it is declared
    stalled (no new work, /health not ready), killed and restarted; its streams are re-run on
    the other and every output equals transformers."""
    cluster, prompts, params, ref = with_a_stall_bound(tiny_llama, 12, 37)
    await cluster.start()
    try:
        jobs = [asyncio.create_task(collect(cluster, p, params)) for p in prompts]
        victim = await a_decoding_worker(cluster)
        t0 = asyncio.get_running_loop().time()
        kill(cluster, victim, signal.SIGSTOP)
        await until(lambda: cluster.workers[victim].stalled or cluster.num_restarts, 20,
                    "the stopped worker is declared stalled")
        assert asyncio.get_running_loop().time() - t0 < 15
        assert not cluster.is_ready()
        got = await asyncio.wait_for(asyncio.gather(*jobs), 120)
        assert got == ref
        assert cluster.num_restarts == 1
        await until(cluster.is_ready, 60, "the stalled worker is back")
    finally:
        await cluster.stop()


async def test_a_stalled_worker_that_does_not_die_when_killed_is_taken_for_dead(tiny_llama):
    """A stalled worker stuck in the kernel (a GPU driver call) survives SIGKILL for as long
    as the call lasts. Regression: its streams waited for its exit, or for their timeout;
    now, 5 s after the kill, it is taken for dead: its streams are re-run on the other decode
    worker (outputs equal transformers); it restarts once it has really exited (until then it
    holds its memory). Emulated: SIGSTOP, and the stall check's kill does nothing."""
    cluster, prompts, params, ref = with_a_stall_bound(tiny_llama, 8, 41)
    await cluster.start()
    stuck = None
    try:
        jobs = [asyncio.create_task(collect(cluster, p, params)) for p in prompts]
        victim = await a_decoding_worker(cluster)
        stuck = cluster.workers[victim].proc
        stuck.kill = lambda: None  # type: ignore[method-assign]  # SIGKILL does not take
        kill(cluster, victim, signal.SIGSTOP)
        got = await asyncio.wait_for(asyncio.gather(*jobs), 60)
        assert got == ref
        assert stuck.poll() is None  # it never exited: it was taken for dead
        await asyncio.sleep(2.0)
        assert cluster.num_restarts == 0 and not cluster.is_ready()  # not beside it
        os.kill(stuck.pid, signal.SIGKILL)  # the stuck call returns: it exits
        await until(cluster.is_ready, 60, "the worker is back, restarted after its exit")
        assert cluster.num_restarts == 1
    finally:
        if stuck is not None and stuck.poll() is None:
            os.kill(stuck.pid, signal.SIGKILL)
            stuck.wait(10)
        await cluster.stop()


async def test_killing_one_of_two_prefill_workers_loses_nothing(tiny_llama):
    cluster = make_cluster(tiny_llama, "disaggregated", "cluster.prefill_workers=2",
                           "cluster.restart_backoff_s=0.1")
    prompts = random_prompts(16, 8000, (100, 300), seed=38)
    ref = hf_greedy(tiny_llama, prompts, GREEDY.max_tokens)
    await cluster.start()
    try:
        jobs = [asyncio.create_task(collect(cluster, p, GREEDY)) for p in prompts[:8]]
        await until(lambda: any(r.owner == 0 and r.state.value == "prefill"
                                for r in cluster.requests.values()), 30, "worker 0 prefills")
        kill(cluster, 0)
        await asyncio.sleep(0.05)
        jobs += [asyncio.create_task(collect(cluster, p, GREEDY)) for p in prompts[8:]]  # meanwhile
        got = await asyncio.wait_for(asyncio.gather(*jobs), 120)
        assert got == ref
    finally:
        await cluster.stop()


async def test_the_only_decode_worker_dying_is_not_an_outage(tiny_llama):
    """SIGKILL of the only decode worker: in-flight and new requests wait for its restart and
    are re-run from prompt + streamed tokens; every output equals transformers. (The strict
    split, so the long requests decode there rather than on the prefill worker.)"""
    cluster = make_cluster(tiny_llama, "disaggregated", "cluster.restart_backoff_s=0.1",
                           "cluster.worker_wait_s=120", *STRICT_SPLIT)
    prompts = random_prompts(10, 8000, (10, 150), seed=39)
    params = SamplingParams(max_tokens=300, temperature=0.0, ignore_eos=True)
    ref = hf_greedy(tiny_llama, prompts, params.max_tokens)
    await cluster.start()
    try:
        jobs = [asyncio.create_task(collect(cluster, p, params)) for p in prompts[:6]]
        await until(lambda: any(r.state.value == "decode" and r.output_ids
                                for r in cluster.requests.values()), 60, "a request decodes")
        kill(cluster, 1)
        await asyncio.sleep(0.05)
        jobs += [asyncio.create_task(collect(cluster, p, params)) for p in prompts[6:]]
        got = await asyncio.wait_for(asyncio.gather(*jobs), 180)
        assert got == ref
        assert cluster.num_restarts == 1
    finally:
        await cluster.stop()


async def test_without_a_restart_requests_get_a_retryable_error_in_bounded_time(tiny_llama):
    cluster = make_cluster(tiny_llama, "disaggregated", "cluster.restart_workers=false",
                           "cluster.worker_wait_s=2")
    prompt = random_prompts(1, 8000, (20, 20), seed=40)[0]
    await cluster.start()
    try:
        kill(cluster, 1)
        await until(lambda: not cluster.workers[1].alive, 10, "the kill is seen")
        t0 = asyncio.get_running_loop().time()
        with pytest.raises(WorkerUnavailableError) as e:
            await asyncio.wait_for(collect(cluster, prompt, GREEDY), 60)
        assert asyncio.get_running_loop().time() - t0 < 20
        assert e.value.retry_after_s >= 1
        assert cluster.requests == {}  # nothing left behind
    finally:
        await cluster.stop()


async def test_a_request_on_the_prefill_worker_when_the_decode_worker_dies_gets_a_503_in_time(
        tiny_llama):
    """Regression: a request routed while the decode worker was up had no bound on its wait
    for one. When the only decode worker then died (no restart), it waited on the prefill
    worker until server.request_timeout_s (600 s) and got a 500, where one routed a moment
    later got the documented 503 after ``cluster.worker_wait_s``."""
    cluster = make_cluster(tiny_llama, "disaggregated", "cluster.restart_workers=false",
                           "cluster.worker_wait_s=2", *STRICT_SPLIT)
    prompt = random_prompts(1, 8000, (20, 20), seed=42)[0]
    await cluster.start()
    try:
        kill(cluster, 0, signal.SIGSTOP)  # the request waits in the prefill worker's inbox
        task = asyncio.ensure_future(collect(cluster, prompt, GREEDY))
        await until(lambda: any(r.owner == 0 for r in cluster.requests.values()), 10,
                    "the request is routed to the prefill worker")
        kill(cluster, 1)
        await until(lambda: not cluster.workers[1].alive, 10, "the kill is seen")
        kill(cluster, 0, signal.SIGCONT)
        t0 = asyncio.get_running_loop().time()
        with pytest.raises(WorkerUnavailableError):
            await asyncio.wait_for(task, 60)
        assert asyncio.get_running_loop().time() - t0 < 30
        assert cluster.requests == {}
    finally:
        kill(cluster, 0, signal.SIGCONT)
        await cluster.stop()


async def test_with_the_prefill_worker_gone_the_decode_worker_serves_new_prompts(tiny_llama):
    """Elastic P/D (the default): while no prefill worker is serving, a new prompt goes to a
    decode worker with room, which prefills and decodes it itself, instead of waiting for a
    prefill worker and failing with a 503 after ``cluster.worker_wait_s``. The outputs equal
    transformers."""
    cluster = make_cluster(tiny_llama, "disaggregated", "cluster.restart_workers=false",
                           "cluster.worker_wait_s=2")
    prompts = random_prompts(3, 8000, (20, 90), seed=41)
    ref = hf_greedy(tiny_llama, prompts, GREEDY.max_tokens)
    await cluster.start()
    try:
        kill(cluster, 0)
        await until(lambda: not cluster.workers[0].alive, 10, "the kill is seen")
        got = await asyncio.wait_for(
            asyncio.gather(*(collect(cluster, p, GREEDY) for p in prompts)), 120)
        assert got == ref
        assert cluster.requests == {}
    finally:
        await cluster.stop()


async def test_requests_kept_on_the_prefill_worker_outlive_the_decode_outage_bound(tiny_llama):
    """Regression: a request routed while the only decode worker was down got a deadline
    (``cluster.worker_wait_s``) for a decode worker to take it. Kept on the prefill worker
    (elastic P/D: it decodes there), it streamed past that deadline and control cut its stream
    with a retryable error, though it never waited. Now a request that streams is not waiting:
    every token moves its deadline, and a serving decode worker clears it."""
    # cluster.worker_wait_s; monitor.interval_ms: it fails them. Long enough that a busy
    # machine's hiccup between two tokens does not pass it; far below the streams' length.
    wait_s, tick_s = 0.5, 0.1
    cluster = make_cluster(tiny_llama, "disaggregated", "cluster.restart_workers=false",
                           f"cluster.worker_wait_s={wait_s}")
    prompts = random_prompts(2, 8000, (20, 30), seed=47)
    params = SamplingParams(max_tokens=2000, temperature=0.0, ignore_eos=True)  # kept: > 128
    ref = hf_greedy(tiny_llama, prompts, params.max_tokens)
    await cluster.start()
    try:
        kill(cluster, 1)
        await until(lambda: not cluster.workers[1].alive, 10, "the kill is seen")
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        got = await asyncio.wait_for(
            asyncio.gather(*(collect(cluster, p, params) for p in prompts)), 120)
        assert loop.time() - t0 > wait_s + tick_s  # the streams outlived the bound
        assert got == ref
        assert cluster.requests == {}
    finally:
        await cluster.stop()


async def test_a_worker_that_keeps_dying_makes_the_server_give_up(tiny_llama):
    """Restart hygiene: back-off between restarts, and after cluster.max_restarts deaths in a
    row the cluster reports a fatal error (the CLI exits non-zero: systemd acts)."""
    cluster = make_cluster(tiny_llama, "disaggregated", "cluster.max_restarts=1",
                           "cluster.restart_backoff_s=0.1")
    await cluster.start()
    try:
        seg = cluster.workers[1].kv_segment
        kill(cluster, 1)
        await until(lambda: cluster.workers[1].generation == 1 and cluster.workers[1].is_ready,
                    60, "worker 1 restarted")
        assert cluster.workers[1].kv_segment != seg.replace("g0", "g1")  # names not guessable
        assert not cluster.fatal.done()
        kill(cluster, 1)
        await asyncio.wait_for(asyncio.shield(cluster.fatal), 30)
        assert "died 2 times in a row" in cluster.fatal.result()
    finally:
        await cluster.stop()


async def test_a_prompt_text_larger_than_a_ring_does_not_kill_the_channel(tiny_llama):
    """Regression: an AddRequest carrying a 5 MiB prompt text (for the predictor) did not fit
    the 4 MiB ring; the writer task died and the worker never heard from control again."""
    cluster = make_cluster(tiny_llama, "disaggregated")
    prompt = random_prompts(1, 8000, (20, 20), seed=41)[0]
    ref = hf_greedy(tiny_llama, [prompt], GREEDY.max_tokens)[0]
    await cluster.start()
    try:
        out: list[int] = []
        async for d in cluster.submit(prompt, GREEDY, prompt_text="x" * (5 << 20)):
            out.extend(d.token_ids)
        assert out == ref
        assert await asyncio.wait_for(collect(cluster, prompt, GREEDY), 60) == ref
    finally:
        await cluster.stop()


async def test_a_prefill_worker_whose_pool_is_full_of_held_kv_waits_instead_of_spinning(
        tiny_llama):
    """Regression (issue: the step loop was not honest): with its pool full of KV waiting for
    a stopped decode worker, the prefill worker spun and counted the spin as busy time, which
    feeds the flip rule and the benchmark's busy column. (The strict split: the four prompts
    all go to the prefill worker.)"""
    cluster = make_cluster(tiny_llama, "disaggregated", "model.max_model_len=512",
                           "kv.num_blocks=48", "monitor.stall_timeout_s=120",
                           "dispatch.policy=round-robin", *STRICT_SPLIT)
    prompts = random_prompts(4, 8000, (250, 260), seed=42)  # 16-17 blocks each: 2 fit
    ref = hf_greedy(tiny_llama, prompts, GREEDY.max_tokens)
    await cluster.start()
    try:
        jobs = await handoffs_to_a_stopped_decode_worker(
            cluster, prompts, lambda n: n >= 2 and cluster.reports[0].num_waiting > 0,
            "the prefill pool is full")
        await asyncio.sleep(0.5)
        busy0 = cluster.reports[0].busy_s
        await asyncio.sleep(3.0)
        assert cluster.reports[0].busy_s - busy0 < 0.5  # it waited; it did not spin
        kill(cluster, 1, signal.SIGCONT)
        assert await asyncio.wait_for(asyncio.gather(*jobs), 120) == ref
    finally:
        await cluster.stop()


async def test_a_flip_that_times_out_is_cancelled_on_the_worker(tiny_llama):
    """Regression: a flip whose drain outlasted control's bound was abandoned by control but
    the worker still switched roles later, silently. Now control tells it to cancel."""
    cluster = make_cluster(tiny_llama, "disaggregated", "cluster.decode_workers=2",
                           "flip.min_interval_s=0", *STRICT_SPLIT)
    prompt = random_prompts(1, 8000, (10, 10), seed=43)[0]
    long = SamplingParams(max_tokens=1500, temperature=0.0, ignore_eos=True)
    await cluster.start()
    try:
        job = asyncio.create_task(collect(cluster, prompt, long))
        await until(lambda: any(r.state.value == "decode" and r.output_ids
                                for r in cluster.requests.values()), 60, "the request decodes")
        busy = next(r.owner for r in cluster.requests.values())
        cluster.flipper.timeout_s = 0.3  # far shorter than the drain (the long decode)
        with pytest.raises(TimeoutError):
            await cluster.flip(busy, "prefill")
        out = await asyncio.wait_for(job, 120)
        assert len(out) == long.max_tokens
        await asyncio.sleep(1.0)  # a switch after the drain would have been reported by now
        assert cluster.workers[busy].role == "decode"
        assert busy not in cluster.draining and cluster.num_restarts == 0
    finally:
        await cluster.stop()


async def test_a_request_larger_than_a_ring_is_a_413_for_it_alone(tiny_llama, monkeypatch):
    """A message that cannot fit the worker's ring fails its request with RequestTooLarge
    (413 at the API) and the channel keeps working for everyone else."""
    import tetri_server.control.supervisor as supervisor
    from tetri_server.control.protocol import RequestTooLargeError

    monkeypatch.setattr(supervisor, "RING_BYTES", 48 * 1024)
    cluster = make_cluster(tiny_llama, "disaggregated")
    prompt = random_prompts(1, 8000, (20, 20), seed=44)[0]
    ref = hf_greedy(tiny_llama, [prompt], GREEDY.max_tokens)[0]
    await cluster.start()
    try:
        with pytest.raises(RequestTooLargeError):
            async for _ in cluster.submit(prompt, GREEDY, prompt_text="x" * 60_000):
                pass
        assert await asyncio.wait_for(collect(cluster, prompt, GREEDY), 60) == ref
    finally:
        await cluster.stop()


async def test_killing_a_prefill_worker_that_decodes_kept_requests_loses_nothing(tiny_llama):
    """Elastic P/D on (the prefill worker keeps long requests and decodes them itself): SIGKILL
    of that worker while kept requests are mid-stream; they are re-run from prompt + streamed
    tokens elsewhere and every output equals transformers. Every request is one a prefill
    worker keeps whatever the load (``local_finish_tokens``): the test relied on the prefill
    workers keeping what they prefilled before their first decode view, which they now get
    when they start (session 64)."""
    cluster = make_cluster(tiny_llama, "disaggregated", "cluster.prefill_workers=2",
                           "prefill.local_decode_batch=4", "prefill.local_decode_balance=false",
                           "prefill.local_finish_tokens=200", "cluster.restart_backoff_s=0.1")
    prompts = random_prompts(10, 8000, (10, 60), seed=41)
    params = SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True)
    ref = hf_greedy(tiny_llama, prompts, params.max_tokens)
    await cluster.start()
    try:
        jobs = [asyncio.create_task(collect(cluster, p, params)) for p in prompts]

        def kept_mid_stream() -> int | None:
            """A prefill worker streaming a request's 4th+ token: one it kept (a handed-off
            request's tokens after the first come from a decode worker)."""
            owners = {r.owner for r in cluster.requests.values()
                      if len(r.output_ids) > 3 and r.owner in cluster.reports
                      and cluster.reports[r.owner].role == "prefill"}
            return min(owners) if owners else None

        await until(lambda: kept_mid_stream() is not None, 60, "a kept request decoding")
        victim = kept_mid_stream()
        assert victim is not None
        kill(cluster, victim)
        got = await asyncio.wait_for(asyncio.gather(*jobs), 180)
        assert got == ref
        assert cluster.num_restarts >= 1
    finally:
        await cluster.stop()


async def test_a_seeded_sampled_stream_is_the_same_after_its_worker_dies(tiny_llama):
    """Seeded sampling (temperature 1): the same request with the same seed streams the same
    tokens when its decode worker is SIGKILLed mid-stream and it is re-run from prompt +
    streamed tokens (each draw depends on the seed and the token's index alone)."""
    cluster = make_cluster(tiny_llama, "disaggregated", "cluster.restart_backoff_s=0.1",
                           "cluster.worker_wait_s=120", *STRICT_SPLIT)
    [prompt] = random_prompts(1, 8000, (20, 40), seed=43)
    params = SamplingParams(max_tokens=120, temperature=1.0, seed=7, ignore_eos=True)
    await cluster.start()
    try:
        clean = await asyncio.wait_for(collect(cluster, prompt, params), 120)
        job = asyncio.create_task(collect(cluster, prompt, params))
        await until(lambda: any(r.state.value == "decode" and len(r.output_ids) > 10
                                for r in cluster.requests.values()), 60, "the stream decodes")
        kill(cluster, 1)
        got = await asyncio.wait_for(job, 180)
        assert cluster.num_restarts == 1
        assert got == clean and len(set(clean)) > 5  # it did sample, and resumed the same
    finally:
        await cluster.stop()


async def test_grammar_and_penalties_go_on_across_a_rerun_after_a_worker_death(tiny_llama):
    """Regression (wrong text with HTTP 200): a request re-run after its decode worker died
    prefills prompt + streamed tokens; its grammar restarted from the root and its presence
    and frequency penalties forgot the streamed tokens. Greedy, each request streams the same
    tokens as without the death, and the guided one still matches its pattern."""
    import re

    from transformers import AutoTokenizer

    from tetri_server.messages import Guide

    cluster = make_cluster(tiny_llama, "disaggregated", "cluster.restart_backoff_s=0.1",
                           "cluster.worker_wait_s=120", *STRICT_SPLIT)
    [prompt] = random_prompts(1, 8000, (20, 40), seed=44)
    pattern = "[a-z]{400}"
    cases = [SamplingParams(max_tokens=600, temperature=0.0, frequency_penalty=1.0,
                            presence_penalty=0.5, ignore_eos=True),
             SamplingParams(max_tokens=500, temperature=0.0, guide=Guide("regex", pattern))]
    await cluster.start()
    try:
        clean = [await asyncio.wait_for(collect(cluster, prompt, p), 120) for p in cases]
        jobs = [asyncio.create_task(collect(cluster, prompt, p)) for p in cases]
        await until(lambda: len(cluster.requests) == 2 and all(
            r.state.value == "decode" and len(r.output_ids) > 10
            for r in cluster.requests.values()), 60, "both streams decode")
        reqs = list(cluster.requests.values())
        kill(cluster, 1)
        got = await asyncio.wait_for(asyncio.gather(*jobs), 180)
        assert [r.num_reruns for r in reqs] == [1, 1]  # both were re-run mid-stream
        assert got == clean
        text = AutoTokenizer.from_pretrained(str(tiny_llama)).decode(
            clean[1], skip_special_tokens=True)
        assert re.fullmatch(pattern, text), text
    finally:
        await cluster.stop()


async def parked_behind_a_dead_prefill_worker(cluster, prompt: list[int]) -> asyncio.Task:
    """Kill worker 0 (the only prefill worker, no restart), then submit ``prompt``: the
    request is parked in the control process. Returns its collecting task."""
    kill(cluster, 0)
    await until(lambda: not cluster.workers[0].alive, 10, "the kill is seen")
    job = asyncio.create_task(collect(cluster, prompt, GREEDY))
    await until(lambda: len(cluster.table.parked) == 1, 10, "the request is parked")
    return job


async def test_a_request_parked_for_a_prefill_worker_goes_to_one_that_flips_to_prefill(tiny_llama):
    """Regression: with the only prefill worker down (strict split: no decode worker takes a
    prompt), a new request is parked. A decode worker flipped to prefill said Ready while
    control still counted it as draining, so the request was parked again, its deadline
    restarted, and it failed with a 503 though a prefill worker served."""
    cluster = make_cluster(tiny_llama, "disaggregated", "cluster.restart_workers=false",
                           "cluster.decode_workers=2", "cluster.worker_wait_s=20",
                           *STRICT_SPLIT)
    [prompt] = random_prompts(1, 8000, (20, 40), seed=45)
    [ref] = hf_greedy(tiny_llama, [prompt], GREEDY.max_tokens)
    await cluster.start()
    try:
        job = await parked_behind_a_dead_prefill_worker(cluster, prompt)
        await cluster.flip(1, "prefill")
        assert await asyncio.wait_for(job, 15) == ref  # not 20 s more of waiting, then a 503
    finally:
        await cluster.stop()


async def test_a_parked_request_counts_as_waiting_not_running(tiny_llama):
    """Regression: a request parked in the control process (its role's only worker down) is
    on no worker, so no report counts it as waiting, and the dashboard showed it running."""
    from prometheus_client.parser import text_string_to_metric_families

    from tests.integration.conftest import BASE
    from tetri_server.config import load_config
    from tetri_server.control.cluster import Cluster
    from tetri_server.metrics import Metrics

    cfg = load_config(None, ["cluster.mode=disaggregated", f"model.path={tiny_llama}", *BASE,
                             "cluster.restart_workers=false", "cluster.worker_wait_s=60",
                             *STRICT_SPLIT])
    metrics = Metrics("m")
    cluster = Cluster(cfg.resolve(cpu_count=os.cpu_count() or 1), metrics)

    def gauges() -> tuple[float, float]:
        got = {s.name: s.value
               for fam in text_string_to_metric_families(metrics.render().decode())
               for s in fam.samples}
        return got["tetri_num_requests_running"], got["tetri_num_requests_waiting"]

    [prompt] = random_prompts(1, 8000, (20, 40), seed=46)
    await cluster.start()
    try:
        job = await parked_behind_a_dead_prefill_worker(cluster, prompt)
        await until(lambda: gauges() == (0, 1), 10, "parked counted as waiting")
        job.cancel()
    finally:
        await cluster.stop()


async def test_hand_offs_from_a_dead_prefill_worker_run_again_where_its_memory_goes_with_it(
        tiny_llama):
    """Where a decode worker's mapping does not outlive the prefill worker that owns the pool
    (CUDA IPC: the owner's death frees it), the hand-offs it had sent and the decode worker
    had not pulled must run again, not be pulled from freed memory; the decode worker drops
    them, and whatever it still sends for them is not theirs. Here on shm with the cluster
    told so (``kv_outlives_owner``): the decode worker is stopped with hand-offs waiting, the
    prefill worker killed; every output equals transformers and each request ran again."""
    cluster = make_cluster(tiny_llama, "disaggregated", "model.max_model_len=512",
                           "kv.num_blocks=200", "monitor.stall_timeout_s=120",
                           "cluster.restart_backoff_s=0.1", *STRICT_SPLIT)
    cluster.kv_outlives_owner = False
    prompts = random_prompts(3, 8000, (40, 60), seed=47)
    ref = hf_greedy(tiny_llama, prompts, GREEDY.max_tokens)
    await cluster.start()
    try:
        jobs = await handoffs_to_a_stopped_decode_worker(
            cluster, prompts, lambda n: n == len(prompts), "every request handed off")
        kill(cluster, 0)
        await until(lambda: all(r.num_reruns == 1 for r in cluster.requests.values()), 30,
                    "every hand-off withdrawn")
        kill(cluster, 1, signal.SIGCONT)
        assert await asyncio.wait_for(asyncio.gather(*jobs), 120) == ref
    finally:
        await cluster.stop()


@pytest.mark.parametrize("mode", ["disaggregated", "coupled"])
async def test_a_grammar_that_allows_no_token_fails_its_request_alone(tiny_llama, mode):
    """Regression (review of session 64: a crash any client could repeat): a grammar that
    allows no next token (an impossible pattern, a rule with no base case) left the sampler
    a row with nothing allowed; the token it took was refused by the grammar, the step
    raised, and the worker died (the request then crashed a second one before failing
    alone). Now that request gets an error naming its grammar, at its first token (on a
    prefill worker) or later (on a decode worker); the others finish, and nothing restarts."""
    from tetri_server.messages import Guide

    cluster = make_cluster(tiny_llama, mode, *STRICT_SPLIT)
    prompts = random_prompts(2, 8000, (20, 40), seed=61)
    plain = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
    [ref] = hf_greedy(tiny_llama, prompts[:1], plain.max_tokens)
    dead = [Guide("regex", "[^\\s\\S]"), Guide("regex", "[a-z]{20}[^\\s\\S]")]
    await cluster.start()
    try:
        jobs = [asyncio.create_task(collect(cluster, prompts[0], plain))]
        jobs += [asyncio.create_task(collect(cluster, prompts[1], SamplingParams(
            max_tokens=60, temperature=0.0, guide=g))) for g in dead]
        got = await asyncio.wait_for(asyncio.gather(*jobs, return_exceptions=True), 120)
        assert got[0] == ref
        for error in got[1:]:
            assert isinstance(error, GenerationError), error
            assert isinstance(error, InvalidRequestError) and "grammar" in str(error), error
        assert "after 0 output tokens" in str(got[1])
        assert "after 0 output tokens" not in str(got[2])
        assert cluster.num_restarts == 0
        assert all(h.alive for h in cluster.workers.values())
    finally:
        await cluster.stop()


async def test_a_grammar_dead_end_on_a_prompt_the_decode_worker_prefilled_fails_it_alone(
        tiny_llama):
    """Regression (review of session 65's fix): a decode worker that prefills a prompt itself
    (elastic; here its only prefill worker is down) wrote the first token's predicted bucket
    on the step's last delta; a grammar with no first token has none, and the step raised
    (IndexError) and the worker died. Now that request alone fails, naming its grammar."""
    from tetri_server.messages import Guide

    cluster = make_cluster(tiny_llama, "disaggregated", "cluster.restart_workers=false")
    prompts = random_prompts(2, 8000, (20, 40), seed=62)
    plain = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    [ref] = hf_greedy(tiny_llama, prompts[:1], plain.max_tokens)
    await cluster.start()
    try:
        kill(cluster, 0)
        await until(lambda: not cluster.workers[0].alive, 10, "the kill is seen")
        dead = SamplingParams(max_tokens=20, temperature=0.0, guide=Guide("regex", "[^\\s\\S]"))
        with pytest.raises(InvalidRequestError, match="grammar"):
            await asyncio.wait_for(collect(cluster, prompts[1], dead), 60)
        assert await asyncio.wait_for(collect(cluster, prompts[0], plain), 60) == ref
        assert cluster.workers[1].alive
    finally:
        await cluster.stop()
