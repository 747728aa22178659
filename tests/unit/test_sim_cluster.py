"""The simulated cluster: the real policies on a virtual clock, checked against hand-computed
timelines and invariants a user of the simulator relies on."""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import pytest

from tetri_server.bench.workload import WorkloadSpec
from tetri_server.policy import FlipPlan, Stage, calibration_rows
from tetri_server.sim.cli import main
from tetri_server.sim.cluster import MODES, SimConfig, Simulation
from tetri_server.sim.cost import CostModel, knee_chunk_size
from tetri_server.sim.disaggregated import DecodeInstance, PrefillInstance
from tetri_server.sim.instances import SimRequest, SimSeq
from tetri_server.sim.profiles import load_hardware, load_model
from tetri_server.sim.run import predict, simulate
from tetri_server.sim.workload import from_trace, from_workload


def v100() -> CostModel:
    hw = load_hardware("V100-32GB")
    return CostModel(hw, load_model("OPT-13B"), hw.link("ts-roce"))


def test_one_request_disaggregated_follows_the_cost_model_exactly() -> None:
    cost = v100()
    req = SimRequest(0, prompt_len=100, output_len=5, arrival_s=0.0, bucket=0)
    sim = Simulation(SimConfig(), cost, [req])
    result = sim.run()
    chunk_s = cost.step_s([(100, 0)], num_sampled=1)  # a 512 chunk run with its 100 tokens
    assert req.first_token_s == pytest.approx(chunk_s)
    end = chunk_s + cost.handoff_s(100)  # dispatched at once (view at t=0), pulled
    for ctx in range(100, 104):  # 4 decode steps, one token each
        end += cost.decode_s([ctx])
    assert req.end_s == pytest.approx(end)
    assert result.duration_s == pytest.approx(end)
    assert all(i.alloc.num_free == i.alloc.num_blocks for i in sim.instances)


def test_one_request_coupled_prefills_unpadded_then_decodes() -> None:
    cost = v100()
    req = SimRequest(0, prompt_len=100, output_len=3, arrival_s=1.0)
    Simulation(SimConfig(mode="coupled"), cost, [req]).run()
    ttft = cost.step_s([(100, 0)])
    assert req.first_token_s == pytest.approx(1.0 + ttft)
    assert req.end_s == pytest.approx(1.0 + ttft + cost.decode_s([100]) + cost.decode_s([101]))


def test_dispatcher_counts_its_own_dispatches_until_the_next_view() -> None:
    cost = v100()
    cfg = SimConfig(monitor_interval_ms=1000, num_kv_blocks=30)
    # bucket 1: 200 predicted tokens, so each reserves blocks_for(100 + 200) = 19 of 30
    first, second = (SimRequest(i, 100, 200, 0.0, bucket=1) for i in range(2))
    Simulation(cfg, cost, [first, second]).run()
    assert first.first_token_s == second.first_token_s < 0.5  # packed in one chunk
    # the t=0 view had room for one: 30 - 19 < 19, so the second did not decode beside it
    assert second.end_s > first.end_s + 1.0


@pytest.mark.parametrize("mode", MODES)
def test_every_mode_finishes_a_mixed_workload_and_frees_every_block(mode: str) -> None:
    cost = v100()
    cfg = SimConfig(mode=mode, num_prefill=2, num_decode=2, num_instances=3,
                    predictor_accuracy=0.749)
    reqs = from_workload(WorkloadSpec("Mixed", 40, 1, 2048, rate_rps=2.0))
    predict(reqs, cfg)
    sim = Simulation(cfg, cost, reqs)
    sim.run()
    assert all(r.error is None and r.end_s is not None for r in reqs)
    assert all(r.arrival_s < r.first_token_s <= r.end_s for r in reqs)
    assert all(i.alloc.num_free == i.alloc.num_blocks for i in sim.instances)
    assert sum(i.num_steps > 0 for i in sim.instances) == len(sim.instances)  # all got work


def test_a_small_pool_preempts_and_still_finishes() -> None:
    cost = v100()
    reqs = [SimRequest(i, 300, 400, 0.0, bucket=0) for i in range(8)]  # predicted 0: greedy-like
    for mode in ("disaggregated", "coupled"):
        cfg = SimConfig(mode=mode, num_kv_blocks=120, decode_policy="greedy")
        out = simulate(cfg, cost, reqs)
        assert out["num_completed"] == 8 and out["num_failed"] == 0
        assert out["num_preemptions"] > 0


def test_reserve_policies_use_the_prediction_and_avoid_preemption() -> None:
    cost = v100()
    reqs = [SimRequest(i, 300, 400, 0.0) for i in range(8)]
    # round-robin dispatch counts no output: the decode pool is over-committed, as the
    # power-of-two dispatcher (which counts the predictions too) never lets it be
    cfg = SimConfig(num_kv_blocks=120, predictor_accuracy=1.0, dispatch="round-robin")
    predict(reqs, cfg)
    assert {r.bucket for r in reqs} == {2}
    greedy = simulate(dataclasses.replace(cfg, decode_policy="greedy"), cost, reqs)
    static = simulate(dataclasses.replace(cfg, decode_policy="reserve-static"), cost, reqs)
    assert static["num_preemptions"] < greedy["num_preemptions"]
    assert static["num_completed"] == 8


def test_same_inputs_same_outputs() -> None:
    cost = v100()
    cfg = SimConfig(num_prefill=2, num_decode=3, predictor_accuracy=0.7)
    reqs = from_workload(WorkloadSpec("Mixed", 30, 2, 2048, rate_rps=1.0))
    predict(reqs, cfg)
    a, b = simulate(cfg, cost, reqs), simulate(cfg, cost, reqs)
    assert (a["ttft_mean_s"], a["jct_mean_s"]) == (b["ttft_mean_s"], b["jct_mean_s"])


def test_cli_compare_writes_every_mode(tmp_path) -> None:  # type: ignore[no-untyped-def]
    out = tmp_path / "out.json"
    assert main(["--hardware", "A100-80GB", "--model", "Llama-2-7B", "--workload", "Mixed",
                 "--rate", "4", "--num-requests", "20", "--prefill-instances", "1",
                 "--decode-instances", "2", "--compare", "coupled,coupled-chunked",
                 "--json", str(out)]) == 0
    got = json.loads(out.read_text())
    assert set(got["modes"]) == set(MODES)
    for mode, m in got["modes"].items():
        assert m["config"]["mode"] == mode
        assert m["num_completed"] == 20
        assert 0 < m["ttft_mean_s"] <= m["jct_mean_s"] and m["ttft_p90_s"] and m["tpot_mean_s"]
    assert got["modes"]["coupled"]["num_instances"] == 3  # equal hardware
    assert got["config"]["hardware"]["name"] == "A100-80GB"


def test_cli_trace_and_errors(tmp_path) -> None:  # type: ignore[no-untyped-def]
    trace = tmp_path / "t.jsonl"
    trace.write_text("".join(json.dumps({"arrival_s": t, "prompt_tokens": p,
                                         "output_tokens": o}) + "\n"
                             for t, p, o in ((0.5, 600, 20), (0.0, 30, 200), (0.2, 8, 1))))
    reqs = from_trace(trace)
    assert [(r.arrival_s, r.kind) for r in reqs] == [(0.0, "LPHD"), (0.2, "LPLD"), (0.5, "HPLD")]
    out = tmp_path / "o.json"
    assert main(["--hardware", "this-cpu", "--model", "bench", "--trace", str(trace),
                 "--mode", "coupled", "--instances", "1", "--json", str(out)]) == 0
    assert json.loads(out.read_text())["modes"]["coupled"]["num_completed"] == 3
    trace.write_text('{"arrival_s": 0, "prompt_tokens": 3}\n')
    assert main(["--trace", str(trace), "--json", str(out)]) == 2
    assert main(["--workload", "Mixed", "--rate", "1", "--compare", "vllm",
                 "--json", str(out)]) == 2


