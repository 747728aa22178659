"""The decode worker's steps from its decision log (``monitor.decision_log``): how long its
steps took, and those that carried a recompute after a preemption beside other rows (the
gap those rows waited through).

    .venv/bin/python tools/decode_steps.py RUN/decisions.w1.jsonl [...]
        [--by-rows [--idle-s S]] [--records SWEEP.json [--point MODE@RATE]]
        [--split PREFILL_LOG] [--gaps [--gap-ms MS]]

A step's time runs from its record's stamp (``t``) to the next record's, so a step the worker
idled after reads long: read the percentiles, not the maximum of all steps.

``--by-rows``: for any worker's log (decode, coupled or prefill), the steps that carried
decode rows only (no prompt slice, no recompute; on a decode worker not the step before an
admission either, during which it pulled that hand-off's KV if it admitted it at once), by
their number of rows: the median time (to the next step's stamp; an interval over
``--idle-s``, 1 s, is an idle spell and skipped) and, with ``--records`` (the ``bench sweep``
JSON of that run), the mean context of those rows (prompt plus the tokens this log decoded
for it before the step). Two modes' logs of the same load compare their steps at the same
work.

``--split PREFILL_LOG`` (with ``--records``): the run's requests by where they decoded, kept
on the prefill worker (``keep``), handed off (``dispatch``) or neither (finished, failed or
cancelled in their prefill): their number, mean TPOT and how many missed the SLOs.

``--gaps`` (with ``--records`` and every worker's log): each inter-token gap the client saw,
by the step that made its later token, per log and kind of step (a prompt slice in it, a
recompute, a hand-off's KV pulled in it, the request's first step there after its first token
came from elsewhere, or decode rows only): how many gaps, how many over ``--gap-ms`` (40), and
the median step. Where the p99 gap comes from.

The benchmark's request ids are taken for the server's (each request is sent in arrival
order); wherever a log prefilled whole prompts, their lengths are checked against the
records' first.
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections import Counter, defaultdict
from dataclasses import dataclass
from pathlib import Path

from tetri_server.bench.client import RequestRecord
from tetri_server.bench.metrics import tpot_s
from tetri_server.sim import decisions
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


STEP_KINDS = (*decisions.STEP_KINDS, "chunk")  # a prefill worker's steps too


@dataclass(frozen=True)
class RowSteps:
    rows: int
    num_steps: int
    p50_s: float
    mean_ctx: float  # 0.0 without prompt lengths


def decode_only(rec: dict, nxt: dict) -> bool:
    """Whether step ``rec`` did only its decode rows, ``nxt`` being the worker's next step: no
    prompt slice, no recompute, and on a decode worker no hand-off's KV pulled before ``nxt``
    (it drains its inbox, copying the KV, between two steps: with ``nxt`` admitting a
    request the pull is in ``rec``'s interval)."""
    return (bool(rec.get("run")) and not rec.get("slices") and not rec.get("recompute")
            and not rec.get("recompute_tokens") and not admits(nxt))


def admits(nxt: dict | None) -> bool:
    """``nxt``, a decode worker's next step, admits a hand-off: its KV was pulled before it."""
    return nxt is not None and nxt["kind"] == "decode_step" and bool(nxt.get("admit"))


def by_rows(records: list[dict], prompt_lens: dict[int, int] | None = None,
            idle_s: float = 1.0) -> list[RowSteps]:
    """The ``decode_only`` steps of one worker's log by rows, ascending (``--by-rows``); an
    interval to the next step over ``idle_s`` is an idle spell, not a step."""
    steps = [r for r in records if r.get("kind") in STEP_KINDS]
    decoded: Counter[int] = Counter()
    per: dict[int, list[tuple[float, float]]] = defaultdict(list)
    for rec, nxt in zip(steps, steps[1:], strict=False):
        run = rec.get("run", [])
        if decode_only(rec, nxt) and nxt["t"] - rec["t"] <= idle_s:
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


def check_ids(records: list[dict], prompt_lens: dict[int, int]) -> None:
    """Raise unless every prompt the log prefilled from its start has the records' length for
    that id, or no more where the log never finished it (cancelled or failed in its prefill):
    else the ids are not the server's. A request re-run after a worker restart (its prompt then
    holds the tokens already streamed) reads as a mismatch too."""
    starts = {req for rec in records for req, start, _ in rec.get("slices") or [] if start == 0}
    lens = chunked_prompt_lens(records)
    done = set(where_decoded(records)) | {req for rec in records for req in rec.get("run") or []}
    if wrong := [q for q in starts if prompt_lens.get(q) is None or lens[q] > prompt_lens[q]
                 or (q in done and lens[q] != prompt_lens[q])]:
        raise ValueError(f"request ids differ: {len(wrong)} prompts (first id {wrong[0]}) have "
                         "another length in the records")


def split(prefill_records: list[dict], runs: list[dict]) -> dict[str, tuple[int, float, int]]:
    """(requests, mean TPOT in s, SLO misses) of the requests kept, handed off, and neither
    (finished, failed or cancelled in their prefill, or prefilled on a decode worker)
    (``--split``); ``runs``: the benchmark's request records of the same run. Raises when the
    prompt lengths the log chunked are not the records' (the ids would not be the server's)."""
    check_ids(prefill_records, {r["request_id"]: r["prompt_len"] for r in runs})
    where = where_decoded(prefill_records)
    out: dict[str, tuple[int, float, int]] = {}
    for group in ("kept", "handed off", "neither"):
        rs = [r for r in runs if where.get(r["request_id"], "neither") == group]
        recs = [RequestRecord.from_json(r) for r in rs]
        tpots = [t for rec in recs if rec.ok and (t := tpot_s(rec)) is not None]
        out[group] = (len(rs), statistics.mean(tpots) if tpots else 0.0,
                      sum(1 for r in rs if r.get("met_slo") is False))
    return out


@dataclass(frozen=True)
class GapSource:
    log: str
    kind: str  # "prompt slice", "recompute", "hand-off pulled", "first here", "rows only"
    num_gaps: int
    num_long: int  # over the threshold
    step_p50_s: float  # the steps' median time (to the next step's stamp)


def step_kind(rec: dict, nxt: dict | None, first_here: bool) -> str:
    if rec.get("slices"):
        return "prompt slice"
    if rec.get("recompute") or rec.get("recompute_tokens"):
        return "recompute"
    if admits(nxt):
        return "hand-off pulled"
    return "first here" if first_here else "rows only"


def gap_sources(logs: dict[str, list[dict]], runs: list[dict],
                long_s: float = 0.04) -> list[GapSource]:
    """``--gaps``: the gap before a request's token k (k >= 1) is put on the step that made it,
    the k-th step (in time, over every log) whose decode rows held the request; a gap with no
    such step (a row preempted and recomputed, a log cut short) is not counted. Sorted by the
    number of long gaps."""
    made: dict[int, list[tuple[float, str, dict, dict | None]]] = defaultdict(list)
    for name, records in logs.items():
        steps: list[tuple[dict, list[int]]] = []  # a step and the rows that ran in it
        for r in records:
            if r.get("kind") in STEP_KINDS:
                steps.append((r, list(r.get("run") or [])))
            elif r.get("kind") == "rows_wait" and steps:  # planned, not run: no token there
                waited = set(r.get("ids") or [])
                steps[-1][1][:] = [q for q in steps[-1][1] if q not in waited]
        for (rec, ran), (nxt, _) in zip(steps, [*steps[1:], (None, [])], strict=True):
            for req in ran:
                made[req].append((rec["t"], name, rec, nxt))
    gaps: dict[tuple[str, str], list[tuple[float, float | None]]] = defaultdict(list)
    for run in runs:
        times = run.get("token_times_s") or []
        steps = sorted(made.get(run["request_id"], []), key=lambda m: m[0])
        for k in range(1, min(len(times), len(steps) + 1)):
            _, name, rec, nxt = steps[k - 1]
            first_here = k == 1 or steps[k - 2][1] != name
            step_s = None if nxt is None else nxt["t"] - rec["t"]
            gaps[name, step_kind(rec, nxt, first_here)].append((times[k] - times[k - 1], step_s))
    out = [GapSource(name, kind, len(v), sum(1 for g, _ in v if g > long_s),
                     statistics.median([s for _, s in v if s is not None] or [0.0]))
           for (name, kind), v in gaps.items()]
    return sorted(out, key=lambda g: (-g.num_long, -g.num_gaps))


def load_runs(path: Path, point: str | None) -> list[dict]:
    """The request records of one point of a ``bench sweep`` JSON: the only one, or
    ``MODE@RATE`` (rates compared as numbers: ``@1`` and ``@1.0`` are one point)."""
    data = json.loads(path.read_text())
    points = [(m["mode"], p) for m in data["modes"] for p in m["points"]]
    if point is not None:
        mode, _, rate_text = point.rpartition("@")
        try:
            rate = float(rate_text)
        except ValueError:
            raise SystemExit(f"--point {point!r}: not MODE@RATE") from None
        points = [(m, p) for m, p in points if m == mode
                  and p["workload"].get("rate_rps") is not None
                  and float(p["workload"]["rate_rps"]) == rate]
    if len(points) != 1:
        raise SystemExit(f"{path}: {len(points)} points match; name one with --point MODE@RATE")
    return points[0][1]["records"]


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("logs", nargs="*", type=Path)
    p.add_argument("--by-rows", action="store_true", help="decode-only steps by rows")
    p.add_argument("--idle-s", type=float,
                   help="with --by-rows: a longer interval between steps is an idle spell (1)")
    p.add_argument("--records", type=Path, help="the bench sweep JSON of the same run")
    p.add_argument("--point", help="MODE@RATE: the point of --records (when it has several)")
    p.add_argument("--split", type=Path, help="the prefill worker's log (needs --records)")
    p.add_argument("--gaps", action="store_true",
                   help="the client's inter-token gaps by the step that ended them (every "
                   "worker's log, --records)")
    p.add_argument("--gap-ms", type=float, default=40.0, help="with --gaps: a long gap (40)")
    args = p.parse_args(argv)
    if args.records is None and (args.split or args.point or args.gaps):
        p.error("--split, --gaps and --point need --records")
    if args.records is not None and not (args.split or args.by_rows or args.gaps):
        p.error("--records is read by --by-rows, --split and --gaps only")
    if args.gaps and (args.by_rows or not args.logs):
        p.error("--gaps reads every worker's log, not with --by-rows")
    if args.idle_s is not None and not args.by_rows:
        p.error("--idle-s is read by --by-rows only")
    if not (args.logs or args.split):
        p.error("nothing to read: give logs, or --split")
    runs = load_runs(args.records, args.point) if args.records else None
    lens = {r["request_id"]: r["prompt_len"] for r in runs} if runs else None
    if args.split is not None:
        assert runs is not None
        for group, (n, tpot, missed) in split(read_log(args.split), runs).items():
            print(f"{group}: {n} requests, mean TPOT {tpot * 1e3:.1f} ms, {missed} missed the SLOs")
    if args.gaps:
        assert runs is not None
        sources = gap_sources({path.name: read_log(path) for path in args.logs}, runs,
                              args.gap_ms / 1e3)
        total, long = sum(g.num_gaps for g in sources), sum(g.num_long for g in sources)
        print(f"{total} gaps, {long} over {args.gap_ms:g} ms ({long / max(total, 1):.1%}), by "
              "the step that ended them:")
        for g in sources:
            print(f"  {g.log}, {g.kind}: {g.num_gaps} gaps ({g.num_gaps / total:.1%}), "
                  f"{g.num_long} over; step p50 {g.step_p50_s * 1e3:.1f} ms")
        return
    for path in args.logs:
        records = read_log(path)
        if args.by_rows:
            if lens is not None:
                check_ids(records, lens)
            print(f"{path}: decode-only steps by rows (rows: median ms, steps"
                  + (", mean context" if lens else "") + ")")
            for r in by_rows(records, lens, 1.0 if args.idle_s is None else args.idle_s):
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
