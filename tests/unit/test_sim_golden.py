"""The simulator decides as the real worker does: the golden decision traces of
``tests/unit/test_decision_trace.py`` (the real ``CoupledLoop`` with a fake runner, a fixed
arrival trace by step) replayed through the simulator's coupled instance must match line for
line. Timing cannot change these decisions: arrivals are counted in steps."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tests.unit.test_decision_trace import trace  # the same fixed trace
from tetri_server.sim.cluster import SimConfig, Simulation
from tetri_server.sim.cost import CostModel
from tetri_server.sim.coupled import CoupledInstance
from tetri_server.sim.instances import SimRequest
from tetri_server.sim.profiles import load_hardware, load_model

GOLDEN = Path(__file__).resolve().parent.parent / "golden"


def replay(mode: str) -> list[dict[str, Any]]:
    # CoupledLoop(token_budget=256, max_batch=8, max_prefill_tokens=1024), 96 blocks of 16
    cfg = SimConfig(mode=mode, num_instances=1, num_kv_blocks=96, block_size=16,
                    token_budget=256, max_batch=8, max_model_len=1024)
    sim = Simulation(cfg, CostModel(load_hardware("this-cpu"), load_model("tiny")), [])
    inst = sim.instances[0]
    assert isinstance(inst, CoupledInstance)
    got: list[dict[str, Any]] = []
    inst.decisions = got.append
    pending, step = trace(), 0
    while pending or inst.has_work():
        while pending and pending[0][0] <= step:
            _, req_id, n_prompt, n_out = pending.pop(0)
            inst.handle(("add", SimRequest(req_id, n_prompt, n_out, float(step))))
        if inst.start_step() is not None:
            inst.finish_step()
        step += 1
        assert step < 5000, "the trace did not finish"
    assert inst.alloc.num_free == 96
    return got


@pytest.mark.parametrize("mode", ["coupled", "coupled-chunked"])
def test_sim_coupled_instance_decides_as_the_real_coupled_loop(mode: str) -> None:
    want = [json.loads(line) for line in (GOLDEN / f"decisions-{mode}.jsonl").read_text()
            .splitlines()]
    got = replay(mode)
    assert any(r["preempt"] for r in got)
    for i, (g, w) in enumerate(zip(got, want, strict=False)):
        assert g == w, f"decision {i} differs:\n got  {g}\n want {w}"
    assert len(got) == len(want)
