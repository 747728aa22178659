"""tools/decode_steps.py: the decode worker's step times from a decision log."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))
from decode_steps import by_rows, decode_steps, main, split  # noqa: E402


def step(t: float, run: list[int], **extra: object) -> dict:
    return {"kind": "decode_step", "t": t, "run": run, "preempt": [], **extra}


def test_steps_with_a_recompute_beside_other_rows_are_timed_to_the_next_record(tmp_path,
                                                                              capsys):
    records = [step(0.0, [1, 2]), step(0.03, [1], preempt=[2]),
               step(0.05, [1, 2], recompute_tokens=[[2, 256]]),  # 0.4 s, beside 1
               {"kind": "dispatch", "t": 0.45},
               step(0.5, [2], recompute_tokens=[[2, 40]]),  # alone: not counted
               step(0.6, [1, 2]), step(0.61, [1, 2], preempt=[3]),  # 3 waited: a KV drop
               step(0.62, [])]
    s = decode_steps(records)
    assert s.num_steps == 6 and s.num_preemptions == 1 and s.num_kv_drops == 1
    assert s.recompute_tokens == [256] and s.recompute_s == pytest.approx([0.4])
    path = tmp_path / "decisions.w1.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    main([str(path)])
    out = capsys.readouterr().out
    assert "preemptions 1; waiting KV dropped 1;" in out
    assert "at most 256 tokens, 400 ms mean, 400 ms max" in out
    with pytest.raises(ValueError, match="no decode step"):
        decode_steps([step(0.0, [1])])


def test_by_rows_times_decode_only_steps_and_the_context_of_their_rows() -> None:
    records = [
        {"kind": "decode_step", "step": 1, "t": 0.00, "run": [1]},  # the next step admits 2:
        # its KV was pulled in this interval
        {"kind": "decode_step", "step": 2, "t": 0.05, "run": [1, 2], "admit": [2]},  # 10 ms
        {"kind": "decode_step", "step": 3, "t": 0.06, "run": [1]},  # 20 ms to step 4
        {"kind": "keep", "step": 3, "t": 0.07, "req": 9},  # not a step: not a step's end
        {"kind": "mixed_step", "step": 4, "t": 0.08, "run": [1, 2], "slices": [[3, 0, 64]]},
        {"kind": "coupled_step", "step": 5, "t": 0.20, "run": [1], "recompute": [2]},
        {"kind": "decode_step", "step": 6, "t": 0.30, "run": [1, 2]},  # then idle 8.7 s
        {"kind": "decode_step", "step": 7, "t": 9.00, "run": [1]},  # the last: no end
    ]
    rows = by_rows(records, {1: 100, 2: 50})
    assert [(r.rows, r.num_steps) for r in rows] == [(1, 1), (2, 1)]
    # step 3: request 1 decoded twice before it; step 2: once, request 2 not yet
    assert rows[0].p50_s == pytest.approx(0.02) and rows[0].mean_ctx == pytest.approx(102)
    assert rows[1].p50_s == pytest.approx(0.01) and rows[1].mean_ctx == pytest.approx(75.5)
    assert by_rows(records)[0].mean_ctx == 0.0  # no prompt lengths: no context
    assert [r.num_steps for r in by_rows(records, idle_s=10.0)] == [1, 2]  # 8.7 s counted


def run_record(req: int, prompt_len: int, tokens: int, span_s: float, met: bool) -> dict:
    return {"request_id": req, "kind": "LPHD", "prompt_len": prompt_len, "output_len": tokens,
            "arrival_s": 0.0, "send_s": 0.0, "num_output_tokens": tokens,
            "first_token_s": 1.0, "end_s": 1.0 + span_s, "met_slo": met}


def test_split_groups_requests_by_where_they_decoded_and_checks_the_ids(tmp_path, capsys):
    prefill = [{"kind": "chunk", "step": 1, "t": 0.0,
                "slices": [[0, 0, 64], [1, 0, 10], [3, 0, 32]]},  # 3: cancelled in its prefill
               {"kind": "chunk", "step": 2, "t": 0.1, "slices": [[0, 64, 9]]},
               {"kind": "keep", "req": 1}, {"kind": "dispatch", "req": 0, "to": 1},
               {"kind": "mixed_step", "step": 3, "t": 0.2, "run": [1], "slices": []},
               {"kind": "mixed_step", "step": 4, "t": 0.25, "run": [1], "slices": []}]
    runs = [run_record(0, 73, 11, 0.2, True), run_record(1, 10, 5, 0.4, False),
            run_record(2, 7, 1, 0.0, True),  # finished in its prefill: neither
            run_record(3, 100, 0, 0.0, False)]  # 32 of its 100 prompt tokens prefilled
    assert split(prefill, runs) == {"kept": (1, pytest.approx(0.1), 1),
                                    "handed off": (1, pytest.approx(0.02), 0),
                                    "neither": (2, 0.0, 1)}
    runs_other_ids = [run_record(0, 10, 11, 0.2, True), run_record(1, 73, 5, 0.4, False)]
    with pytest.raises(ValueError, match="request ids differ"):
        split(prefill, runs_other_ids)
    log = tmp_path / "dl.w0.jsonl"
    log.write_text("".join(json.dumps(r) + "\n" for r in prefill))
    sweep = tmp_path / "sweep.json"
    point = {"workload": {"rate_rps": 1.0}, "records": runs}
    sweep.write_text(json.dumps({"modes": [{"mode": "disaggregated", "points": [point]},
                                           {"mode": "coupled", "points": [point]}]}))
    with pytest.raises(SystemExit, match="2 points match"):
        main(["--records", str(sweep), "--split", str(log)])
    for name in ("disaggregated@1.0", "disaggregated@1"):  # the rate as a number
        main([str(log), "--records", str(sweep), "--point", name, "--split", str(log),
              "--by-rows"])
        out = capsys.readouterr().out
        assert "kept: 1 requests, mean TPOT 100.0 ms, 1 missed the SLOs" in out
        assert "handed off: 1 requests, mean TPOT 20.0 ms, 0 missed the SLOs" in out
        assert "  1: 50.0 ms, 1 steps, ctx 10" in out  # step 3, to step 4: request 1's prompt
    bad = tmp_path / "other.json"
    bad.write_text(json.dumps({"modes": [{"mode": "disaggregated", "points": [
        {"workload": {"rate_rps": 1.0}, "records": runs_other_ids}]}]}))
    with pytest.raises(ValueError, match="request ids differ"):
        main([str(log), "--records", str(bad), "--by-rows"])
    with pytest.raises(SystemExit, match="not MODE@RATE"):
        main(["--records", str(sweep), "--point", "disaggregated@fast", "--split", str(log)])
    for argv in (["--split", str(log)], [str(log), "--records", str(sweep)], [],
                 [str(log), "--idle-s", "2"]):
        with pytest.raises(SystemExit):  # --split without records; records unread; nothing;
            main(argv)  # --idle-s unread


def test_gaps_are_put_on_the_step_that_made_the_later_token(tmp_path, capsys) -> None:
    from decode_steps import gap_sources

    prefill = [{"kind": "chunk", "t": 0.0, "slices": [[1, 0, 8], [2, 0, 8]]},
               {"kind": "keep", "req": 1}, {"kind": "dispatch", "req": 2, "to": 1},
               {"kind": "mixed_step", "t": 0.10, "run": [1], "slices": [[3, 0, 64]]},
               {"kind": "mixed_step", "t": 0.16, "run": [1]},  # 10 ms to the next
               {"kind": "mixed_step", "t": 0.17, "run": [1]}]  # the last: no step time
    decode = [{"kind": "decode_step", "t": 0.12, "run": [2]},  # the next admits: KV pulled
              {"kind": "decode_step", "t": 0.14, "run": [2, 4], "admit": [4]},
              {"kind": "decode_step", "t": 0.15, "run": [2, 4]}]
    runs = [{"request_id": 1, "token_times_s": [0.1, 0.165, 0.175, 0.18]},  # 65 ms, 10, 5
            {"request_id": 2, "token_times_s": [0.1, 0.13, 0.145]},  # 2 tokens, 3 steps
            {"request_id": 4, "token_times_s": [0.13, 0.147, 0.16]},
            {"request_id": 5, "token_times_s": [0.2, 0.3]}]  # no step made its token: left out
    for r in runs:
        r["prompt_len"] = 8
    got = {(g.log, g.kind): (g.num_gaps, g.num_long, round(g.step_p50_s, 3))
           for g in gap_sources({"w0": prefill, "w1": decode}, runs)}
    assert got == {("w0", "prompt slice"): (1, 1, 0.06), ("w0", "rows only"): (2, 0, 0.01),
                   ("w1", "hand-off pulled"): (1, 0, 0.02),  # request 2's first there
                   ("w1", "first here"): (1, 0, 0.01), ("w1", "rows only"): (2, 0, 0.01)}
    sweep = tmp_path / "sweep.json"
    sweep.write_text(json.dumps({"modes": [{"mode": "disaggregated", "points": [
        {"workload": {"rate_rps": 1.0}, "records": runs}]}]}))
    logs = []
    for name, recs in (("dl.w0.jsonl", prefill), ("dl.w1.jsonl", decode)):
        (tmp_path / name).write_text("".join(json.dumps(r) + "\n" for r in recs))
        logs.append(str(tmp_path / name))
    main([*logs, "--records", str(sweep), "--gaps", "--gap-ms", "50"])
    out = capsys.readouterr().out
    assert out.startswith("7 gaps, 1 over 50 ms (14.3%)")
    assert "  dl.w0.jsonl, prompt slice: 1 gaps (14.3%), 1 over; step p50 60.0 ms" in out
    for argv in (["--gaps", *logs], [*logs, "--records", str(sweep), "--gaps", "--by-rows"]):
        with pytest.raises(SystemExit):  # no records; not with --by-rows
            main(argv)


def test_rows_that_waited_made_no_token_in_that_step() -> None:
    """Regression: a step's row that could not run (``rows_wait``: its blocks split by pinned
    extents) was counted as having made a token there, so each later gap of that request was
    put on the step before the one that made it (here the prompt slice's, not the next)."""
    from decode_steps import gap_sources

    prefill = [{"kind": "mixed_step", "t": 0.0, "run": [1]},
               {"kind": "mixed_step", "t": 0.01, "run": [1], "slices": [[3, 0, 64]]},
               {"kind": "rows_wait", "ids": [1]},
               {"kind": "mixed_step", "t": 0.06, "run": [1]},
               {"kind": "mixed_step", "t": 0.07, "run": [1]}]
    runs = [{"request_id": 1, "prompt_len": 8, "token_times_s": [0.0, 0.005, 0.065]}]
    got = {(g.log, g.kind): (g.num_gaps, g.num_long)
           for g in gap_sources({"w0": prefill}, runs)}
    assert got == {("w0", "first here"): (1, 0), ("w0", "rows only"): (1, 1)}