def test_paper_row_has_the_table_keys() -> None:
    from tetri_server.sim.paper import PAPER_DELTAS, paper_row

    row = paper_row("Mixed", v100(), num_requests=16)
    for key in ("ttft_delta_pct", "jct_delta_pct", "resource_delta_pct"):
        assert isinstance(row[key], float)
        assert isinstance(row["equal_hardware"][key], float)
    assert row["paper"]["ttft_delta_pct"] == PAPER_DELTAS["Mixed"][0]
    assert row["tetri"]["num_failed"] == row["vllm_1"]["num_failed"] == 0


def test_flip_moves_an_idle_prefill_instance_to_an_overloaded_decode_side(tmp_path) -> None:  # type: ignore[no-untyped-def]
    cost = v100()
    reqs = from_workload(WorkloadSpec("LPHD", 60, 0, 2048, rate_rps=0.6))
    base = SimConfig(num_prefill=3, num_decode=1, flip_window_s=5, flip_idle_s=5,
                     flip_min_interval_s=10)
    predict(reqs, base)
    off = Simulation(base, cost, [dataclasses.replace(r) for r in reqs]).run()
    sim = Simulation(dataclasses.replace(base, flip=True), cost,
                     [dataclasses.replace(r) for r in reqs])
    on = sim.run()
    assert off.flips == [] and on.flips and on.flips[0]["to"] == "decode"
    assert all(r.error is None for r in on.requests)
    assert on.duration_s < off.duration_s
    assert sum(i.role == "prefill" for i in sim.instances) >= 1  # never the last of a role
    assert all(i.alloc.num_free == i.alloc.num_blocks for i in sim.instances)
    out = tmp_path / "f.json"
    assert main(["--workload", "LPHD", "--rate", "0.6", "--num-requests", "60",
                 "--prefill-instances", "3", "--decode-instances", "1", "--flip",
                 "--flip-window-s", "5", "--flip-min-interval-s", "10", "--json", str(out)]) == 0
    assert json.loads(out.read_text())["modes"]["disaggregated"]["flips"]


def test_a_prompt_waiting_for_blocks_starts_when_the_pull_frees_them() -> None:
    """Regression: a blocked instance retries at its next report, but a message that frees
    blocks must wake it at once (a pending retry once swallowed the wake-up)."""
    cost = v100()
    cfg = SimConfig(monitor_interval_ms=1000, num_kv_blocks=20)
    first, second = (SimRequest(i, 200, 2, 0.0) for i in range(2))  # 13 blocks each of 20
    Simulation(cfg, cost, [first, second]).run()
    chunk_s = cost.step_s([(200, 0)], num_sampled=1)  # unpadded, as the worker runs it
    assert first.first_token_s == pytest.approx(chunk_s)
    pulled_s = chunk_s + cost.handoff_s(200)
    assert second.first_token_s == pytest.approx(pulled_s + chunk_s)


def test_a_handoff_on_a_stale_view_is_rejected_and_dispatched_again() -> None:
    cost = v100()
    cfg = SimConfig(num_prefill=2, num_decode=1, num_kv_blocks=20, monitor_interval_ms=1000)
    reqs = [SimRequest(i, 200, 30, 0.0) for i in range(2)]  # one per prefill instance
    sim = Simulation(cfg, cost, reqs)
    sim.run()
    # both saw 20 free blocks and sent 13 each: the second does not fit and comes back; the
    # view of 1 s still has the report of t=0 (the decode instance is inside a step at the
    # tick and reports when it ends, as a worker does), so it comes back once more
    assert sum(i.num_rejected for i in sim.prefills) == 2
    assert all(r.error is None and r.end_s is not None for r in reqs)
    assert max(r.end_s for r in reqs) > 2.0  # the views of 1 s and 2 s: room only at 2 s
    assert all(i.alloc.num_free == i.alloc.num_blocks for i in sim.instances)


def test_elastic_prefill_decodes_part_of_a_decode_heavy_load_itself() -> None:
    """LPHD on 1 prefill + 1 decode instance: the strict split queues every decode on one
    instance while the prefill one idles; with local decodes the prefill instance keeps some
    requests (never more than its batch), every request still finishes and the pools end
    empty, and the mean JCT drops."""
    hw = load_hardware("this-cpu")
    cost = CostModel(hw, load_model("bench"))
    cfg = SimConfig(decode_policy="greedy", max_model_len=1024, chunk_size=512)
    reqs = from_workload(WorkloadSpec("LPHD", 120, 1, 1024, rate_rps=0.4))
    strict = simulate(cfg, cost, reqs)
    sim = Simulation(dataclasses.replace(cfg, local_decode_batch=4), cost,
                     [dataclasses.replace(r) for r in reqs])
    sim.run()
    assert all(r.error is None and r.end_s is not None for r in sim.requests)
    assert all(i.alloc.num_free == i.alloc.num_blocks for i in sim.instances)
    prefill = sim.instances[0]
    assert isinstance(prefill, PrefillInstance)
    assert 0 < prefill.num_kept < len(reqs) and prefill.max_kept <= 4
    elastic_jct = sum(r.end_s - r.arrival_s for r in sim.requests) / len(reqs)
    assert elastic_jct < strict["jct_mean_s"]


def num_kept(workload: str, rate: float, **cfg_changes: object) -> int:
    """Requests the prefill instance kept on 60 requests of ``workload`` (elastic, batch 4),
    every one finished."""
    cost = CostModel(load_hardware("this-cpu"), load_model("bench"))
    cfg = SimConfig(decode_policy="greedy", max_model_len=1024, chunk_size=512,
                    local_decode_batch=4, **cfg_changes)  # type: ignore[arg-type]
    reqs = from_workload(WorkloadSpec(workload, 60, 1, 1024, rate_rps=rate))
    sim = Simulation(cfg, cost, reqs)
    sim.run()
    assert all(r.error is None and r.end_s is not None for r in sim.requests)
    prefill = sim.instances[0]
    assert isinstance(prefill, PrefillInstance)
    return prefill.num_kept


def test_elastic_prefill_hands_off_requests_too_short_to_gain() -> None:
    """LPLD (outputs <= 128 tokens): with the default min_tokens the prefill instance keeps
    none of them (the strict split's decisions); with min_tokens 0 it keeps some."""
    assert num_kept("LPLD", 2.0) == 0 < num_kept("LPLD", 2.0, local_decode_min_tokens=0)


def test_elastic_prefill_hands_kept_requests_back_when_prompts_queue() -> None:
    """Mixed at 1 req/s, any request worth keeping, whatever the load: with hand-back some kept
    requests move to the decode instance mid-decode (their KV with them) and still finish, the
    pools end empty; without it none moves."""
    cost = CostModel(load_hardware("this-cpu"), load_model("bench"))
    reqs = from_workload(WorkloadSpec("Mixed", 60, 1, 1024, rate_rps=1.0))

    def run(hand_back: bool) -> PrefillInstance:
        cfg = SimConfig(decode_policy="greedy", max_model_len=1024, chunk_size=128,
                        local_decode_batch=16, local_decode_min_tokens=0,
                        local_decode_max_prompt_share=1.0, local_decode_hand_back=hand_back)
        sim = Simulation(cfg, cost, [dataclasses.replace(r) for r in reqs])
        sim.run()
        assert all(r.error is None and r.end_s is not None for r in sim.requests)
        assert all(i.alloc.num_free == i.alloc.num_blocks for i in sim.instances)
        prefill = sim.instances[0]
        assert isinstance(prefill, PrefillInstance)
        return prefill

    assert run(False).num_handed_back == 0
    back = run(True)
    assert 0 < back.num_handed_back <= back.num_kept


def test_elastic_prefill_keeps_fewer_while_prompts_keep_it_busy() -> None:
    """HPHD at 1 req/s keeps the prefill instance ~30% busy with prompts: with a prompt share
    of 0.1 it keeps fewer requests than whatever the load (1.0, the default)."""
    assert (num_kept("HPHD", 1.0, local_decode_max_prompt_share=0.1)
            < num_kept("HPHD", 1.0, local_decode_max_prompt_share=1.0))


def test_elastic_prefill_with_balance_keeps_only_where_tokens_come_faster() -> None:
    """HPHD at 1 req/s: the decode instance reports its recent step; with balance the prefill
    instance keeps a request only while its own expected gap is shorter, so fewer than
    whatever the decode side's steps, but some (its decode-only steps are faster than a loaded
    decode instance's)."""
    everything = num_kept("HPHD", 1.0)
    assert 0 < num_kept("HPHD", 1.0, local_decode_balance=True) < everything


