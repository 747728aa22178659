"""sim compare: the real server gets the settings the simulation runs, and the table is right."""

from __future__ import annotations

import json

import pytest

from tetri_server.config import load_config
from tetri_server.sim import decisions
from tetri_server.sim.versus import build_parser, rel_err, server_sets, sim_config, table


def test_server_settings_are_valid_config_and_mirror_the_simulation() -> None:
    args = build_parser().parse_args(["--model", "m", "--json", "o.json", "--chunk-size", "256",
                                      "--kv-blocks", "999", "--max-batch", "24"])
    cfg = load_config(None, server_sets(args))
    sim = sim_config(args)
    assert cfg.cluster.prefill_workers == sim.num_prefill == 1
    assert cfg.cluster.decode_workers == sim.num_decode == 1
    assert cfg.prefill.chunk_size == sim.chunk_size == 256
    assert cfg.prefill.sched_batch == sim.sched_batch
    assert cfg.kv.num_blocks == sim.num_kv_blocks == 999
    assert cfg.kv.block_size == sim.block_size
    assert cfg.decode.max_batch == sim.max_batch == 24
    assert cfg.decode.policy == sim.decode_policy
    assert cfg.monitor.interval_ms == sim.monitor_interval_ms
    assert cfg.predictor.kind == "oracle" and sim.predictor_accuracy == 1.0


def test_every_key_the_simulator_models_is_the_servers_own() -> None:
    """Regression: the simulation pinned only some keys, so it ran overtake_share 0 and
    finish_alone off while the server ran its defaults (0.5, on): the 'decision sequences
    must be identical' check could not pass."""
    from tetri_server.sim.cli import CONFIG_KEYS

    args = build_parser().parse_args(["--model", "m", "--json", "o.json"])
    cfg = load_config(None, server_sets(args)).resolve(cpu_count=2)
    sim = sim_config(args)
    for (section, key), name in CONFIG_KEYS.items():
        if (section, key) != ("cluster", "workers"):
            assert getattr(sim, name) == getattr(getattr(cfg, section), key), (section, key)
    assert (sim.overtake_share, sim.finish_alone) == (cfg.prefill.overtake_share, True)


def test_table_shows_relative_error_of_the_simulation_per_real_run() -> None:
    keys = ("ttft_mean_s", "ttft_p90_s", "tpot_mean_s", "tpot_p90_s", "jct_mean_s", "jct_p90_s")
    sim = dict.fromkeys(keys, 1.1)
    reals = [{**dict.fromkeys(keys, 1.0), "others_cores": 0.5},
             {**dict.fromkeys(keys, 2.2), "others_cores": None}]
    text = table(sim, reals)
    assert "| ttft_mean_s | 1.100 | 1.000 | +10% | 2.200 | -50% |" in text
    assert "0.50" in text
    assert rel_err(None, 1.0) is None and rel_err(1.0, 0.0) is None


def test_by_class_means_count_only_completed_requests() -> None:
    from tetri_server.bench.client import RequestRecord
    from tetri_server.sim.versus import by_class

    def rec(i: int, kind: str, first: float, end: float | None) -> RequestRecord:
        return RequestRecord(request_id=i, kind=kind, prompt_len=10, output_len=5, arrival_s=0.0,
                             send_s=0.0, first_token_s=first, end_s=end, num_output_tokens=5)

    out = by_class([rec(0, "LPLD", 0.1, 1.0), rec(1, "LPLD", 0.3, 2.0),
                    rec(2, "HPHD", 0.5, None)])
    assert out == {"LPLD": {"num": 2, "ttft_mean_s": pytest.approx(0.2),
                            "jct_mean_s": pytest.approx(1.5)}}


# ---------------------------------------------------------------- decision logs (sim/decisions.py)


def _log(*recs: tuple[int, str, dict]) -> list[tuple[int, dict]]:
    return [(wid, {"step": i, "kind": kind, **fields}) for i, (wid, kind, fields) in
            enumerate(recs)]


