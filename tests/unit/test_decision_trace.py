"""Golden decision traces: a fixed arrival trace replayed through the coupled loop (both
baseline modes) with a fake runner; its decisions (batches, admissions, preemptions, prompt
slices) must equal the committed file. A scheduling change shows up as a diff of that file;
regenerate it on purpose with ``TETRI_UPDATE_GOLDEN=1``."""

from __future__ import annotations

import json
import os
import random
import time
from pathlib import Path

import pytest
import torch

from tetri_server.config.scheduling import DecodeConfig
from tetri_server.engine.runner import StepPlan, StepResult
from tetri_server.kv.blocks import BlockAllocator
from tetri_server.kv.manager import KVCacheManager
from tetri_server.messages import SamplingParams
from tetri_server.workers.coupled import CoupledLoop
from tetri_server.workers.trace import DecisionLog

GOLDEN = Path(__file__).resolve().parent.parent / "golden"


class FakeRunner:
    """Advances every item like the model runner and samples a token that depends only on the
    sequence (its id and length), so decisions, not numerics, decide the trace."""

    def execute(self, plan: StepPlan) -> StepResult:
        sampled: list[int | None] = []
        for item in plan.items:
            seq = item.seq
            seq.num_computed += item.num_tokens
            done = seq.num_computed == len(seq.token_ids)
            sampled.append(5 + (seq.req_id * 31 + len(seq.token_ids)) % 100 if done else None)
        return StepResult(sampled, [None] * len(plan.items))


def trace() -> list[tuple[int, int, int, int]]:
    """(arrival step, request id, prompt tokens, output tokens): 24 requests, a busy pool."""
    rng = random.Random(2401)
    out, step = [], 0
    for req_id in range(24):
        step += rng.choice((0, 0, 1, 2, 5))
        out.append((step, req_id, rng.choice((5, 40, 120, 300, 700)), rng.randint(1, 60)))
    return out


def replay(chunked: bool) -> list[dict[str, object]]:
    lines: list[str] = []
    num_blocks, bs = 96, 16
    kv = KVCacheManager(BlockAllocator(num_blocks), torch.zeros(1, 2, 1, num_blocks * bs, 1), bs)
    loop = CoupledLoop(FakeRunner(), kv, (), 2048, torch.device("cpu"),  # type: ignore[arg-type]
                       chunked=chunked, token_budget=256, max_batch=8, max_prefill_tokens=1024,
                       recompute_tokens=DecodeConfig().recompute_tokens,  # the shipped default
                       decisions=DecisionLog(lines.append))
    pending = trace()
    step = 0
    while pending or loop.has_work():
        while pending and pending[0][0] <= step:
            _, req_id, n_prompt, n_out = pending.pop(0)
            prompt = [5 + (req_id + i) % 90 for i in range(n_prompt)]
            loop.add(req_id, prompt, SamplingParams(max_tokens=n_out, temperature=0.0,
                                                    ignore_eos=True), float(step))
        loop.step()
        step += 1
        assert step < 5000, "the trace did not finish"
    assert kv.allocator.num_free == num_blocks
    return [json.loads(line) for line in lines]


@pytest.mark.parametrize("mode", ["coupled", "coupled-chunked"])
def test_the_coupled_loop_decides_as_the_golden_trace_says(mode):
    got = replay(chunked=mode == "coupled-chunked")
    path = GOLDEN / f"decisions-{mode}.jsonl"
    if os.environ.get("TETRI_UPDATE_GOLDEN"):
        path.write_text("".join(json.dumps(r, separators=(",", ":")) + "\n" for r in got))
    want = [json.loads(line) for line in path.read_text().splitlines()]
    assert any(r["preempt"] for r in got), "the trace should exercise preemption"
    for i, (g, w) in enumerate(zip(got, want, strict=False)):
        assert g == w, f"decision {i} differs:\n got  {g}\n want {w}"
    assert len(got) == len(want)


def test_a_worker_killed_by_a_signal_keeps_every_record(tmp_path):
    """`sim compare` stops the server with SIGTERM to its process group; the workers' decision
    logs lost their last buffer (the prefill worker's log ended 41 chunks early)."""
    import signal
    import subprocess
    import sys

    code = (
        "import os, signal\n"
        "from tetri_server.workers.trace import DecisionLog\n"
        f"log = DecisionLog.open({str(tmp_path / 'd')!r}, 0)\n"
        "for i in range(200):\n"
        "    log.step = i\n"
        "    log.record('chunk', slices=[[i, 0, 512]], pad=0)\n"
        "os.kill(os.getpid(), signal.SIGTERM)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], timeout=60)
    assert proc.returncode == -signal.SIGTERM
    lines = (tmp_path / "d.w0.jsonl").read_text().splitlines()
    assert len(lines) == 200 and json.loads(lines[-1])["step"] == 199
    # a worker's log carries the machine's monotonic clock, so logs of two workers line up
    stamps = [json.loads(line)["t"] for line in lines]
    assert stamps == sorted(stamps) and 0 < stamps[0] <= time.monotonic()
