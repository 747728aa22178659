"""``bench sweep``: its pure parts, its argument handling, and one sweep end to end against the
fake OpenAI-compatible server of test_bench_cli (no tetri_server, no model)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from tests.unit.test_bench_cli import fake_spec
from tetri_server.bench import cli, options, sweep
from tetri_server.bench.client import RequestRecord, RunResult
from tetri_server.bench.compare import ServerSpec, running_server
from tetri_server.bench.metrics import SLO, summarize
from tetri_server.bench.report import BenchResult
from tetri_server.bench.slo import Calibration, SLOScale
from tetri_server.bench.sweep import (
    ModeSweep,
    calibration_requests,
    interleaved_order,
    parse_rates,
    probe_lengths,
    reference_mode,
    requests_at,
)
from tetri_server.bench.sweep_report import sweep_json, sweep_table
from tetri_server.bench.workload import WorkloadSpec


@pytest.fixture
def model_dir(tmp_path: Path) -> Path:
    folder = tmp_path / "model"
    folder.mkdir()
    config = {"vocab_size": 512, "bos_token_id": 1, "eos_token_id": 2}
    (folder / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 700}))
    return folder


def test_rates_are_sorted_distinct_and_positive() -> None:
    assert parse_rates("0.6,0.2,0.4,0.2") == [0.2, 0.4, 0.6]
    for bad in ("", "0,0.2", "-1", "inf", "fast"):
        with pytest.raises(ValueError):
            parse_rates(bad)


def test_requests_per_rate_from_a_count_or_a_duration() -> None:
    assert requests_at(0.5, 25, None) == 25
    assert requests_at(0.5, None, 60.0) == 30
    assert requests_at(0.01, None, 10.0) == 1
    with pytest.raises(ValueError):
        requests_at(0.5, 25, 60.0)


def test_calibration_requests_fit_the_context_and_are_alone() -> None:
    assert probe_lengths(1024) == (4, 127, 511, 1022)
    warm, probes, steps = calibration_requests(1024, (512, frozenset({1, 2})), seed=0)
    everything = [*warm, *probes, *steps]
    assert all(q.prompt_len + q.output_len <= 1024 for q in everything)
    assert sorted({q.prompt_len for q in probes}) == [4, 127, 511, 1022]
    assert len(probes) == 12 and all(q.output_len == 2 for q in probes)
    assert all(q.output_len > 16 for q in steps)
    assert [q.request_id for q in everything] == list(range(len(everything)))
    assert all(q.arrival_s == 0.0 for q in everything)


def test_a_context_too_small_for_the_calibration_is_refused_by_name() -> None:
    """Regression (review of session 64): under 96 tokens of context the calibration's lone
    decode streams (32 + 64 tokens) failed as the server's HTTP 400s, which read as a server
    fault; at 96 every request fits."""
    with pytest.raises(ValueError, match="--max-model-len"):
        calibration_requests(95, (512, frozenset({1, 2})), seed=0)
    warm, probes, steps = calibration_requests(96, (512, frozenset({1, 2})), seed=0)
    assert all(q.prompt_len + q.output_len <= 96 for q in [*warm, *probes, *steps])


def test_the_reference_mode_sets_everyones_slo() -> None:
    assert reference_mode(["disaggregated", "coupled"]) == "coupled"
    assert reference_mode(["disaggregated", "coupled-chunked"]) == "disaggregated"
    assert reference_mode(["a", "b"], "b") == "b"
    with pytest.raises(ValueError):
        reference_mode(["a", "b"], "c")


def _result(rate: float, ttfts: list[float]) -> BenchResult:
    recs = [
        RequestRecord(i, "LPLD", 100, 2, 0.0, 0.0, t, [t, t + 0.02], t + 0.02, num_output_tokens=2)
        for i, t in enumerate(ttfts)
    ]
    run = RunResult(recs, 10.0, 0.0)
    spec = WorkloadSpec("LPLD", num_requests=len(recs), rate_rps=rate)
    return BenchResult("m", spec, summarize(run, SLO()), run)


def test_table_and_json_show_goodput_and_attainment_per_rate() -> None:
    cal = Calibration(0.01, 0.001, 0.02, source="coupled")  # 100 tokens: TTFT SLO 0.55 s
    fast, slow = [0.1] * 10, [0.1] * 8 + [1.0] * 2
    a = ModeSweep("disaggregated", cal, [_result(0.2, fast), _result(0.4, fast)])
    b = ModeSweep("coupled", None, [_result(0.2, fast), _result(0.4, slow)])
    table = sweep_table([a, b], cal, SLOScale())
    assert "attainment at 0.2 / 0.4 req/s" in table
    assert "| disaggregated | **0.4** | 100% / 100% |" in table
    assert "| coupled | **0.2** | 100% / 80% |" in table
    assert "TPOT <= 3 x step = 60 ms" in table
    out = sweep_json([a, b], cal, SLOScale(), 0.0)
    json.dumps(out)  # serialisable
    assert [m["goodput_rps"] for m in out["modes"]] == [0.4, 0.2]
    point = out["modes"][1]["points"][1]
    assert point["attainment"] == 0.8 and point["num_met"] == 8
    assert [r["met_slo"] for r in point["records"]] == [True] * 8 + [False] * 2
    assert "goodput_rps" not in point["summary"]  # the fixed-SLO goodput would mislead
    assert out["modes"][1]["calibration"] is None
    assert Calibration.from_dict(out["slo_calibration"]) == cal


def test_an_attainment_just_under_the_target_does_not_read_as_met() -> None:
    """Regression (review of session 64): attainment printed with no decimals, so 179 of
    200 (89.5%, below the 90% target, as goodput counts it) read "90%"; the JSON said what
    the definition's recomputation would not (no floor on short prompts' TTFT SLO)."""
    cal = Calibration(0.01, 0.001, 0.02, source="coupled")
    point = ModeSweep("coupled", None, [_result(0.2, [0.1] * 179 + [1.0] * 21)])
    assert "| coupled | **0** | 89.5% |" in sweep_table([point], cal, SLOScale())
    assert "prefill_floor_s" in sweep_json([point], cal, SLOScale(), 0.0)["definition"]


def _args(*argv: str) -> argparse.Namespace:
    return cli.parser().parse_args(["sweep", *argv])


def test_sweep_needs_a_server_or_modes_and_one_request_count() -> None:
    with pytest.raises(SystemExit):
        _args("--rates", "0.2")  # neither --url nor --modes
    with pytest.raises(SystemExit):
        _args("--url", "http://x", "--modes", "coupled", "--rates", "0.2")
    with pytest.raises(SystemExit):
        _args("--url", "http://x", "--rates", "0.2", "--num-requests", "5", "--duration-s", "9")
    with pytest.raises(SystemExit):
        _args("--url", "http://x")  # --rates is required
    args = _args("--modes", "disaggregated,coupled", "--rates", "0.2,0.4", "--slo-ttft-x", "4")
    assert (args.slo_ttft_x, args.slo_tpot_x, args.slo_target) == (4.0, 3.0, 0.9)
    assert not hasattr(args, "rate") and not hasattr(args, "slo_ttft_s")


def test_spawn_means_every_mode_and_needs_a_model() -> None:
    with pytest.raises(SystemExit, match="needs --model"):
        cli.main(["sweep", "--spawn", "--rates", "0.2"])


def test_same_lengths_at_every_rate_and_prompts_of_its_own(model_dir: Path) -> None:
    """The prompts differ between rates (review of session 62: a server with prefix caching,
    kept up across the rates of ``--url``, served each rate's prompts from the last one's
    cache); the first rate's are those of a lone run."""
    args = _args("--url", "http://x", "--model", str(model_dir), "--rates", "0.2")
    args.num_requests = 8
    built = options.sweep_workloads(args, [0.2, 0.4])
    assert [s.rate_rps for s, _ in built] == [0.2, 0.4]
    (_, slow), (_, fast) = built
    assert [(q.prompt_len, q.output_len) for q in slow] == [
        (q.prompt_len, q.output_len) for q in fast
    ]
    assert all(a.prompt != b.prompt for a, b in zip(slow, fast, strict=True))
    lone = options.build_requests(cli.parser().parse_args(
        ["run", "--url", "http://x", "--model", str(model_dir), "--rate", "0.2",
         "--num-requests", "8"]))
    assert [q.prompt for q in lone[0][1]] == [q.prompt for q in slow]
    assert slow[-1].arrival_s == pytest.approx(2 * fast[-1].arrival_s)
    args.num_requests, args.duration_s = None, 20.0
    assert [len(r) for _, r in options.sweep_workloads(args, [0.2, 0.4])] == [4, 8]
    for bad in (["Mixed,LPLD"], ["all"]):
        args.workload = bad
        with pytest.raises(SystemExit, match="one workload"):
            options.sweep_workloads(args, [0.2])


