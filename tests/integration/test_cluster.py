"""The runtime with real processes: every mode equals transformers, KV really crosses processes,
no block or segment leaks, a killed worker loses no request."""

from __future__ import annotations

import asyncio
import os
import signal

import pytest

from tests.conftest import hf_greedy, random_prompts
from tests.integration.conftest import collect, make_cluster, segments
from tetri_server.control.protocol import GenerationError
from tetri_server.engine.ops.linear import tetri_linear_supported
from tetri_server.messages import SamplingParams

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)



async def wait_all_free(cluster, timeout_s: float = 30.0) -> dict[int, tuple[int, int]]:
    """Block usage per worker once fresh load reports show every pool empty (or the bound)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while True:
        usage = {w: (r.num_total_blocks - r.num_free_blocks, r.num_total_blocks)
                 for w, r in cluster.reports.items()}
        if all(u == 0 for u, _ in usage.values()) or loop.time() > deadline:
            return usage
        await asyncio.sleep(0.1)


async def serve_all_right_and_free(cluster, model, prompts: list[list[int]],
                                   params: SamplingParams, timeout_s: float) -> str:
    """Start ``cluster``, send every prompt at once: every output equals transformers', and
    every pool is empty after; stopped. Returns the run id (its segments are checked after)."""
    ref = hf_greedy(model, prompts, params.max_tokens)
    await cluster.start()
    try:
        got = await asyncio.wait_for(
            asyncio.gather(*(collect(cluster, p, params) for p in prompts)), timeout_s)
        assert got == ref
        usage = await wait_all_free(cluster)
        assert all(u == 0 for u, _ in usage.values()), usage
    finally:
        run_id = cluster.run_id
        await cluster.stop()
    return run_id


@pytest.mark.parametrize(("mode", "layout"), [
    ("disaggregated", "auto"), ("disaggregated", "token-major"), ("coupled", "auto"),
    ("coupled-chunked", "auto")])
async def test_every_mode_equals_transformers_and_frees_everything(tiny_llama, mode, layout):
    """(auto: head-major pools for the tiny model; token-major: the KV hand-off between two
    token-major pools)"""
    prompts = random_prompts(24, 8000, (1, 300), seed=11)
    run_id = await serve_all_right_and_free(
        make_cluster(tiny_llama, mode, f"kv.layout={layout}"), tiny_llama, prompts, GREEDY, 120)
    assert segments(run_id) == []


async def test_a_decode_worker_recomputes_a_preempted_request_in_slices(tiny_llama, tmp_path):
    """Memory pressure on the decode worker: its pool binds, a request is preempted and is
    recomputed at most ``decode.recompute_tokens`` a step beside the others (the decode
    worker's decision log), and every output still equals transformers."""
    import json
    from collections import Counter

    from tests.integration.conftest import STRICT_SPLIT

    prompts = random_prompts(6, 8000, (100, 120), seed=41)
    params = SamplingParams(max_tokens=60, temperature=0.0, ignore_eos=True)
    # round-robin dispatch checks room for the prompt and its first token only, so the decode
    # worker's pool binds as its requests grow (power-of-two counts what each will reserve)
    cluster = make_cluster(tiny_llama, "disaggregated", "kv.num_blocks=30",
                           "model.max_model_len=256", "decode.recompute_tokens=32",
                           "dispatch.policy=round-robin",
                           f"monitor.decision_log={tmp_path / 'decisions'}",
                           "kv.layout=token-major", *STRICT_SPLIT)
    await serve_all_right_and_free(cluster, tiny_llama, prompts, params, 180)
    steps = [json.loads(line) for line in (tmp_path / "decisions.w1.jsonl").open()]
    steps = [s for s in steps if s["kind"] == "decode_step"]
    assert any(s["preempt"] for s in steps)
    slices = [(r, n) for s in steps for r, n in s.get("recompute_tokens", ())]
    assert slices and max(n for _, n in slices) <= 32
    # every preempted context is over 100 tokens: at least 4 steps of at most 32
    assert min(Counter(r for r, _ in slices).values()) >= 4


def test_decode_output_depends_on_the_kv_it_attends_to(tiny_llama):
    """Why matching transformers in disaggregated mode proves the KV crossed processes: the
    decode step of this model gives other tokens when the prompt's KV is missing."""
    from tetri_server.llm import make_engine

    eng = make_engine(str(tiny_llama), "kv.num_blocks=200")
    prompt = random_prompts(1, 8000, (40, 40), seed=12)[0]
    eng.add_request(0, prompt, GREEDY)
    eng.step()  # prefill: KV of the prompt in the pool, first token sampled
    seq = eng.seqs[0]
    good = eng.runner.execute(_decode_plan(seq)).sampled[0]
    seq.num_computed -= 1  # run the same decode step again...
    eng.kv.zero_()  # as if the hand-off had copied nothing
    bad = eng.runner.execute(_decode_plan(seq)).sampled[0]
    assert good == hf_greedy(tiny_llama, [prompt], 2)[0][1]
    assert bad != good


def _decode_plan(seq):
    from tetri_server.engine.runner import ScheduledSeq, StepPlan

    return StepPlan([ScheduledSeq(seq, 1)])


async def test_killing_a_decode_worker_loses_no_request(tiny_llama):
    """With another decode worker up, every request of the killed one is re-run and finishes
    with the same greedy text."""
    cluster = make_cluster(tiny_llama, "disaggregated", "cluster.decode_workers=2")
    await cluster.start()
    prompts = random_prompts(16, 8000, (20, 200), seed=13)
    params = SamplingParams(max_tokens=60, temperature=0.0, ignore_eos=True)
    ref = hf_greedy(tiny_llama, prompts, params.max_tokens)
    try:
        tasks = [asyncio.create_task(collect(cluster, p, params)) for p in prompts]
        while not any(r.state.value == "decode" for r in cluster.requests.values()):
            await asyncio.sleep(0.005)
        busy = next(r.owner for r in cluster.requests.values() if r.state.value == "decode")
        decode = cluster.workers[busy]
        os.kill(decode.proc.pid, signal.SIGKILL)
        results = await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), 60)
        assert results == ref  # re-run from prompt + streamed tokens: same greedy text
        assert cluster.num_restarts == 1
        await asyncio.wait_for(_until_ready(cluster), 60)
        assert await collect(cluster, prompts[0], params) == ref[0]  # still serving
    finally:
        run_id = cluster.run_id
        await cluster.stop()
    assert segments(run_id) == []


