"""bench ablation: the rows (one lever each, valid configs), their server commands, the table."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from tetri_server.bench import ablation
from tetri_server.bench.cli import main as bench_main
from tetri_server.bench.client import RunResult
from tetri_server.bench.metrics import SLO, Stats, Summary
from tetri_server.bench.report import BenchResult
from tetri_server.bench.workload import WorkloadSpec
from tetri_server.config import load_config

BY_NAME = {r.name: r for r in ablation.ROWS}


def set_items(argv: list[str]) -> list[str]:
    return [argv[i + 1] for i, a in enumerate(argv) if a == "--set"]


def test_rows_are_picked_in_table_order_with_the_coupled_baseline() -> None:
    assert [r.name for r in ablation.select_rows(None)] == list(ablation.ROW_NAMES)
    picked = ablation.select_rows("refined, sjf")
    assert [r.name for r in picked] == ["coupled", "sjf", "refined"]
    with pytest.raises(ValueError, match="unknown rows nope.*known: coupled"):
        ablation.select_rows("sjf,nope")


def test_every_other_repeat_runs_the_rows_in_reverse() -> None:
    rows = ablation.select_rows("default,sjf")
    names = [[r.name for r in ablation.run_order(rows, k)] for k in range(3)]
    assert names == [["coupled", "default", "sjf"], ["sjf", "default", "coupled"],
                     ["coupled", "default", "sjf"]]


@pytest.mark.parametrize("row", ablation.ROWS, ids=lambda r: r.name)
def test_every_row_is_a_config_the_server_accepts(row: ablation.Row) -> None:
    spec = ablation.row_spec(row, "builtin:tiny", 1234, 2048, (), pool_blocks=160)
    cfg = load_config(None, set_items(spec.argv))  # raises ConfigError on a refused combination
    assert spec.label == row.name
    if ablation.POOL in row.sets:
        assert cfg.kv.num_blocks == 160


@pytest.mark.parametrize("row", [r for r in ablation.ROWS if r.base not in ("", "coupled")],
                         ids=lambda r: r.name)
def test_every_row_changes_one_lever_of_its_base(row: ablation.Row) -> None:
    base = BY_NAME[row.base]

    def keys(items: set[str]) -> set[str]:
        return {i.split("=")[0] for i in items}

    added, removed = set(row.sets) - set(base.sets), set(base.sets) - set(row.sets)
    assert keys(removed) <= keys(added)  # a base setting is only ever given a new value
    if row.mode != base.mode:  # an elastic preset: the mode is the one change
        assert not added
    else:
        sections = {k.split(".")[0] for k in keys(added)}
        assert len(sections) == 1, f"{row.name} changes {sorted(added)} of {base.name}"


@pytest.mark.parametrize("row", [r for r in ablation.ROWS if r.lever == "elastic P/D"],
                         ids=lambda r: r.name)
def test_the_elastic_rows_run_elastic_on_a_gpu_too(row: ablation.Row) -> None:
    """cluster.elastic = auto is the strict split on cuda; a row that varies an elastic key
    (or names an elastic preset) must still run elastic there, and the split row must not."""
    spec = ablation.row_spec(row, "builtin:tiny", 1234, 2048, ["cluster.device=cuda"], 160)
    cfg = load_config(None, set_items(spec.argv)).resolve(cpu_count=2)
    assert cfg.elastic_on == (row.name != "split")


def test_every_row_settings_come_after_the_common_ones_so_the_row_wins() -> None:
    spec = ablation.row_spec(BY_NAME["pool-greedy"], "m", 1, 2048, ["decode.policy=reserve-static",
                                                                    "kv.num_blocks=999"], 160)
    items = set_items(spec.argv)
    cfg = load_config(None, [i for i in items if not i.startswith("model.path")])
    assert (cfg.decode.policy, cfg.kv.num_blocks) == ("greedy", 160)


def test_dry_run_prints_the_commands_and_runs_nothing(capsys: pytest.CaptureFixture[str],
                                                      tmp_path: Path) -> None:
    code = bench_main(["ablation", "--model", str(tmp_path), "--max-model-len", "1024",
                       "--dry-run", "--rows", "refined", "--out", str(tmp_path / "o")])
    out = capsys.readouterr().out
    assert code == 0 and not (tmp_path / "o").exists()
    assert out.count("-m tetri_server serve") == 2
    assert "# coupled" in out and "--set decode.estimate=refined" in out
    assert "cluster.mode=coupled" in out.split("# refined")[0]


# ---------------------------------------------------------------------- the table


def summary(ttft: float, jct: float, itl: float, busy: dict[str, float],
            attained: float = 1.0) -> Summary:
    def st(x: float) -> Stats:
        return Stats(x, x, x * 1.5, x * 2)

    return Summary(num_requests=4, num_completed=4, num_errors=0, duration_s=10.0,
                   request_throughput_rps=0.4, output_throughput_tps=1.0,
                   total_token_throughput_tps=2.0, goodput_rps=0.4, slo_attainment=attained,
                   slo=SLO(), ttft_s=st(ttft), tpot_s=st(0.05), itl_s=st(itl), jct_s=st(jct),
                   client_wait_s=st(0.0), num_output_mismatch=0, busy_s=busy,
                   busy_s_total=sum(busy.values()), num_workers=len(busy), held_worker_s=20.0,
                   utilization=0.5, perf_per_dollar=0.2, top_errors={})


def result(row: str, workload: str, s: Summary) -> BenchResult:
    spec = WorkloadSpec(name=workload, num_requests=4, seed=0, max_model_len=2048)
    return BenchResult(row, spec, s, RunResult(records=[], duration_s=10.0, started_unix_s=0.0))


def test_the_table_divides_by_coupled_and_averages_the_repeats() -> None:
    rows = ablation.select_rows("sjf,pool-greedy")
    results = [
        result("coupled", "LPHD", summary(1.0, 4.0, 0.3, {"0:coupled": 9.0, "1:coupled": 7.0})),
        result("sjf", "LPHD", summary(0.5, 2.0, 0.1, {"0:prefill": 3.0, "1:decode": 8.0})),
        result("sjf", "LPHD", summary(1.5, 6.0, 0.1, {"0:prefill": 5.0, "1:decode": 8.0}, 0.5)),
        result("coupled", "Mixed", summary(2.0, 8.0, 0.3, {"0:coupled": 1.0})),
    ]
    text = ablation.tables(rows, results, SLO())
    lphd, mixed = text.split("#### Mixed")
    [sjf] = [line for line in lphd.splitlines() if line.startswith("| sjf ")]
    cells = [c.strip() for c in sjf.strip("|").split("|")]
    assert cells[1] == "prefill.policy=sjf" and cells[2] == "default"
    assert cells[3] == "8/8"  # two repeats of four requests
    assert cells[4] == "1.00 / 1.50" and cells[5] == "4.00"  # means over the repeats
    assert cells[6] == "200.0" and cells[7] == "0.75"  # p99 = 2x the fake mean of 0.1 s
    assert cells[8] == "0:prefill 4.0 1:decode 8.0"
    assert cells[9] == "1.00 / 1.00 / 0.33"  # against coupled of the same workload
    assert cells[10] == "n/a"  # its base (default) did not run
    assert cells[11] == "100%"  # JCT 2 and 6 around a mean of 4
    assert "pool-greedy" not in text  # no result, no line
    assert "| coupled " in mixed and "| sjf " not in mixed


def test_a_ratio_over_a_row_that_lost_requests_is_marked() -> None:
    """Regression: latency means cover completed requests, so a row whose slowest requests
    failed looked faster than coupled with nothing to say so."""
    lost = replace(summary(0.5, 2.0, 0.1, {"0:prefill": 1.0}), num_completed=3, num_errors=1)
    results = [result("coupled", "LPHD", summary(1.0, 4.0, 0.3, {"0:coupled": 9.0})),
               result("sjf", "LPHD", lost)]
    text = ablation.tables(ablation.select_rows("sjf"), results, SLO())
    [sjf] = [line for line in text.splitlines() if line.startswith("| sjf ")]
    cells = [c.strip() for c in sjf.strip("|").split("|")]
    assert cells[3] == "3/4" and cells[9] == "0.50 / 0.50 / 0.33 †"
    [coupled] = [line for line in text.splitlines() if line.startswith("| coupled ")]
    assert "†" not in coupled.split("|")[10]