def test_elastic_prefill_runs_the_servers_balance_backlog_rule() -> None:
    """``local_decode_balance_backlog`` reaches the prefill instance's ``LocalDecode`` (the
    server's rule, unit-tested on hand-made views), and Mixed at 2.5 req/s, where more than
    a chunk of prompts often waits, then keeps other requests than with the backlog rule
    alone."""
    cost = CostModel(load_hardware("this-cpu"), load_model("bench"))
    for on in (False, True):
        sim = Simulation(SimConfig(local_decode_batch=4, local_decode_balance=True,
                                   local_decode_balance_backlog=on), cost, [])
        prefill = sim.instances[0]
        assert isinstance(prefill, PrefillInstance) and prefill.local is not None
        assert prefill.local.balance_backlog is on
    assert (num_kept("Mixed", 2.5, local_decode_balance=True)
            != num_kept("Mixed", 2.5, local_decode_balance=True,
                        local_decode_balance_backlog=True))


def test_the_default_keeps_requests_while_the_decode_instance_is_saturated() -> None:
    """Mixed at 2.5 req/s on this-cpu saturates the one decode instance while prompts keep the
    prefill instance over 30% busy: a prompt-share rule of 0.3 (the default to session 23)
    then keeps nothing and JCT ends ~19% above coupled's; the default (1: keep whatever the
    prompt load) stays within 5% of it."""
    cost = CostModel(load_hardware("this-cpu"), load_model("bench"))
    reqs = from_workload(WorkloadSpec("Mixed", 120, 1, 1024, rate_rps=2.5))

    def jct(cfg: SimConfig) -> float:
        return float(simulate(cfg, cost, [dataclasses.replace(r) for r in reqs])["jct_mean_s"])

    coupled = jct(SimConfig(mode="coupled", num_instances=2, max_model_len=1024))
    shipped = SimConfig(max_model_len=1024, chunk_size=256, local_decode_batch=16,
                        local_prefill_tokens=1024)
    assert shipped.local_decode_max_prompt_share == 1.0
    assert jct(shipped) <= 1.05 * coupled
    assert jct(dataclasses.replace(shipped, local_decode_max_prompt_share=0.3)) > 1.1 * coupled


def _shipped_sim_config(cost: CostModel, tmp_path: Any) -> SimConfig:
    """The simulator's config read from the repository's config.toml, as shipped."""
    from pathlib import Path

    from tetri_server.sim.cli import build_parser, sim_config

    config = Path(__file__).resolve().parents[2] / "config.toml"
    args = build_parser().parse_args(["--config", str(config), "--max-model-len", "1024",
                                      "--json", str(tmp_path / "out.json")])
    return sim_config(args, cost)