REAL = _log(
    (0, "chunk", {"slices": [[7, 0, 300], [8, 0, 100]], "pad": 112}),
    (0, "dispatch", {"req": 7, "to": 1, "blocks": 20, "heavy": False}),
    (0, "chunk", {"slices": [[8, 100, 12]], "pad": 500}),
    (0, "dispatch", {"req": 8, "to": 2, "blocks": 8, "heavy": True}),
    (1, "decode_step", {"run": [7], "admit": [7], "preempt": [], "fail": [], "free": 90}),
    (2, "decode_step", {"run": [8], "admit": [8], "preempt": [], "fail": [], "free": 40}),
    (1, "decode_step", {"run": [7], "admit": [], "preempt": [], "fail": [], "free": 90}),
    (2, "decode_step", {"run": [], "admit": [], "preempt": [8], "fail": [], "free": 48}),
)


def test_decision_summary_counts_each_kind() -> None:
    from tetri_server.sim.decisions import summarize

    s = summarize(REAL, chunk_size=512)
    assert s["num_chunks"] == 2 and s["num_slices"] == 3 and s["num_padded_chunks"] == 2
    assert s["chunk_fill_mean"] == pytest.approx((400 + 12) / 1024)
    assert s["num_dispatches"] == 2 and s["dispatches_per_decode"] == {"1": 1, "2": 1}
    assert s["num_heavy_dispatches"] == 1
    assert s["num_decode_steps"] == 4 and s["decode_batch_mean"] == pytest.approx(3 / 4)
    assert s["num_admissions"] == 2 and s["num_preemptions"] == 1 and s["num_failed"] == 0
    assert s["num_kv_drops"] == 0


def test_decision_summary_tells_a_preemption_from_a_waiting_requests_kv_drop() -> None:
    """A ``preempt`` id that ran in the worker's previous step was running (a preemption);
    any other was waiting for admission (its KV dropped), as ``tetri_preemptions`` and
    ``tetri_waiting_kv_drops`` count them. Counted per worker."""
    from tetri_server.sim.decisions import summarize

    log = [(wid, {"step": i, "kind": "decode_step", **r}) for i, (wid, r) in enumerate((
        (1, {"run": [1, 2], "preempt": []}),
        (2, {"run": [3], "preempt": []}),  # 3 runs on worker 2, not on worker 1
        (1, {"run": [1], "preempt": [2, 4]}),  # 2 ran: preempted; 4 waited: dropped
        (1, {"run": [1], "preempt": [3]}),  # 3 never ran here: dropped
    ))]
    s = summarize(log, chunk_size=512)
    assert (s["num_preemptions"], s["num_kv_drops"]) == (1, 2)


def test_decisions_compare_leaves_out_what_timing_changes() -> None:
    """Step numbers, free blocks, batch membership and the request numbering differ between a
    real run and a simulation; the decisions themselves must match, and a different one is
    found where it is."""
    from tetri_server.sim.decisions import compare

    sim = [(wid, {**r, "step": r["step"] * 3 + 1}) for wid, r in REAL]
    sim = [(wid, {**r, **({"free": 0, "run": []} if "free" in r else {})}) for wid, r in sim]
    shift = {7: 107, 8: 108}  # numbered from another start, in the same order
    sim = [(wid, {**r, **({"req": shift[r["req"]]} if "req" in r else {}),
                  **({"slices": [[shift[a], b, c] for a, b, c in r["slices"]]}
                     if "slices" in r else {}),
                  **{k: [shift[x] for x in r[k]] for k in ("admit", "preempt") if k in r}})
           for wid, r in sim]
    same = compare(sim, REAL)
    assert set(same) == {"chunk w0", "dispatch w0", "admit w1", "admit w2", "preempt w2"}
    assert all(v["identical"] for v in same.values())

    other = list(sim)
    other[2] = (0, {**sim[2][1], "slices": [[108, 100, 10]]})  # a different second chunk
    del other[7]  # and the preemption never happens
    same = compare(other, REAL)
    assert not same["chunk w0"]["identical"] and same["chunk w0"]["first_difference"] == 1
    assert same["chunk w0"]["sim"] == [[1, 100, 10]]
    assert same["chunk w0"]["real"] == [[1, 100, 12]]
    assert same["preempt w2"] == {"identical": False, "num_sim": 0, "num_real": 1,
                                  "first_difference": 0, "sim": None, "real": 1}
    assert same["dispatch w0"]["identical"] and same["admit w1"]["identical"]
    row = dict.fromkeys(decisions.SUMMARY_ROWS, 1)
    text = decisions.table(row, [row], [same])
    assert "differ: chunk w0 at #1" in text and "preempt w2 at #0" in text