async def _until_ready(cluster) -> None:
    while not cluster.is_ready():
        await asyncio.sleep(0.05)


async def test_stale_segments_of_a_crashed_control_process_are_removed(tiny_llama, tmp_path):
    """A control process and its workers killed with SIGKILL (the OOM killer, a power cut of
    the cgroup) leave segments; the next start removes them."""
    import subprocess
    import sys
    import textwrap

    script = tmp_path / "crash.py"
    script.write_text(textwrap.dedent(f"""
        import asyncio, os, signal, sys
        sys.path.insert(0, {str(os.getcwd())!r})
        from tests.integration.conftest import collect, make_cluster, until
        async def main():
            c = make_cluster({str(tiny_llama)!r}, "coupled")
            await c.start()
            print(c.run_id, flush=True)
            for h in c.workers.values():  # no worker lives to unlink its own segments
                os.kill(h.proc.pid, signal.SIGKILL)
            os.kill(os.getpid(), signal.SIGKILL)
        asyncio.run(main())
    """))
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                         timeout=120)
    run_id = out.stdout.strip().splitlines()[-1]
    assert segments(run_id), "the crashed run should have left its segments"
    cluster = make_cluster(tiny_llama, "coupled")
    await cluster.start()
    try:
        assert segments(run_id) == []
    finally:
        await cluster.stop()