def test_the_shipped_config_keeps_requests_while_the_decode_instance_is_saturated(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """config.toml as shipped, Mixed at 2.5 req/s on this-cpu: the one decode instance is
    saturated while prompts keep the prefill instance over 30% busy. Sessions 41-52 shipped a
    prompt-share rule of 0.3, which then keeps nothing (1.29x coupled's JCT here); since session
    53 the rule is off (1.0) and the balance rule alone decides (1.08x)."""
    cost = CostModel(load_hardware("this-cpu"), load_model("bench"))
    shipped = _shipped_sim_config(cost, tmp_path)
    reqs = from_workload(WorkloadSpec("Mixed", 120, 1, 1024, rate_rps=2.5))

    def jct(cfg: SimConfig) -> float:
        return float(simulate(cfg, cost, [dataclasses.replace(r) for r in reqs])["jct_mean_s"])

    coupled = jct(SimConfig(mode="coupled", num_instances=2, max_model_len=1024))
    assert jct(shipped) <= 1.15 * coupled
    assert jct(dataclasses.replace(shipped, local_decode_max_prompt_share=0.3)) > 1.2 * coupled


def test_the_shipped_config_spreads_heavy_prompts_over_both_instances(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """HPLD at 2.5 req/s on this-cpu, with the chunk of 64 the server calibrates on the AMD VM,
    is more prompt work than one prefill instance does. The shipped config.toml (elastic; a
    prompt goes to the decode instance past 8 chunks of backlog while its step is at most twice
    its fastest) keeps mean JCT near coupled's (1.23x here); with session 41's margin of -1 (no
    prompt to the decode instance while the prefill one serves) the prompts queue on the one
    prefill instance (2.4x here; the server measured 3.75x at 2 req/s)."""
    cost = CostModel(load_hardware("this-cpu"), load_model("bench"))
    shipped = dataclasses.replace(_shipped_sim_config(cost, tmp_path), chunk_size=64)
    assert (shipped.local_prefill_margin, shipped.local_prefill_max_gap_x) == (8, 2)
    reqs = from_workload(WorkloadSpec("HPLD", 96, 1, 1024, rate_rps=2.5))

    def jct(cfg: SimConfig) -> float:
        return float(simulate(cfg, cost, [dataclasses.replace(r) for r in reqs])["jct_mean_s"])

    coupled = jct(SimConfig(mode="coupled", num_instances=2, max_model_len=1024))
    assert jct(shipped) <= 1.3 * coupled
    assert jct(dataclasses.replace(shipped, local_prefill_margin=-1)) > 2 * coupled


def test_elastic_decode_prefills_light_prompts_behind_a_backlog() -> None:
    """Long prompts back the prefill instance up; light ones arriving behind them are prefilled
    by the decode instance (at most 64 tokens a step) and start sooner than without."""
    cost = CostModel(load_hardware("this-cpu"), load_model("bench"))
    heavy = [SimRequest(i, 1000, 8, 0.0) for i in range(6)]
    light = [SimRequest(6 + i, 40, 8, 0.01 * i) for i in range(6)]
    cfg = SimConfig(decode_policy="greedy", max_model_len=2048, chunk_size=256,
                    monitor_interval_ms=5)
    strict = Simulation(cfg, cost, [dataclasses.replace(r) for r in heavy + light])
    strict.run()
    sim = Simulation(dataclasses.replace(cfg, local_prefill_tokens=64), cost,
                     [dataclasses.replace(r) for r in heavy + light])
    sim.run()
    assert all(r.error is None and r.end_s is not None for r in sim.requests)
    assert all(i.alloc.num_free == i.alloc.num_blocks for i in sim.instances)
    decode = sim.instances[1]
    assert isinstance(decode, DecodeInstance) and decode.num_prefilled > 0

    def light_ttft(s: Simulation) -> float:
        return sum(r.first_token_s - r.arrival_s for r in s.requests[6:]) / 6

    assert light_ttft(sim) < light_ttft(strict)


def test_elastic_decode_takes_no_prompt_while_its_steps_are_past_the_gap_bound() -> None:
    """``local_prefill_max_gap_x``: the simulated decode instance reports its step times as the
    worker does, and the shared pick stops sending it prompts while its recent step is past the
    bound (here its first slice beside four decoding requests already is)."""
    cost = CostModel(load_hardware("this-cpu"), load_model("bench"))
    early = [SimRequest(i, 20, 400, 0.0) for i in range(4)]  # decoding when the backlog comes
    heavy = [SimRequest(4 + i, 1000, 8, 0.5) for i in range(6)]
    light = [SimRequest(10 + i, 40, 8, 0.5 + 0.02 * i) for i in range(12)]
    cfg = SimConfig(decode_policy="greedy", max_model_len=2048, chunk_size=256,
                    monitor_interval_ms=5, local_prefill_tokens=64)

    def num_prefilled_on_decode(max_gap_x: float) -> int:
        sim = Simulation(dataclasses.replace(cfg, local_prefill_max_gap_x=max_gap_x), cost,
                         [dataclasses.replace(r) for r in early + heavy + light])
        sim.run()
        assert all(r.error is None and r.end_s is not None for r in sim.requests)
        decode = sim.instances[1]
        assert isinstance(decode, DecodeInstance)
        return decode.num_prefilled

    unbounded = num_prefilled_on_decode(0.0)
    assert unbounded > 0
    assert num_prefilled_on_decode(1.1) < unbounded


def test_refined_estimate_preempts_the_request_expected_to_run_longest() -> None:
    """A pool too small for five decodes: the bucket estimate preempts the newest request, the
    refined one (the g=200 artifact's tails) the one whose true bucket says it runs longest.
    Round-robin dispatch, which counts no predicted output, fills the pool."""
    cost = v100()
    reqs = [SimRequest(i, 300, n, 0.001 * i) for i, n in enumerate([700, 60, 60, 60, 60])]
    cfg = SimConfig(num_kv_blocks=110, decode_policy="greedy", dispatch="round-robin")
    predict(reqs, cfg)
    preempted: dict[str, list[dict[str, Any]]] = {}
    for estimate in ("bucket", "refined"):
        sim = Simulation(dataclasses.replace(cfg, decode_estimate=estimate), cost,
                         [dataclasses.replace(r) for r in reqs])
        decode = sim.instances[1]
        assert isinstance(decode, DecodeInstance)
        assert (decode.admission.tail is not None) == (estimate == "refined")
        lines = preempted[estimate] = []
        decode.decisions = lines.append
        sim.run()
        assert all(r.error is None and r.end_s is not None for r in sim.requests)
    assert {k: [rec["preempt"] for rec in recs if rec.get("preempt")]
            for k, recs in preempted.items()} == {"bucket": [[4]], "refined": [[0]]}


def test_refined_estimate_needs_an_artifact_of_the_granularity(tmp_path) -> None:  # type: ignore[no-untyped-def]
    cfg = SimConfig(mode="coupled", decode_estimate="refined", granularity=300)
    with pytest.raises(ValueError, match="granularity 300"):
        Simulation(cfg, v100(), [])
    coupled = Simulation(dataclasses.replace(cfg, granularity=400), v100(), []).instances[0]
    assert coupled.admission.tail is not None  # type: ignore[attr-defined]
    out = tmp_path / "o.json"
    argv = ["--hardware", "this-cpu", "--model", "bench", "--workload", "Mixed", "--rate", "4",
            "--num-requests", "6", "--mode", "coupled", "--no-progress",
            "--decode-estimate", "refined", "--json", str(out)]
    assert main(argv) == 0
    assert json.loads(out.read_text())["config"]["sim"]["decode_estimate"] == "refined"
    assert main([*argv[:-2], "--granularity", "300", "--json", str(out)]) == 2


def test_a_prompt_in_a_busy_decode_instances_inbox_stays_counted() -> None:
    """Regression: every instance used to report at every tick, even one inside a step, with
    no prompt stamp: a prompt routed to a decode instance in a long step was still in its inbox,
    missing from its report, so the global pick and the decode view dropped it (the prefill
    instance then handed requests off to wait behind it). Now an instance inside a step reports
    when the step ends, and a report counts only the prompts whose stamps it has handled."""
    cost = CostModel(load_hardware("this-cpu"), load_model("bench"))
    cfg = SimConfig(max_model_len=2048, chunk_size=256, local_prefill_tokens=1024)
    sim = Simulation(cfg, cost, [])
    for inst in sim.instances:
        sim.on_report(inst.report())  # as run() starts
    prefill, decode = sim.instances
    assert isinstance(prefill, PrefillInstance) and isinstance(decode, DecodeInstance)
    decode.busy = True  # inside a step: what arrives waits in its inbox
    sim.arrive(SimRequest(0, 1000, 8, 0.0))  # the prefill instance is idle: it takes it
    sim.arrive(SimRequest(1, 1000, 8, 0.0))  # 1000 queued there: sooner on the decode one
    assert [m[0] for m in decode.inbox] == ["add"]
    sim.tick()
    assert decode.report_due  # it reports when its step ends
    assert sim.picker.queued_tokens(decode.worker_id) == 1000
    assert prefill.book.view is not None
    assert prefill.book.view.decodes[0].num_queued_prompt_tokens == 1000
    sim.on_report(decode.report())  # sent before it read its inbox: the prompt stays counted
    assert sim.picker.queued_tokens(decode.worker_id) == 1000
    decode.take(decode.inbox.pop())
    sim.on_report(decode.report())  # its own count now
    assert decode.last_add_seq == 1 and sim.picker.queued_tokens(decode.worker_id) == 1000


def decisions_of(cfg: SimConfig, cost: CostModel, reqs: list[SimRequest],
                 instance: int) -> list[dict[str, Any]]:
    """The decision records of one instance over a simulation of ``reqs`` (copies), every
    request finished."""
    sim = Simulation(cfg, cost, [dataclasses.replace(r) for r in reqs])
    records: list[dict[str, Any]] = []
    sim.instances[instance].decisions = records.append
    sim.run()
    assert all(r.error is None and r.end_s is not None for r in sim.requests)
    return records


def test_elastic_decode_slices_follow_the_chunk_unless_fixed() -> None:
    """``local_prefill_slice``: a decode instance prefills at most ``chunk_size`` prompt tokens
    a step (``LocalPrefill.slice_tokens``, as the decode worker does with the chunk control
    sends), or ``local_prefill_tokens`` a step when fixed."""
    cost = CostModel(load_hardware("this-cpu"), load_model("bench"))
    reqs = [SimRequest(i, 1000, 8, 0.0) for i in range(6)]
    cfg = SimConfig(decode_policy="greedy", max_model_len=2048, chunk_size=128,
                    local_prefill_tokens=1024, monitor_interval_ms=5)

    def slice_sizes(c: SimConfig) -> list[int]:
        return [n for s in decisions_of(c, cost, reqs, 1) for _, _, n in s.get("slices", [])]

    chunked = slice_sizes(cfg)
    assert chunked and max(chunked) == 128
    assert max(slice_sizes(dataclasses.replace(cfg, local_prefill_slice="fixed"))) > 128


def test_elastic_prefill_steps_with_kept_rows_take_at_most_the_local_decode_chunk() -> None:
    """``local_decode_chunk``: a prefill instance's steps that carry its kept requests' rows
    take at most that many tokens, rows and prompt slices together (the worker's rule); without
    it they fill the chunk."""
    cost = CostModel(load_hardware("this-cpu"), load_model("bench"))
    reqs = from_workload(WorkloadSpec("Mixed", 60, 1, 1024, rate_rps=2.0))
    cfg = SimConfig(decode_policy="greedy", max_model_len=1024, chunk_size=256,
                    local_decode_batch=4, local_decode_min_tokens=0)

    def mixed_sizes(c: SimConfig) -> list[int]:
        return [len(s["run"]) + sum(n for _, _, n in s["slices"])
                for s in decisions_of(c, cost, reqs, 0)
                if s["kind"] == "mixed_step" and s["slices"]]

    assert max(mixed_sizes(cfg)) == 256
    limited = mixed_sizes(dataclasses.replace(cfg, local_decode_chunk=64))
    assert limited and max(limited) == 64
    # with a backlog bound, a longer backlog gets the whole chunk again
    grown = mixed_sizes(dataclasses.replace(cfg, local_decode_chunk=64,
                                            local_decode_full_chunk_backlog=300))
    assert max(grown) == 256 and min(grown) <= 64
    # with a share bound, steps take the whole chunk while prompts took little of the last
    # 10 s, and the cap once they took more (at 2 req/s both happen)
    shared = mixed_sizes(dataclasses.replace(cfg, local_decode_chunk=64,
                                             local_decode_full_chunk_share=0.3))
    assert max(shared) == 256 and min(shared) <= 64
    assert max(mixed_sizes(dataclasses.replace(cfg, local_decode_chunk=64,
                                               local_decode_full_chunk_share=1.0))) == 256


def test_elastic_prefill_finishes_requests_of_at_most_finish_tokens_itself() -> None:
    """``local_finish_tokens``: on Mixed at a load where the prompt-share rule keeps nothing
    else, every request of 2-16 tokens is kept and finishes on the prefill instance, none is
    dispatched; its steps beside such a request take at most 16 prompt tokens, the rows beside
    them (before session 43 the rows took from those 16); without the rule they are all handed
    off."""
    cost = CostModel(load_hardware("this-cpu"), load_model("bench"))
    reqs = from_workload(WorkloadSpec("Mixed", 60, 1, 1024, rate_rps=1.5))
    short = {r.req_id for r in reqs if 1 < r.output_len <= 16}
    assert len(short) >= 3
    cfg = SimConfig(decode_policy="greedy", max_model_len=1024, chunk_size=64,
                    local_decode_batch=16, local_decode_min_tokens=128,
                    local_decode_max_prompt_share=0.3, local_decode_balance=True,
                    local_decode_chunk=128)

    def kept_and_sent(c: SimConfig) -> tuple[set[int], set[int], list[dict[str, Any]]]:
        records = decisions_of(c, cost, reqs, 0)
        return ({d["req"] for d in records if d["kind"] == "keep"},
                {d["req"] for d in records if d["kind"] == "dispatch"}, records)

    kept, sent, _ = kept_and_sent(cfg)
    assert not kept & short and short <= sent
    kept, sent, records = kept_and_sent(dataclasses.replace(cfg, local_finish_tokens=16))
    assert short <= kept and not short & sent
    steps = [sum(n for _, _, n in d["slices"])
             for d in records if d["kind"] == "mixed_step" and set(d["run"]) & short]
    assert steps and max(steps) == 16


def test_with_hand_back_requests_that_finish_on_the_prefill_instance_stay_there() -> None:
    """``local_decode_hand_back`` with ``local_finish_tokens``: under Mixed's backlog the kept
    requests of 2-16 tokens are not handed back (they were, and kept again at once, every
    step), and none is dispatched."""
    cost = CostModel(load_hardware("this-cpu"), load_model("bench"))
    reqs = from_workload(WorkloadSpec("Mixed", 60, 1, 1024, rate_rps=1.5))
    short = {r.req_id for r in reqs if 1 < r.output_len <= 16}
    cfg = SimConfig(decode_policy="greedy", max_model_len=1024, chunk_size=64,
                    local_decode_batch=16, local_decode_min_tokens=128,
                    local_decode_max_prompt_share=0.3, local_decode_balance=True,
                    local_decode_chunk=128, local_decode_hand_back=True, local_finish_tokens=16)
    records = decisions_of(cfg, cost, reqs, 0)
    assert short <= {d["req"] for d in records if d["kind"] == "keep"}
    assert not short & {d["req"] for d in records if d["kind"] in ("hand_back", "dispatch")}


def test_elastic_prompt_first_runs_a_backlog_within_a_mixed_step_alone() -> None:
    """``local_decode_prompt_first``: a prefill instance with kept requests runs a pure chunk
    when every queued prompt token fits in a mixed step (the worker's rule,
    ``prompt_alone``), and mixes only a larger backlog; without it every step beside a kept
    request mixes."""
    cost = CostModel(load_hardware("this-cpu"), load_model("bench"))
    reqs = from_workload(WorkloadSpec("Mixed", 60, 1, 1024, rate_rps=2.0))
    cfg = SimConfig(decode_policy="greedy", max_model_len=1024, chunk_size=256,
                    local_decode_batch=4, local_decode_min_tokens=0, local_decode_chunk=64)

    def chunks_beside_kept(c: SimConfig) -> int:
        steps = [s for s in decisions_of(c, cost, reqs, 0)
                 if s["kind"] in ("chunk", "mixed_step")]
        ran = [set(s.get("run", ())) for s in steps]
        return sum(1 for i, s in enumerate(steps) if s["kind"] == "chunk"
                   and set().union(*ran[:i]) & set().union(*ran[i + 1:]))

    assert chunks_beside_kept(cfg) == 0
    assert chunks_beside_kept(dataclasses.replace(cfg, local_decode_prompt_first=True)) > 0


def mean_ttft_s(cfg: SimConfig, cost: CostModel, reqs: list[SimRequest], short: bool) -> float:
    """The mean time to first token of the prompts under 128 tokens (``short``) or the others,
    over a simulation of ``reqs`` (copies) in which every request finishes."""
    sim = Simulation(cfg, cost, [dataclasses.replace(r) for r in reqs])
    sim.run()
    assert all(r.error is None and r.end_s is not None for r in sim.requests)
    waits = [r.first_token_s - r.arrival_s for r in sim.requests
             if (r.prompt_len < 128) == short]
    return sum(waits) / len(waits)


def test_with_an_overtake_share_short_prompts_start_sooner_behind_long_ones() -> None:
    """``overtake_share`` in the simulator (the worker's ``Chunker``): short prompts ride in a
    started long one's next chunks; their mean time to first token drops, every request still
    finishes, and the long ones wait at most a little longer."""
    cost = CostModel(load_hardware("this-cpu"), load_model("bench"))
    reqs = from_workload(WorkloadSpec("Mixed", 120, 1, 1024, rate_rps=2.0))
    cfg = SimConfig(decode_policy="greedy", max_model_len=2048, chunk_size=256)

    def ttft_s(c: SimConfig, short: bool) -> float:
        return mean_ttft_s(c, cost, reqs, short)

    shared = dataclasses.replace(cfg, overtake_share=0.5)
    assert ttft_s(shared, short=True) < 0.8 * ttft_s(cfg, short=True)
    assert ttft_s(shared, short=False) < 1.2 * ttft_s(cfg, short=False)
    records = decisions_of(shared, cost, reqs, 0)
    assert any(any(s > 0 for _, s, _ in r["slices"]) and sum(s == 0 for _, s, _ in r["slices"])
               for r in records if r["kind"] == "chunk")


def test_srpt_and_finish_alone_start_short_prompts_sooner_in_the_strict_split() -> None:
    """``prefill.policy = "srpt"`` and ``prefill.finish_alone`` in the simulator (the worker's
    queue and ``Chunker``), on Mixed with a chunk of 64: prompts under 128 tokens reach their
    first token in under half the time they take in FCFS order, every request finishes, and
    the long ones wait at most a fifth longer on average."""
    cost = CostModel(load_hardware("this-cpu"), load_model("bench"))
    reqs = from_workload(WorkloadSpec("Mixed", 120, 1, 1024, rate_rps=1.5))
    cfg = SimConfig(max_model_len=2048, chunk_size=64)

    def ttft_s(c: SimConfig, short: bool) -> float:
        return mean_ttft_s(c, cost, reqs, short)

    srpt = dataclasses.replace(cfg, prefill_policy="srpt", finish_alone=True)
    assert ttft_s(srpt, short=True) < 0.5 * ttft_s(cfg, short=True)
    assert ttft_s(srpt, short=False) < 1.2 * ttft_s(cfg, short=False)


@pytest.mark.parametrize(("cluster", "elastic"), [("", True), ('elastic = "off"', False),
                                                   ('device = "cuda"', False),
                                                   ('device = "cuda"\nelastic = "on"', True)])
def test_the_simulator_reads_cluster_elastic_from_the_config(tmp_path, cluster, elastic) -> None:  # type: ignore[no-untyped-def]
    from tetri_server.sim.cli import build_parser, sim_config

    path = tmp_path / "c.toml"
    path.write_text(f"[cluster]\n{cluster}\n")
    args = build_parser().parse_args(["--config", str(path), "--json", str(tmp_path / "o")])
    sim = sim_config(args, v100())
    assert (sim.local_decode_batch, sim.local_prefill_tokens) == ((16, 1024) if elastic
                                                                  else (0, 0))


def test_the_simulator_buckets_as_the_configs_own_predictor_artifact(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """Regression (session 66 review): the simulator took the bucket count of a trained
    artifact of the shipped clip (6 at g=200) and the shipped artifact's tails whatever
    predictor.artifact the config named: one trained to 2048 tokens has 11 buckets on the
    server, and a 1500-token output was in bucket 7 there but in the open bucket 5 here."""
    import shutil

    from tetri_server.predictor import artifact
    from tetri_server.sim.cli import build_parser, sim_config

    src = artifact.resolve("arena_g200")
    for suffix in (".json", ".npz"):
        shutil.copy(src.with_suffix(suffix), tmp_path / f"long{suffix}")
    meta = json.loads((tmp_path / "long.json").read_text())
    meta.update(num_buckets=11, max_tokens=2048)
    (tmp_path / "long.json").write_text(json.dumps(meta))
    path = tmp_path / "c.toml"
    path.write_text(f'[predictor]\nkind = "oracle"\nartifact = "{tmp_path / "long"}"\n'
                    '[decode]\nestimate = "refined"\n')
    args = build_parser().parse_args(["--config", str(path), "--json", str(tmp_path / "o")])
    sim = sim_config(args, v100())
    assert (sim.granularity, sim.num_buckets) == (200, 11)
    assert sim.predictor_artifact == str(tmp_path / "long")
    assert SimConfig(granularity=200).num_buckets == 6  # no artifact named: the shipped clip


def test_the_cli_counts_slo_attainment_against_the_objectives_given(tmp_path, capsys) -> None:  # type: ignore[no-untyped-def]
    """``--slo-ttft-s`` / ``--slo-tpot-s`` as ``bench ablation`` takes them; the attainment is
    in the JSON and the printed table."""
    out = tmp_path / "o.json"
    argv = ["--hardware", "this-cpu", "--model", "bench", "--workload", "LPLD", "--rate", "1",
            "--num-requests", "8", "--no-progress", "--json", str(out)]
    attained = {}
    for ttft_s in (1e-6, 60.0):
        assert main([*argv, "--slo-ttft-s", str(ttft_s), "--slo-tpot-s", "60"]) == 0
        summary = json.loads(out.read_text())["modes"]["disaggregated"]["summary"]
        assert summary["slo"]["ttft_s"] == ttft_s
        attained[ttft_s] = summary["slo_attainment"]
        assert capsys.readouterr().out.split()[-1] == f"{attained[ttft_s]:.3f}"
    assert attained == {1e-6: 0.0, 60.0: 1.0}


def test_the_predictors_time_passes_when_no_chunk_fits() -> None:
    """Regression: a prefill instance whose pool is full predicted new arrivals in zero time
    (the predictor's cost rode only on a step), while the worker spends it either way."""
    cost = v100()
    sim = Simulation(SimConfig(num_kv_blocks=30), cost, [], predictor_cost=cost)
    prefill = sim.prefills[0]
    prefill.alloc.allocate(prefill.alloc.num_free)  # held prompts fill the pool
    prefill.book.add(0, SimSeq(SimRequest(0, 100, 10, 0.0), 100), 100, 0.0)  # an arrival
    step_s = prefill.start_step()
    assert step_s == sim.predictor_s([100]) > 0
    prefill.finish_step()
    assert prefill.book.ids(Stage.QUEUED) == [0] and prefill.start_step() is None


def test_a_draining_prefill_instance_hands_back_only_what_a_decode_instance_takes() -> None:
    """Regression (a review of the first fix): draining for a flip, a prefill instance handed
    every kept request back; with no decode room they sat held, decoding nowhere, until the
    flip timed out. Now one no decode instance takes goes on decoding here, and is tried
    again with the next view."""
    from tetri_server.messages import DecodeInstanceView, DecodeView

    sim = Simulation(SimConfig(num_kv_blocks=64, local_decode_batch=4), v100(), [])
    prefill = sim.prefills[0]
    seq = SimSeq(SimRequest(0, 100, 300, 0.0, bucket=1), 101, num_computed=100)
    prefill.book.add(0, seq, 100, 0.0, max_tokens=300)
    prefill.book.predicted(0, 1)
    prefill.book.prefilled(0)
    prefill._keep(0)
    full = DecodeView(1, [DecodeInstanceView(1, 0, 64, 0, 0, 0)])  # no room anywhere
    prefill.book.on_view(full)
    prefill._hand_back(prefill.local, draining=True)
    assert prefill.book.ids(Stage.DECODING) == [0] and 0 in prefill.admission
    roomy = DecodeView(2, [DecodeInstanceView(1, 64, 64, 0, 0, 0)])
    prefill.book.on_view(roomy)
    prefill._hand_back(prefill.local, draining=True)
    assert prefill.book.ids(Stage.HANDED_OFF) == [0] and 0 not in prefill.admission


def test_a_prefill_instance_recomputes_a_kept_request_within_its_step_cap() -> None:
    """Regression: a request the prefill instance keeps, preempted there, was recomputed up to
    ``recompute_tokens`` (256) a step beside the other kept rows, past the 64-token step cap
    of steps with kept rows (``local_decode_chunk``); now its slices fit what the rows leave
    (the server's prefill worker plans the same way)."""
    reqs = [SimRequest(i, 200, 300, i * 0.01, bucket=0) for i in range(8)]
    cfg = SimConfig(mode="disaggregated", num_kv_blocks=60, decode_policy="greedy",
                    local_decode_batch=4, local_decode_min_tokens=0, local_decode_chunk=64,
                    chunk_size=128)
    sim = Simulation(cfg, v100(), reqs)
    steps: list[dict[str, Any]] = []
    for inst in sim.instances:
        inst.decisions = steps.append
    sim.run()
    assert all(r.end_s is not None and r.error is None for r in sim.requests)
    mixed = [r for r in steps if r["kind"] == "mixed_step" and r.get("recompute_tokens")]
    assert len(mixed) >= 4  # a kept request preempted, recomputed over several steps
    for r in mixed:
        rows = r["recompute_tokens"]
        assert len(r["run"]) - len(rows) + sum(n for _, n in rows) <= 64, r


def test_decode_waiting_kv_first_switches_drops_of_waiting_kv_for_preemptions(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """``[decode] waiting_kv_first`` (new; the rule of session 49 had no switch): on, the KV
    of hand-offs waiting for admission goes before a running request is preempted, and counts
    as ``num_kv_drops``; off (``--no-waiting-kv-first``, or false in the config), a running
    request is preempted and the waiting keep their KV. Read from the config and the flag."""
    from tetri_server.sim.cli import build_parser, sim_config

    path = tmp_path / "c.toml"
    path.write_text("[decode]\nwaiting_kv_first = false\n")
    for argv, want in (([], True), (["--config", str(path)], False),
                       (["--config", str(path), "--waiting-kv-first"], True),
                       (["--no-waiting-kv-first"], False)):
        args = build_parser().parse_args([*argv, "--json", str(tmp_path / "o")])
        assert sim_config(args, v100()).waiting_kv_first is want, argv
    counts = {}
    for on in (True, False):
        reqs = [SimRequest(i, 300, 400, 0.0) for i in range(8)]
        cfg = SimConfig(num_kv_blocks=120, predictor_accuracy=1.0,
                        decode_policy="reserve-static", waiting_kv_first=on,
                        dispatch="round-robin")  # counts no output: fills the pool
        predict(reqs, cfg)
        out = simulate(cfg, v100(), reqs)
        assert out["num_completed"] == 8
        counts[on] = (out["num_preemptions"], out["num_kv_drops"])
    # off, a waiting head that cannot fit the pool at all still drops the KV behind it
    assert counts[True] == (0, 4) and counts[False] == (2, 1)


@pytest.mark.parametrize("mode", ["coupled", "disaggregated"])
def test_a_plan_that_only_preempts_is_followed_by_the_next_at_once(mode: str) -> None:
    """Regression (review of session 62): a step that only preempted (or failed) requests is
    progress, and the worker plans again at once (``last_step_ran``); the simulator waited for
    the next monitor tick (up to ``monitor_interval_ms`` of idle time in TTFT and JCT)."""
    cost = CostModel(load_hardware("this-cpu"), load_model("bench"))
    cfg = SimConfig(mode=mode, num_kv_blocks=10, recompute_tokens=0, decode_policy="greedy",
                    max_model_len=512, chunk_size=64)
    sim = Simulation(cfg, cost, [SimRequest(0, 60, 120, 0.0)])  # 180 tokens: 12 blocks
    got: list[tuple[float, dict[str, Any]]] = []
    for inst in sim.instances:
        inst.decisions = lambda r: got.append((sim.loop.now_s, r))
    sim.run()
    assert sim.requests[0].error is not None  # it no longer fits: preempted, then failed
    at = next(i for i, (_, r) in enumerate(got) if r.get("preempt"))
    assert got[at + 1][0] == got[at][0]  # the next plan at the same instant


def test_a_mixed_step_reports_the_size_it_was_planned_with() -> None:
    """Regression (review of session 62): the prefill instance reported a step with kept rows
    to ``LocalSteps`` at the size its rule gave after the step (no finishing rows, none
    running), where the worker reports the planned size; with ``local_finish_tokens`` the two
    differ, and so did the gaps the keep rule reads."""
    cost = CostModel(load_hardware("this-cpu"), load_model("bench"))
    cfg = SimConfig(decode_policy="greedy", max_model_len=1024, chunk_size=512,
                    local_decode_batch=4, local_finish_tokens=16, local_decode_chunk=128)
    sim = Simulation(cfg, cost, from_workload(WorkloadSpec("Mixed", 60, 1, 1024, rate_rps=2.0)))
    prefill = sim.instances[0]
    assert isinstance(prefill, PrefillInstance)
    last_planned: list[int] = [-1]
    steps: list[tuple[int, int, int]] = []  # (reported, planned, the size after the step)
    tokens_of = prefill.kept_step_tokens

    def spy_tokens(**kw: Any) -> int:
        n = tokens_of(**kw)
        if kw.get("finishing"):  # planning a mixed step: its last such call is its size
            last_planned[0] = n
        return n

    add = prefill.steps.add

    def spy_add(*args: Any, **kw: Any) -> None:
        if prefill._decode is not None:  # a step with kept rows
            steps.append((kw["wait_tokens"], last_planned[0], tokens_of()))
        add(*args, **kw)

    prefill.kept_step_tokens = spy_tokens  # type: ignore[method-assign]
    prefill.steps.add = spy_add  # type: ignore[method-assign]
    sim.run()
    assert steps and all(reported == planned for reported, planned, _ in steps)
    assert any(after != planned for _, planned, after in steps)  # the old report differed


def test_a_prompt_larger_than_the_pool_is_an_error_not_a_simulation_that_never_ends() -> None:
    """Regression (review of session 63): a prompt that can never have its blocks waited on
    the prefill side while the monitor's tick rescheduled itself forever (a worker refuses to
    start with such a pool)."""
    cost = CostModel(load_hardware("this-cpu"), load_model("bench"))
    for mode in ("disaggregated", "coupled"):
        with pytest.raises(ValueError, match="prompt of 400 tokens"):
            Simulation(SimConfig(mode=mode, num_kv_blocks=20), cost,
                       [SimRequest(0, 400, 4, 0.0)])


def test_flags_the_paper_table_and_the_comparison_cannot_honour_are_refused(
        capsys: pytest.CaptureFixture[str]) -> None:
    """Regression (review of session 63): ``sim --paper --num-requests 8 --seed 3`` ran the
    paper's 128 requests at seed 0 all the same; ``sim compare --chunk-size 0`` (the server's
    "calibrate") crashed with a bare ValueError."""
    from tetri_server.sim.versus import main as compare_main

    with pytest.raises(SystemExit):
        main(["--paper", "--num-requests", "8", "--seed", "3", "--json", "x.json"])
    assert "--num-requests, --seed" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        compare_main(["--model", "m", "--chunk-size", "0", "--json", "x.json"])
    assert "--chunk-size must be a size" in capsys.readouterr().err


def test_preemptions_of_an_instance_before_it_flipped_still_count() -> None:
    """Regression (review of session 63): the result read each instance's counts from the
    object in place at the end, and a flip replaces it: 37 preemptions reported of ~100."""

    from tetri_server.sim.cluster import Simulation as Sim
    from tetri_server.sim.report import mode_metrics
    from tetri_server.sim.run import predict

    cost = CostModel(load_hardware("V100-32GB"), load_model("OPT-13B"))
    reqs = [SimRequest(i, 100, 1500, 0.01 * i) for i in range(40)]  # a decode-heavy burst
    reqs += [SimRequest(i, 1800, 5, 60 + 0.3 * (i - 40)) for i in range(40, 140)]  # prompts
    cfg = SimConfig(num_prefill=1, num_decode=3, flip=True, flip_window_s=3, flip_idle_s=3,
                    flip_min_interval_s=2, decode_policy="greedy", dispatch="round-robin",
                    num_kv_blocks=200, seed=0)
    predict(reqs, cfg)
    sim = Sim(cfg, cost, reqs)
    replaced: list[int] = []
    switch = sim._switch

    def counted(wid, plan):  # noqa: ANN001, ANN202
        admission = getattr(sim.instances[wid], "admission", None)
        replaced.append(0 if admission is None else admission.load().num_preemptions)
        switch(wid, plan)

    sim._switch = counted  # type: ignore[method-assign]
    result = sim.run()
    final = sum(i.admission.load().num_preemptions for i in sim.instances
                if getattr(i, "admission", None) is not None)
    assert sum(replaced) > 0 and sim.flips
    assert mode_metrics(result, cfg)["num_preemptions"] == final + sum(replaced)


def test_no_hand_off_is_refused_for_a_report_that_predates_it() -> None:
    """Regression (review of session 63): a decode instance reports when its step ends, before
    it reads the hand-offs that came during the step; the dispatcher took such a report for one
    that counted them and over-filled the pool (6 refusals of 60 requests here)."""
    import random

    cost = CostModel(load_hardware("this-cpu"), load_model("bench"))
    rng = random.Random(1)
    reqs = [SimRequest(i, rng.randrange(20, 300), rng.randrange(20, 300), 0.05 * i)
            for i in range(60)]
    cfg = SimConfig(num_kv_blocks=80, monitor_interval_ms=5, predictor_accuracy=1.0,
                    max_model_len=1024)
    predict(reqs, cfg)
    sim = Simulation(cfg, cost, reqs)
    sim.run()
    assert all(r.error is None and r.end_s is not None for r in sim.requests)
    prefill = sim.instances[0]
    assert isinstance(prefill, PrefillInstance)
    assert prefill.num_rejected == 0


def test_a_flip_whose_drain_outlasts_the_servers_timeout_is_cancelled() -> None:
    """Review of session 64: the server cancels a drain after ``[server] drain_timeout_s`` +
    60 s and the worker serves its old role again, and routes the requests parked meanwhile;
    the simulator drained for ever (349 s and 604 s drains it reported as flips), and never
    routed a parked request again."""
    cost = CostModel(load_hardware("this-cpu"), load_model("bench"))
    sim = Simulation(SimConfig(flip=True, flip_timeout_s=1.0), cost, [SimRequest(0, 50, 5, 0.0)])
    busy = sim.instances[0]
    plan = FlipPlan(busy.worker_id, "prefill", "decode", 0.0)
    assert sim.flip_policy is not None
    sim.flip_policy.begin(plan)
    sim.draining[busy.worker_id] = plan
    sim._drain_start_s[busy.worker_id] = 0.0
    busy.is_drained = lambda: False  # type: ignore[method-assign]  # never drains
    sim.loop.after(2.0, lambda: sim.flip_step(sim._serving()))
    sim.run()
    assert not sim.draining and sim.flips[-1]["cancelled"] is True
    assert sim.requests[0].end_s is not None  # parked while it drained, routed after
    assert sim.flip_policy.refusal("prefill", 2, 2.5) is not None  # the cooldown started


def test_the_simulator_emulates_the_configs_predictor(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """Regression (review of session 64): ``sim --config`` read only heavy_decode_tokens of
    ``[predictor]``: every server config was simulated as a perfect oracle at g=200, whatever
    its artifact and kind (the default classifier's held-out accuracy is 0.33)."""
    from tetri_server.sim.cli import build_parser, sim_config

    def cfg(text: str, *flags: str) -> SimConfig:
        path = tmp_path / "c.toml"
        path.write_text(text)
        args = build_parser().parse_args(["--config", str(path), *flags,
                                          "--json", str(tmp_path / "o")])
        return sim_config(args, v100())

    classifier = cfg('[predictor]\nartifact = "arena_g400"\n')
    assert classifier.granularity == 400 and 0.2 < classifier.predictor_accuracy < 0.6
    oracle = cfg('[predictor]\nkind = "oracle"\n')
    assert (oracle.granularity, oracle.predictor_accuracy) == (200, 1.0)
    none = '[predictor]\nkind = "none"\n[decode]\npolicy = "greedy"\n'
    with pytest.raises(ValueError, match="predictor-accuracy"):
        cfg(none)
    assert cfg(none, "--predictor-accuracy", "0.5").predictor_accuracy == 0.5
    assert cfg("[server]\ndrain_timeout_s = 10\n").flip_timeout_s == 70.0


def test_the_sim_json_is_strict_and_its_folder_is_made(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """Review of session 64: ``--paper`` wrote ``"load": Infinity`` (not JSON); a missing
    ``--json`` folder lost the results after the whole run."""
    out = tmp_path / "new" / "o.json"
    assert main(["--workload", "LPLD", "--rate", "2", "--num-requests", "5",
                 "--no-progress", "--json", str(out)]) == 0
    json.loads(out.read_text())


def test_a_drained_instance_switches_at_once_not_at_the_next_tick() -> None:
    """Review of session 64: a worker switches role as soon as its loop finds it drained; the
    simulator checked only at the monitor tick (up to one interval later)."""
    cost = CostModel(load_hardware("this-cpu"), load_model("bench"))
    sim = Simulation(SimConfig(flip=True, num_prefill=2, monitor_interval_ms=1000), cost,
                     [SimRequest(0, 50, 5, 0.0)])
    idle = sim.instances[1]
    assert isinstance(idle, PrefillInstance)
    plan = FlipPlan(idle.worker_id, "prefill", "decode", 0.0)

    def drain() -> None:
        assert sim.flip_policy is not None
        sim.flip_policy.begin(plan)
        sim.draining[idle.worker_id] = plan
        sim._drain_start_s[idle.worker_id] = sim.loop.now_s
        idle.kick()

    sim.loop.at(0.3, drain)
    sim.run()
    [flip] = sim.flips
    assert flip["time_s"] == pytest.approx(0.3 + sim.cfg.flip_switch_s)


def test_a_hand_off_counts_as_read_and_in_the_load_from_its_reservation() -> None:
    """Review of session 64, twice. The simulated decode instance reserves a hand-off's blocks
    when it arrives and admits it when its KV has crossed the link; the worker reserves,
    copies, marks it read and admits it in one go. First the instance said it was read at
    arrival while its reported demand left it out (the dispatcher forgot it); then it said so
    only after the pull, so a report during the pull showed the blocks taken while the
    dispatcher still subtracted its plan for them too. Now a report during the pull marks it
    read and counts it as waiting, with its demand, as the worker's next report would."""
    cost = CostModel(load_hardware("this-cpu"), load_model("bench"))
    req = SimRequest(0, 300, 50, 0.0)
    sim = Simulation(SimConfig(), cost, [req])
    predict([req], sim.cfg)
    prefill, decode = sim.instances
    assert isinstance(decode, DecodeInstance)
    idle = decode.load_report()
    decode.handle(("handoff", prefill, req, 301, 7))
    pulling = decode.load_report()
    assert decode.pulling and pulling.handoffs_read == {prefill.worker_id: 7}
    assert pulling.num_free_blocks < idle.num_free_blocks and pulling.num_waiting == 1
    assert pulling.predicted_demand_blocks > 0
    assert pulling.num_heavy + pulling.num_light == 1
    sim.loop.run(until_s=decode.link_free_s)  # the KV crossed the link: admitted, the same
    assert not decode.pulling
    admitted = decode.load_report()
    assert admitted.handoffs_read == {prefill.worker_id: 7}
    assert (admitted.predicted_demand_blocks, admitted.num_waiting + admitted.num_running) == (
        pulling.predicted_demand_blocks, 1)


def test_an_instance_flipped_to_prefill_has_the_decode_view_before_it_keeps(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """Regression (review of session 64): the simulator's flipped prefill instance got its
    first decode view at the next tick, while the server sends it with the Ready
    (``Cluster._on_ready``): without a view it kept (elastic) what it prefilled meanwhile."""
    import random

    hw = load_hardware("V100-32GB")
    cost = CostModel(hw, load_model("OPT-13B"), hw.link("ts-roce"))
    cfg = SimConfig(num_prefill=1, num_decode=3, chunk_size=512, flip=True, flip_window_s=1.0,
                    flip_idle_s=1.0, flip_min_interval_s=1.0, local_decode_batch=16,
                    local_decode_min_tokens=0)
    rng = random.Random(2)
    reqs = [SimRequest(i, rng.randint(100, 300), rng.randint(150, 300), 2.0 + i * 0.004)
            for i in range(400)]
    for r in reqs:
        r.bucket = min(r.output_len // 200, 5)
    sim = Simulation(cfg, cost, reqs)
    keeps: list[bool] = []  # each keep: had the instance a view?
    real_keep = PrefillInstance._keep

    def keep(inst: PrefillInstance, req_id: int) -> Any:
        keeps.append(inst.book.view is not None)
        return real_keep(inst, req_id)

    monkeypatch.setattr(PrefillInstance, "_keep", keep)
    result = sim.run()
    assert result.flips[0]["to"] == "prefill" and len(keeps) > 10
    assert all(keeps)


def test_sim_calibrates_the_chunk_on_the_passes_the_prefill_worker_runs(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """Regression (review of session 64): ``sim --config`` (the server's chunk_size is 0)
    picked the knee of passes packed from 128-token prompts, while the prefill worker packs
    ``min(max_model_len - 1, 1024)``-token prompts (``calibrate.measure``): far less attention
    in the large passes, a 2-3x larger chunk (544 against 192 for the bench model here)."""
    cost = CostModel(load_hardware("this-cpu"), load_model("bench"))
    seen: list[list[tuple[int, int]]] = []
    step_s = cost.step_s

    def record(items, num_pad=0, num_sampled=None):  # noqa: ANN001, ANN202
        seen.append(list(items))
        return step_s(items, num_pad, num_sampled)

    cost.step_s = record  # type: ignore[method-assign]
    shipped = _shipped_sim_config(cost, tmp_path)  # --max-model-len 1024
    prompts = {n for items in seen for n, ctx in items if ctx == 0}
    riders = {ctx for items in seen for n, ctx in items if n == 1 and ctx > 0}
    assert max(prompts) == 1023 and riders <= {256}  # RIDER_CONTEXT, under 1023
    cost.step_s = step_s  # type: ignore[method-assign]
    assert shipped.chunk_size == knee_chunk_size(cost, 1023, calibration_rows(
        shipped.local_decode_batch, shipped.local_decode_chunk,
        shipped.local_decode_full_chunk_backlog, shipped.local_decode_full_chunk_share), 1023)


def test_a_decode_instance_slices_prompts_as_the_worker_does_with_no_prefill_serving() -> None:
    """Review of session 64: the simulated decode instance fixed its prompt slice once, at the
    prefill side's chunk; the worker takes it from each routed prompt's ``prefill_chunk``,
    which is 0 while no prefill worker serves (a flip, a restart): then it prefills up to
    ``decode.local_prefill_tokens`` a step."""
    import msgspec

    from tetri_server.policy import mixed_chunk

    cost = CostModel(load_hardware("this-cpu"), load_model("bench"))
    cfg = SimConfig(chunk_size=64, local_prefill_tokens=1024, local_prefill_slice="chunk")
    reqs = [SimRequest(i, 300, 20, 0.0) for i in range(2)]
    sim = Simulation(cfg, cost, reqs)
    predict(reqs, sim.cfg)
    prefill, decode = sim.instances
    assert isinstance(decode, DecodeInstance)
    for inst in sim.instances:
        sim.on_report(inst.report())
    sim.draining[prefill.worker_id] = FlipPlan(prefill.worker_id, "prefill", "decode", 0.0)
    sim.arrive(reqs[0])  # no prefill instance serves: the decode instance takes it
    assert reqs[0].req_id in decode.seqs and decode.prompt_budget == 1024
    del sim.draining[prefill.worker_id]
    sim.on_report(msgspec.structs.replace(prefill.report(), num_queued_prompt_tokens=10**6))
    sim.arrive(reqs[1])  # a long backlog there: the decode instance takes it too
    assert reqs[1].req_id in decode.seqs
    assert decode.prompt_budget == mixed_chunk(64, cfg.local_decode_chunk) < 1024
