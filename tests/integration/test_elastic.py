"""Elastic P/D (``prefill.local_decode_batch``): the prefill worker keeps some prefilled
requests and decodes them itself, the others go to the decode worker; every output still equals
transformers and nothing is left held."""

from __future__ import annotations

import asyncio
import json

from tests.conftest import hf_greedy, random_prompts
from tests.integration.conftest import collect, make_cluster, segments
from tests.integration.test_cluster import wait_all_free
from tetri_server.messages import SamplingParams

GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)


async def test_kept_and_handed_off_requests_both_equal_transformers(tiny_llama, tmp_path):
    prompts = random_prompts(20, 8000, (1, 200), seed=23)
    ref = hf_greedy(tiny_llama, prompts, GREEDY.max_tokens)
    log = tmp_path / "decisions"
    cluster = make_cluster(tiny_llama, "disaggregated", "prefill.local_decode_batch=3",
                           f"monitor.decision_log={log}")
    await cluster.start()
    try:
        got = await asyncio.wait_for(
            asyncio.gather(*(collect(cluster, p, GREEDY) for p in prompts)), 180)
        assert got == ref
        usage = await wait_all_free(cluster)
        assert all(u == 0 for u, _ in usage.values()), usage
    finally:
        run_id = cluster.run_id
        await cluster.stop()
    assert segments(run_id) == []
    records = [json.loads(line) for line in (tmp_path / "decisions.w0.jsonl").open()]
    kept = {r["req"] for r in records if r["kind"] == "keep"}
    sent = {r["req"] for r in records if r["kind"] == "dispatch"}
    # both paths ran (20 concurrent requests, a local batch of 3), and never for one request
    assert kept and sent and not kept & sent
    assert any(r["kind"] == "mixed_step" and r["run"] and r["slices"] for r in records), \
        "no step carried local decodes and prompt slices together"
    assert max(len(r["run"]) for r in records if r["kind"] == "mixed_step") <= 3