def test_the_golden_disaggregated_log_compares_identical_with_the_simulated_one(
        tmp_path) -> None:
    """The real roles' golden log, read as ``sim compare`` reads a server's logs (one file per
    worker), against the simulated instances' records of the same trace."""
    from tests.unit.test_decision_trace_disagg import GOLDEN
    from tests.unit.test_sim_golden_disagg import replay
    from tetri_server.sim.decisions import compare, read_logs

    by_worker: dict[str, list[str]] = {}
    for line in GOLDEN.read_text().splitlines():
        wid, rec = line.split(" ", 1)
        by_worker.setdefault(wid, []).append(rec)
    for wid, recs in by_worker.items():
        (tmp_path / f"real.decisions.{wid}.jsonl").write_text("\n".join(recs) + "\n")
    (tmp_path / "real.decisions.w1.jsonl.bak").write_text("not a log\n")
    real = read_logs(tmp_path / "real.decisions")
    assert [wid for wid, _ in real] == sorted(wid for wid, _ in real)
    sim = [(int(w[1:]), json.loads(rec)) for w, rec in (line.split(" ", 1) for line in replay())]
    same = compare(sim, real)
    assert {"chunk w0", "dispatch w0", "admit w1", "admit w2"} <= set(same)
    assert all(v["identical"] for v in same.values()), same


@pytest.mark.parametrize(("gap_s", "chunks_identical"), [(8.0, True), (0.3, False)])
def test_a_sparse_trace_decides_the_same_under_other_timing(gap_s: float,
                                                             chunks_identical: bool) -> None:
    """Why ``sim compare --arrival constant`` at a low rate can demand identical decisions: two
    profiles whose step times differ (this CPU's fit, and the same fit on a device 1.6x slower)
    decide alike (every decision) when no two requests meet, and chunk differently when they
    do."""
    import dataclasses
    import random

    from tetri_server.sim.cost import CostModel
    from tetri_server.sim.instances import SimRequest
    from tetri_server.sim.profiles import load_hardware, load_model
    from tetri_server.sim.run import predict
    from tetri_server.sim.versus import run_sim

    cfg = sim_config(build_parser().parse_args(["--model", "m", "--json", "o.json"]))
    logs, ends = [], []
    fitted = load_hardware("this-cpu")
    slower = dataclasses.replace(fitted, name="this-cpu-slower", peak_flops=fitted.peak_flops / 1.6,
                                 mem_bw_Bps=fitted.mem_bw_Bps / 1.6,
                                 step_overhead_s=fitted.step_overhead_s * 1.6)
    for hw in (fitted, slower):
        rng = random.Random(3)
        reqs = [SimRequest(i, rng.choice((20, 200, 600, 900)), rng.choice((5, 60, 300)),
                           i * gap_s) for i in range(24)]
        predict(reqs, cfg)
        result, log = run_sim(cfg, CostModel(hw, load_model("bench")), reqs)
        logs.append(log)
        ends.append(result.duration_s)
    assert ends[0] != ends[1]  # the timing differs
    same = decisions.compare(*logs)
    assert same["chunk w0"]["identical"] is chunks_identical
    if chunks_identical:
        assert all(v["identical"] for v in same.values()), same
    # when requests meet, short prompts overtake a started long one (prefill.overtake_share,
    # the server's default) as the timing has them meet: the dispatch order may differ too


def test_the_real_server_runs_the_split_the_simulation_models() -> None:
    """Neither side is elastic in the simulation (SimConfig's defaults); the server's settings
    must say so for both sides, not only the prefill worker's."""
    from tetri_server.config import load_config

    args = build_parser().parse_args(["--model", "m", "--json", "o.json"])
    sim = sim_config(args)
    real = load_config(None, server_sets(args)).resolve(cpu_count=2)
    assert (real.prefill.local_decode_batch, real.decode.local_prefill_tokens) \
        == (sim.local_decode_batch, sim.local_prefill_tokens) == (0, 0)