def test_a_bad_reference_or_scale_fails_before_any_server_starts(
    model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def never(*a: object, **k: object) -> ServerSpec:
        raise AssertionError("no server should start")

    monkeypatch.setattr(sweep, "running_server", never)
    base = ["sweep", "--modes", "coupled", "--model", str(model_dir), "--rates", "0.2"]
    with pytest.raises(SystemExit, match="slo-reference"):
        cli.main([*base, "--slo-reference", "vllm-cpu"])
    with pytest.raises(SystemExit, match="multipliers"):
        cli.main([*base, "--slo-tpot-x", "0"])
    with pytest.raises(SystemExit, match="time-scale"):
        cli.main([*base, "--time-scale", "2"])
    monkeypatch.setattr(cli, "find_vllm", lambda explicit=None: None)
    with pytest.raises(SystemExit, match="vLLM was not found"):
        cli.main([*base[:2], "coupled,vllm-cpu", *base[3:]])
    # a context too small for the calibration (review of session 65: found minutes in, by
    # the calibration, with a server up and a traceback)
    with pytest.raises(SystemExit, match="max-model-len"):
        cli.main([*base, "--max-model-len", "80", "--workload", "LPLD", "--input-len", "8",
                  "--output-len", "8"])
    with pytest.raises(SystemExit, match="max_model_len 80"):  # the workload's own check
        cli.main([*base, "--max-model-len", "80", "--workload", "Mixed"])


def test_sweep_end_to_end_against_fake_servers(
    tmp_path: Path, model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    started: list[list[str]] = []

    def spec(mode: str, model: str, port: int, max_len: int, sets: list[str]) -> ServerSpec:
        started.append([mode, str(max_len), *sets])
        return fake_spec(mode)

    monkeypatch.setattr(cli, "tetri_spec", spec)
    out = tmp_path / "sweep.json"
    common = ["--model", str(model_dir), "--workload", "LPLD", "--num-requests", "4"]
    common += ["--no-progress", "--out", str(tmp_path), "--json", str(out)]
    rc = cli.main(["sweep", "--modes", "disaggregated,coupled", "--rates", "20,40", *common])
    assert rc == 0
    assert started == [["disaggregated", "700"], ["coupled", "700"]]
    result = json.loads(out.read_text())
    assert [m["mode"] for m in result["modes"]] == ["disaggregated", "coupled"]
    assert result["slo_calibration"]["source"] == "coupled"  # the reference
    assert result["machine"]["nproc"] >= 1 and "--modes" in result["argv"]
    # what ran, beside the numbers (regression: no commit, ISA or torch version was recorded)
    assert result["machine"]["isa"] and result["machine"]["torch"]
    assert result["machine"]["commit"] != ""
    for mode in result["modes"]:
        assert mode["rates"] == [20.0, 40.0] and len(mode["attainment"]) == 2
        assert mode["calibration"]["step_s"] > 0 and len(mode["points"][0]["records"]) == 4
        assert (tmp_path / f"{mode['mode']}.log").exists()
    table = (tmp_path / "table.md").read_text()
    assert "| coupled | **" in table
    assert "| 40 req/s | disaggregated | " in table  # the breakdown per rate and mode
    png = (tmp_path / "goodput.png").read_bytes()  # the goodput curves, drawn from the JSON
    assert png.startswith(b"\x89PNG") and len(png) > 10_000

    # --url, reusing that calibration: nothing is measured, the same SLO applies
    server = fake_spec("coupled")
    with running_server(server, tmp_path / "url.log"):
        out2 = tmp_path / "url.json"
        argv = ["sweep", "--url", server.base_url, "--rates", "20", "--label", "mine"]
        argv += [*common[:-1], str(out2), "--calibration", str(out)]
        assert cli.main(argv) == 0
    again = json.loads(out2.read_text())
    assert again["slo_calibration"] == result["slo_calibration"]
    assert again["modes"][0]["mode"] == "mine" and again["modes"][0]["calibration"] is None


def test_interleaved_order_runs_every_mode_at_a_rate_before_the_next() -> None:
    a, b, c = fake_spec("a"), fake_spec("b"), fake_spec("c")
    order = [(k, s.label) for k, s in interleaved_order(3, [a, b, c])]
    assert order == [(0, "a"), (0, "b"), (0, "c"), (1, "c"), (1, "b"), (1, "a"),
                     (2, "a"), (2, "b"), (2, "c")]


def test_interleaved_sweep_against_fake_servers(
    tmp_path: Path, model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``--interleave``: a server per (rate, mode), in ``interleaved_order``; each mode
    calibrated once and its points ascending by rate, as without it."""
    monkeypatch.setattr(cli, "tetri_spec", lambda mode, *_: fake_spec(mode))
    out = tmp_path / "sweep.json"
    argv = ["sweep", "--modes", "disaggregated,coupled", "--rates", "20,40", "--interleave",
            "--model", str(model_dir), "--workload", "LPLD", "--num-requests", "4",
            "--no-progress", "--no-plots", "--out", str(tmp_path), "--json", str(out)]
    assert cli.main(argv) == 0
    result = json.loads(out.read_text())
    assert [m["mode"] for m in result["modes"]] == ["disaggregated", "coupled"]
    for mode in result["modes"]:
        assert mode["rates"] == [20.0, 40.0] and mode["calibration"]["step_s"] > 0
        assert all(len(p["records"]) == 4 for p in mode["points"])
        for rate in ("20", "40"):
            assert (tmp_path / f"{mode['mode']}@{rate}.log").exists()
    with pytest.raises(SystemExit, match="--interleave"):
        cli.main(["sweep", "--url", "http://127.0.0.1:9", "--interleave", "--rates", "20",
                  *argv[6:]])


def test_a_sweep_warms_each_server_up_and_sends_at_the_arrival_times() -> None:
    """Regression (review of session 62): a sweep's servers were not warmed up (0 warm-ups;
    only a calibration warmed the first point of each mode), so with ``--interleave`` every
    later point, and every point with ``--calibration``, measured its first requests cold. And
    ``--max-concurrency`` moved the queueing into the client, where the TTFT SLO missed it."""
    args = _args("--modes", "coupled", "--rates", "0.2")
    assert args.num_warmups == 2 and cli.sweep_options(args).num_warmups == 2
    with pytest.raises(SystemExit, match="max-concurrency"):
        cli.cmd_sweep(_args("--modes", "coupled", "--rates", "0.2", "--max-concurrency", "4"))


def test_the_calibration_sends_what_the_sweep_sends(tmp_path, monkeypatch) -> None:
    """Regression: a sweep of an oracle server (``send_true_output_len``) failed at once: its
    calibration requests went without the true lengths (and the run's timeout)."""
    from tetri_server.bench.client import request_body
    from tetri_server.bench.compare import CompareOptions

    seen = []

    async def run(requests, cfg, scrape_metrics=True):  # noqa: ANN001, ANN202
        seen.append(cfg)
        records = [RequestRecord(r.request_id, r.kind, r.prompt_len, r.output_len, 0.0, 0.0,
                                 0.05 + 0.001 * r.prompt_len,
                                 [0.05 + 0.001 * r.prompt_len + 0.01 * i
                                  for i in range(r.output_len)],
                                 1.0, r.output_len, r.prompt_len,
                                 error=None if "true_output_len" in request_body(r, cfg)
                                 else "no true length")
                   for r in requests]
        return RunResult(records, 1.0, 0.0)

    async def model_name(url):  # noqa: ANN001, ANN202
        return "m"

    monkeypatch.setattr(sweep, "run_benchmark", run)
    monkeypatch.setattr(sweep, "fetch_model_name", model_name)
    spec = ServerSpec("disaggregated", [], 1)
    opts = CompareOptions(tmp_path, request_timeout_s=77.0, progress=False,
                          send_true_output_len=True)
    cal = sweep.calibrate_started(spec, 512, (512, frozenset()), 0, opts)
    assert cal.source == "disaggregated"
    [cfg] = seen
    assert (cfg.max_concurrency, cfg.request_timeout_s, cfg.label) == (
        1, 77.0, "disaggregated/calibration")