async def test_oracle_predictor_and_reserve_admission(tiny_llama):
    """The oracle predictor takes the true length from the request; a request without one
    is a clear error for that request only (the worker keeps serving)."""
    cluster = make_cluster(tiny_llama, "disaggregated", "predictor.kind=oracle",
                           "decode.policy=reserve-dynamic")
    await cluster.start()
    prompt = random_prompts(1, 8000, (20, 20), seed=14)[0]
    try:
        out: list[int] = []
        async for d in cluster.submit(prompt, GREEDY, true_output_len=GREEDY.max_tokens):
            out.extend(d.token_ids)
        assert out == hf_greedy(tiny_llama, [prompt], GREEDY.max_tokens)[0]
        with pytest.raises(GenerationError, match="length predictor"):
            async for _ in cluster.submit(prompt, GREEDY):
                pass
        assert await collect_with_len(cluster, prompt) == out
    finally:
        await cluster.stop()


async def collect_with_len(cluster, prompt) -> list[int]:
    out: list[int] = []
    async for d in cluster.submit(prompt, GREEDY, true_output_len=5):
        out.extend(d.token_ids)
    return out


@pytest.mark.parametrize("mode", ["disaggregated", "coupled-chunked"])
async def test_a_sliding_window_model_is_served_right_past_its_window(model_dir, mode):
    """Regression: the workers served a Mistral whose sliding_window (64) is shorter than the
    prompt with full attention: other greedy text than transformers."""
    path = model_dir("mistral", sliding_window=64)
    prompts = random_prompts(6, 8000, (100, 300), seed=15)
    params = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
    ref = hf_greedy(path, prompts, params.max_tokens)
    cluster = make_cluster(path, mode)
    await cluster.start()
    try:
        got = await asyncio.wait_for(
            asyncio.gather(*(collect(cluster, p, params) for p in prompts)), 120)
        assert got == ref
    finally:
        await cluster.stop()


@pytest.mark.parametrize(("mode", "extra"), [("disaggregated", ()), ("coupled-chunked", ()),
                                             ("disaggregated", ("prefill.local_decode_batch=3",))])
async def test_prompt_logprobs_come_from_the_prefilling_worker_in_every_mode(tiny_llama, mode,
                                                                             extra):
    """Prompts split across 64-token chunks and packed with others (elastic on too: rows of
    requests the prefill worker keeps may share its chunks): their logprobs equal
    transformers' log_softmax of the whole prompt, then decoding goes on as usual."""
    prompts = random_prompts(6, 8000, (2, 150), seed=21)
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True, prompt_logprobs=2)
    cluster = make_cluster(tiny_llama, mode, *extra)
    await cluster.start()
    try:
        got = await first_deltas_and_tokens(cluster, prompts, params)
    finally:
        await cluster.stop()
    assert all(first.scheduled_s is not None for first, _ in got)
    assert_prompt_logprobs_equal_transformers(tiny_llama, prompts, got, 2)


async def first_deltas_and_tokens(cluster, prompts, params):  # noqa: ANN001, ANN201
    """Per prompt, streamed at once: (its first delta, all its output tokens), within 120 s."""

    async def one(p):  # noqa: ANN001, ANN202
        first, out = None, []
        async for d in cluster.submit(p, params):
            first = first or d
            out.extend(d.token_ids)
        return first, out

    return await asyncio.wait_for(asyncio.gather(*(one(p) for p in prompts)), 120)


