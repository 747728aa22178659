"""The decode worker's steps from its decision log (``monitor.decision_log``): how long its
steps took, and those that carried a recompute after a preemption beside other rows (the
gap those rows waited through).

    .venv/bin/python tools/decode_steps.py RUN/decisions.w1.jsonl [...]
        [--by-rows] [--records SWEEP.json [--point MODE@RATE]] [--split PREFILL_LOG]

A step's time runs from its record's stamp (``t``) to the next record's, so a step the worker
idled after reads long: read the percentiles, not the maximum of all steps.

``--by-rows``: for any worker's log (decode, coupled or prefill), the steps that carried
decode rows only (no prompt slice, no recompute, on a decode worker no admission), by their
number of rows: the median time (to the next step, one step number on) and, with
``--records`` (the benchmark's JSON of that run), the mean context of those rows (prompt plus
the tokens this log decoded for it before the step). Two modes' logs of the same load compare
their steps at the same work.

``--split PREFILL_LOG`` (with ``--records``): the run's requests by where they decoded, kept
on the prefill worker (``keep``) or handed off (``dispatch``): their number, mean TPOT and
how many missed the SLOs. The benchmark's request ids are the server's (each request is sent
in arrival order); the prompt lengths the prefill log chunked are checked against the
records' first.
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections import Counter, defaultdict
from dataclasses import dataclass
from pathlib import Path

from tetri_server.sim.decisions import split_preempt


@dataclass(frozen=True)
class Steps:
    num_steps: int
    p50_s: float
    p99_s: float
    num_preemptions: int  # running requests preempted
    num_kv_drops: int  # waiting requests whose KV was dropped
    recompute_s: list[float]  # the steps with a recompute beside other rows
    recompute_tokens: list[int]  # their recompute tokens


def decode_steps(records: list[dict]) -> Steps:
    durations, recompute_s, tokens = [], [], []
    preempted, dropped = split_preempt([r for r in records if r["kind"] == "decode_step"])
    for rec, nxt in zip(records, records[1:], strict=False):
        if rec["kind"] != "decode_step":
            continue
        if not rec["run"]:
            continue
        step_s = nxt["t"] - rec["t"]
        durations.append(step_s)
        rows = rec.get("recompute_tokens", [])
        if rows and len(rec["run"]) > len(rows):
            recompute_s.append(step_s)
            tokens.append(sum(n for _, n in rows))
    if not durations:
        raise ValueError("no decode step with a next record to time it by")
    durations.sort()

    def at(p: float) -> float:
        return durations[min(len(durations) - 1, int(p * len(durations)))]

    return Steps(len(durations), at(0.5), at(0.99), preempted, dropped, recompute_s, tokens)


STEP_KINDS = ("decode_step", "coupled_step", "mixed_step", "chunk")


@dataclass(frozen=True)
class RowSteps:
    rows: int
    num_steps: int
    p50_s: float
    mean_ctx: float  # 0.0 without prompt lengths


def decode_only(rec: dict) -> bool:
    """A step whose only work was its decode rows: no prompt slice, no recompute, and on a
    decode worker no admission (it pulls the hand-off's KV in the step)."""
    return (bool(rec.get("run")) and not rec.get("slices") and not rec.get("recompute")
            and not rec.get("recompute_tokens")
            and not (rec["kind"] == "decode_step" and rec.get("admit")))


def by_rows(records: list[dict], prompt_lens: dict[int, int] | None = None) -> list[RowSteps]:
    """The ``decode_only`` steps of one worker's log by rows, ascending (``--by-rows``)."""
    steps = [r for r in records if r.get("kind") in STEP_KINDS]
    decoded: Counter[int] = Counter()
    per: dict[int, list[tuple[float, float]]] = defaultdict(list)
    for rec, nxt in zip(steps, steps[1:], strict=False):
        run = rec.get("run", [])
        if decode_only(rec) and nxt.get("step") == rec.get("step", -2) + 1:
            ctx = (statistics.mean(prompt_lens.get(r, 0) + decoded[r] for r in run)
                   if prompt_lens else 0.0)
            per[len(run)].append((nxt["t"] - rec["t"], ctx))
        decoded.update(run)
    return [RowSteps(rows, len(v), statistics.median(s for s, _ in v),
                     statistics.mean(c for _, c in v)) for rows, v in sorted(per.items())]


def where_decoded(prefill_records: list[dict]) -> dict[int, str]:
    """Each request whose prompt the prefill worker finished: "kept" or "handed off" (its
    last ``keep`` or ``dispatch``)."""
    where: dict[int, str] = {}
    for rec in prefill_records:
        if rec.get("kind") in ("keep", "dispatch"):
            where[rec["req"]] = "kept" if rec["kind"] == "keep" else "handed off"
    return where


def chunked_prompt_lens(prefill_records: list[dict]) -> dict[int, int]:
    """The prompt length of each request, as the prefill log's slices covered it."""
    lens: dict[int, int] = {}
    for rec in prefill_records:
        for req, start, n in rec.get("slices") or []:
            lens[req] = max(lens.get(req, 0), start + n)
    return lens


def split(prefill_records: list[dict], runs: list[dict]) -> dict[str, tuple[int, float, int]]:
    """(requests, mean TPOT in s, SLO misses) of the kept and the handed-off requests
    (``--split``); ``runs``: the benchmark's request records of the same run. Raises when the
    prompt lengths the log chunked are not the records' (the ids would not be the server's)."""
    lens = {r["request_id"]: r["prompt_len"] for r in runs}
    if wrong := [q for q, n in chunked_prompt_lens(prefill_records).items() if lens.get(q) != n]:
        raise ValueError(f"request ids differ: {len(wrong)} prompts (first id {wrong[0]}) have "
                         "another length in the records")
    where = where_decoded(prefill_records)
    out: dict[str, tuple[int, float, int]] = {}
    for group in ("kept", "handed off"):
        rs = [r for r in runs if where.get(r["request_id"]) == group]
        tpots = [(r["end_s"] - r["first_token_s"]) / (r["num_output_tokens"] - 1)
                 for r in rs if r.get("num_output_tokens", 0) > 1 and r.get("end_s") is not None]
        out[group] = (len(rs), statistics.mean(tpots) if tpots else 0.0,
                      sum(1 for r in rs if r.get("met_slo") is False))
    return out


def load_runs(path: Path, point: str | None) -> list[dict]:
    """The request records of one point of a benchmark JSON (``bench sweep`` / ``compare``):
    the only one, or ``MODE@RATE``."""
    data = json.loads(path.read_text())
    points = [(m["mode"], p) for m in data["modes"] for p in m["points"]]
    if point is not None:
        points = [(m, p) for m, p in points
                  if f"{m}@{p['workload'].get('rate_rps'):g}" == point]
    if len(points) != 1:
        raise SystemExit(f"{path}: {len(points)} points match; name one with --point MODE@RATE")
    return points[0][1]["records"]


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("logs", nargs="+", type=Path)
    p.add_argument("--by-rows", action="store_true", help="decode-only steps by rows")
    p.add_argument("--records", type=Path, help="the benchmark JSON of the same run")
    p.add_argument("--point", help="MODE@RATE: the point of --records (when it has several)")
    p.add_argument("--split", type=Path, help="the prefill worker's log (needs --records)")
    args = p.parse_args(argv)
    runs = load_runs(args.records, args.point) if args.records else None
    if args.split is not None:
        if runs is None:
            raise SystemExit("--split needs --records")
        for group, (n, tpot, missed) in split(read_log(args.split), runs).items():
            print(f"{group}: {n} requests, mean TPOT {tpot * 1e3:.1f} ms, {missed} missed the SLOs")
    for path in args.logs:
        records = read_log(path)
        if args.by_rows:
            lens = {r["request_id"]: r["prompt_len"] for r in runs} if runs else None
            print(f"{path}: decode-only steps by rows (rows: median ms, steps"
                  + (", mean context" if lens else "") + ")")
            for r in by_rows(records, lens):
                ctx = f", ctx {r.mean_ctx:.0f}" if lens else ""
                print(f"  {r.rows}: {r.p50_s * 1e3:.1f} ms, {r.num_steps} steps{ctx}")
            continue
        s = decode_steps([r for r in records if "t" in r])
        rec = (f"{len(s.recompute_s)}, at most {max(s.recompute_tokens)} tokens, "
               f"{statistics.mean(s.recompute_s) * 1e3:.0f} ms mean, "
               f"{max(s.recompute_s) * 1e3:.0f} ms max" if s.recompute_s else "none")
        print(f"{path}: {s.num_steps} steps, p50 {s.p50_s * 1e3:.0f} ms, p99 "
              f"{s.p99_s * 1e3:.0f} ms; preemptions {s.num_preemptions}; waiting KV dropped "
              f"{s.num_kv_drops}; steps with a "
              f"recompute beside other rows: {rec}")


def read_log(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.open()]


if __name__ == "__main__":
    main()
