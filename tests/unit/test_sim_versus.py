"""sim compare: the real server gets the settings the simulation runs, and the table is right."""

from __future__ import annotations

import pytest

from tetri_server.config import load_config
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