def assert_prompt_logprobs_equal_transformers(model, prompts, got, k: int) -> None:  # noqa: ANN001
    """Greedy tokens equal transformers', and each first delta's prompt logprobs equal its
    log_softmax of the whole prompt, with ``k`` alternatives a token."""
    import torch
    from transformers import AutoModelForCausalLM

    assert [out for _, out in got] == hf_greedy(model, prompts, len(got[0][1]))
    hf = AutoModelForCausalLM.from_pretrained(str(model), dtype=torch.float32).eval()
    for p, (first, _) in zip(prompts, got, strict=True):
        with torch.inference_mode():
            logp = torch.log_softmax(hf(torch.tensor([p])).logits[0, :-1].float(), dim=-1)
        own = logp.gather(1, torch.tensor(p[1:])[:, None])[:, 0]
        lp = first.prompt_logprobs
        assert torch.allclose(torch.tensor(lp.logprobs), own, atol=1e-3, rtol=0)
        assert [len(r) for r in lp.top] == [k] * (len(p) - 1)


@pytest.mark.parametrize(("mode", "extra"), [("coupled", ()),
                                             ("disaggregated", ("prefill.chunk_size=512",))])
async def test_prompt_logprobs_bigger_than_the_ring_arrive_whole(tiny_llama, mode, extra,
                                                                 monkeypatch):
    """A prefill-first step (coupled) or a big chunk computes whole prompts: with 20 top
    logprobs each, one step's output is bigger than the worker's message ring (shrunk to
    64 KiB here, as a 32k-token prompt fills the 4 MiB one). It was one message, so the
    worker crashed and the requests failed; it goes in parts and every logprob arrives."""
    from tetri_server.control import supervisor

    monkeypatch.setattr(supervisor, "RING_BYTES", 64 << 10)
    prompts = random_prompts(4, 8000, (250, 300), seed=23)
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True, prompt_logprobs=20)
    cluster = make_cluster(tiny_llama, mode, *extra)
    await cluster.start()
    pids = [w["pid"] for w in cluster.monitor.workers_info()]
    try:
        got = await first_deltas_and_tokens(cluster, prompts, params)
        assert [w["pid"] for w in cluster.monitor.workers_info()] == pids  # none crashed
    finally:
        await cluster.stop()
    assert_prompt_logprobs_equal_transformers(tiny_llama, prompts, got, 20)


@pytest.mark.skipif(not tetri_linear_supported(), reason="batch invariance needs the C++ "
                    "packed linear")
async def test_batch_invariant_mode_gives_each_request_its_own_bits_in_a_busy_cluster(
        tiny_llama):
    """``model.batch_invariant``: 12 requests at once through a disaggregated cluster (chunks
    of 64 tokens packing several prompts, elastic P/D: kept rows beside chunks, hand-offs,
    decode batches) stream, per request, the tokens and logprobs the in-process engine gives
    that request alone with its prompt whole, bit for bit."""
    import torch

    from tetri_server.engine.ops import set_batch_invariant
    from tetri_server.llm import make_engine

    prompts = random_prompts(12, 8000, (1, 300), seed=12)
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=True)
    on = "model.batch_invariant=true"
    try:
        ref = []
        for p in prompts:
            eng = make_engine(str(tiny_llama), "cluster.mode=coupled", on, "kv.num_blocks=200")
            eng.add_request(0, p, params)
            got: tuple[list[int], list[float]] = ([], [])
            while eng.has_unfinished():
                for d in eng.step():
                    got[0].extend(d.token_ids)
                    got[1].extend(d.logprobs or [])
            ref.append(got)
        assert torch.ops.tetri.attention_rows_only()
    finally:
        set_batch_invariant(False, "cpu", torch.float32)
    assert not torch.ops.tetri.attention_rows_only()

    async def stream(p: list[int]) -> tuple[list[int], list[float]]:
        out: tuple[list[int], list[float]] = ([], [])
        async for d in cluster.submit(p, params):
            out[0].extend(d.token_ids)
            out[1].extend(d.logprobs or [])
        return out

    cluster = make_cluster(tiny_llama, "disaggregated", on)
    await cluster.start()
    try:
        got_all = await asyncio.wait_for(asyncio.gather(*(stream(p) for p in prompts)), 180)
    finally:
        await cluster.stop()
    assert all(len(t) == 12 for t, _ in got_all)
    assert got_all == ref
