"""The paper's table (``sim/paper.py``) and the setting it alone uses: the paper's mock KV
hand-off (``SimConfig.mock_handoff``)."""

from __future__ import annotations

import dataclasses

import pytest

from tetri_server.sim.cluster import SimConfig, Simulation
from tetri_server.sim.cost import CostModel
from tetri_server.sim.instances import SimRequest
from tetri_server.sim.profiles import load_hardware, load_model
from tetri_server.sim.run import predict


def v100() -> CostModel:
    hw = load_hardware("V100-32GB")
    return CostModel(hw, load_model("OPT-13B"), hw.link("ts-roce"))


def burst(num: int) -> list[SimRequest]:
    return [SimRequest(i, 100, 400, 0.0) for i in range(num)]


def run(num: int, *, mock: bool) -> list[SimRequest]:
    # 64 blocks of 16 per instance: the decode instance has room for two of these requests
    # (prompt + predicted output), the prefill instance holds nine prompts' KV
    cfg = SimConfig(num_kv_blocks=64, mock_handoff=mock)
    reqs = burst(num)
    predict(reqs, cfg)
    Simulation(cfg, v100(), reqs).run()
    assert all(r.end_s is not None and r.error is None for r in reqs)
    return reqs


def test_the_mock_handoff_never_back_pressures_the_prefill_instance() -> None:
    """With decode full, the server's prefill instance holds prefilled prompts' KV until the
    decode side pulls it, its pool fills and new prompts wait (TTFT grows with the decode
    backlog); the paper's mock frees it at once, so every prompt is prefilled in the first
    chunks. The decode side is the bottleneck either way: the makespan stays."""
    server, mock = run(30, mock=False), run(30, mock=True)
    ttft_server = max(r.first_token_s - r.arrival_s for r in server)
    ttft_mock = max(r.first_token_s - r.arrival_s for r in mock)
    assert ttft_mock < 3.0 < 30.0 < ttft_server
    end_server, end_mock = max(r.end_s for r in server), max(r.end_s for r in mock)
    assert end_mock == pytest.approx(end_server, rel=0.05)


def test_the_mock_handoff_still_charges_the_transfer_to_the_decode_side() -> None:
    """One request, nothing to wait for: the same timeline (the KV still crosses the link)."""
    (server,), (mock,) = run(1, mock=False), run(1, mock=True)
    assert (mock.first_token_s, mock.end_s) == (server.first_token_s, server.end_s)
    cost = v100()
    no_link = CostModel(cost.hw, cost.model, dataclasses.replace(cost.link, bandwidth_Bps=1e30,
                                                                 latency_s=0.0))
    cfg = SimConfig(num_kv_blocks=64, mock_handoff=True)
    (fast,) = reqs = burst(1)
    predict(reqs, cfg)
    Simulation(cfg, no_link, reqs).run()
    assert mock.end_s - fast.end_s == pytest.approx(cost.handoff_s(100), rel=0.01)


def test_mock_handoff_is_refused_with_local_decode() -> None:
    with pytest.raises(ValueError, match="mock_handoff"):
        SimConfig(mock_handoff=True, local_decode_batch=4)


def test_paper_rows_use_the_mock_and_the_active_time_of_instances() -> None:
    from tetri_server.sim.paper import paper_row
    from tetri_server.sim.report import pct_delta

    row = paper_row("LPHD", v100(), num_requests=24)
    assert row["handoff"] == "mock" and row["config"]["mock_handoff"] is True
    t, b = row["tetri"], row["vllm_1"]
    assert row["resource_delta_pct"] == pytest.approx(pct_delta(t["active_s"], b["active_s"]))
    assert row["held_delta_pct"] == pytest.approx(pct_delta(t["resource_s"], b["resource_s"]))
    assert t["active_s"] < t["resource_s"]  # the prefill instance idles after light prompts
    server = paper_row("LPHD", v100(), num_requests=24, handoff="server")
    assert server["config"]["mock_handoff"] is False
    with pytest.raises(ValueError, match="handoff"):
        paper_row("LPHD", v100(), num_requests=4, handoff="instant")
