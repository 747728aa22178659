"""The simulator's disaggregated instances decide as the real roles do: the fixed trace of
``tests/unit/test_decision_trace_disagg.py`` (a real ``PrefillRole`` and two real
``DecodeRole``s over fake workers, arrivals, decode views and message hops counted in steps)
replayed through the simulator's ``PrefillInstance`` and two ``DecodeInstance``s must give
``tests/golden/decisions-disaggregated.jsonl`` line for line: every chunk (slices, padding),
dispatch (decode worker, blocks, heavy), decode step (batch, admissions, preemptions, free
blocks) and its step number.

Nothing is normalised: the replay drives both sides in the same lock-step (one prefill step,
then the hand-offs forwarded, then per decode worker its acks forwarded and one step; a view
every third step), so no field depends on timing. The one thing the simulator does
differently is the KV pull, which takes link time on its virtual clock; here it lands at once,
as the real test's fake transport copies at once."""

from __future__ import annotations

import json
import random
from typing import Any

from tests.unit.test_decision_trace_disagg import GOLDEN
from tetri_server.config import PrefillConfig
from tetri_server.sim.cluster import SimConfig, Simulation, decode_view
from tetri_server.sim.cost import CostModel
from tetri_server.sim.disaggregated import DecodeInstance, PrefillInstance
from tetri_server.sim.instances import Instance, SimRequest
from tetri_server.sim.profiles import load_hardware, load_model


class LockStep(Simulation):
    """The simulation with its message hops taken out of the event loop: messages wait in
    ``outbox`` until the replay forwards them, and a pull lands at once."""

    def __init__(self, cfg: SimConfig) -> None:
        super().__init__(cfg, CostModel(load_hardware("this-cpu"), load_model("tiny")), [])
        self.outbox: list[tuple[Instance, tuple[Any, ...]]] = []

    def send(self, dst: Instance, msg: tuple[Any, ...]) -> None:
        self.outbox.append((dst, msg))

    def pull(self, dst: DecodeInstance, req_id: int, num_tokens: int) -> None:
        dst.handle(("kv_ready", req_id))

    def forward(self, dst: Instance) -> None:
        """Deliver the messages waiting for ``dst``, in the order they were sent."""
        for msg in [m for to, m in self.outbox if to is dst]:
            dst.handle(msg)
        self.outbox = [(to, m) for to, m in self.outbox if to is not dst]


def trace() -> list[tuple[int, int, int, int]]:
    """``test_decision_trace_disagg.replay``'s arrivals: (step, req_id, prompt, output)."""
    rng = random.Random(2401)
    pending, step = [], 0
    for req_id in range(30):
        step += rng.choice((0, 1, 2, 4))
        pending.append((step, req_id, rng.choice((5, 40, 120, 300)), rng.randint(1, 80)))
    return pending


def replay() -> list[str]:
    # the real test's workers: prefill 64 blocks, chunk 128, the default queue order, overtake
    # share and finish_alone; decode 48 blocks each, greedy, max batch 8; power-of-two dispatch
    # seeded 0 + worker id; predictor none (bucket 0)
    pre = PrefillConfig()
    cfg = SimConfig(mode="disaggregated", num_prefill=1, num_decode=2, num_kv_blocks=48,
                    block_size=16, chunk_size=128, decode_policy="greedy", max_batch=8,
                    prefill_policy=pre.policy, starve_tokens=pre.starve_tokens,
                    finish_alone=pre.finish_alone, dispatch="power-of-two", seed=0,
                    overtake_share=pre.overtake_share)
    sim = LockStep(cfg)
    prefill = sim.instances[0] = PrefillInstance(sim, 0, 64)
    decodes = sim.instances[1:]
    assert all(isinstance(d, DecodeInstance) for d in decodes)
    lines: list[str] = []
    for inst in sim.instances:
        inst.decisions = (lambda wid: lambda rec: lines.append(
            f"w{wid} " + json.dumps(rec, separators=(",", ":"))))(inst.worker_id)
    pending = trace()
    seq = step = 0
    while pending or not prefill.is_drained() or any(d.has_work() for d in decodes):
        while pending and pending[0][0] <= step:
            _, req_id, n, out = pending.pop(0)
            prefill.handle(("add", SimRequest(req_id, n, out, float(step))))
        if step % 3 == 0:
            seq += 1
            prefill.handle(("view", decode_view(seq, [d.load_report() for d in decodes])))
        if prefill.has_work() and prefill.start_step() is not None:
            prefill.finish_step()
        for d in decodes:  # control forwards the hand-offs, then the acks go back
            sim.forward(d)
        sim.forward(prefill)
        for d in decodes:
            if d.has_work() and d.start_step() is not None:
                d.finish_step()
        step += 1
        assert step < 5000, "the trace did not finish"
    assert all(i.alloc.num_free == i.alloc.num_blocks for i in sim.instances)
    return lines


def records(lines: list[str]) -> list[tuple[str, dict[str, Any]]]:
    return [(w, json.loads(rec)) for w, rec in (line.split(" ", 1) for line in lines)]


def test_sim_disaggregated_instances_decide_as_the_real_roles() -> None:
    want = records(GOLDEN.read_text().splitlines())
    got = records(replay())
    kinds = {r["kind"] for _, r in got}
    assert kinds >= {"chunk", "dispatch", "decode_step"}
    for i, (g, w) in enumerate(zip(got, want, strict=False)):
        assert g == w, f"decision {i} differs:\n got  {g}\n want {w}"
    assert len(got) == len(want)
