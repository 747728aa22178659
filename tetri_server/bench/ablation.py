"""``bench ablation``: one table per workload, each row changing one thing from the defaults.

    tetri-server bench ablation --model M --workload LPHD --rate 0.4 --num-requests 50 \\
        --repeat 2 --json ablation.json [--rows sjf,refined] [--dry-run]

Every row is a tetri_server started by ``compare.tetri_spec`` (a cluster mode or a
``MODE_PRESETS`` name plus ``--set`` items), one server at a time, every workload of the run
against it; ``coupled`` always runs, since every row is divided by the coupled row of the same
run. ``--repeat K`` runs the whole set of rows K times (rows interleaved, every other repeat in
reverse order, so that drifting load from other tenants spreads over all rows) and reports the
mean and the spread of each metric.

A row is compared against ``base``: ``default`` (disaggregated with the shipped config), or a
reference row with the same extra settings — e.g. the admission rows all run under a KV pool
small enough to bind (``--pool-blocks``), so greedy and reserve-static are read against
``pool-reserve-dynamic``, not against the default's roomy pool.
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, TypeVar

from tetri_server.bench import report
from tetri_server.bench.breakdown import breakdown_table, plot_load_cdfs, results_as_sweep
from tetri_server.bench.compare import (
    CompareOptions,
    ServerSpec,
    free_port,
    run_against,
    tetri_spec,
)
from tetri_server.bench.metrics import SLO, Summary
from tetri_server.bench.workload import BenchRequest, WorkloadSpec

T = TypeVar("T")

BASELINE = "coupled"
POOL = "@pool"  # stands for kv.num_blocks=<--pool-blocks> in a row's settings
FAST_FLIP = ("flip.idle_s=5", "flip.low_load=0.1", "flip.window_s=10", "flip.min_interval_s=20")
TWO_DECODE = ("cluster.decode_workers=2",)


@dataclass(frozen=True)
class Row:
    """One server configuration: ``mode`` (cluster mode or preset) plus ``sets``."""

    name: str
    lever: str  # what the row varies, e.g. "sort window"
    mode: str = "disaggregated"
    sets: tuple[str, ...] = ()
    base: str = "default"  # the row this one changes one thing of

    def settings(self, pool_blocks: int) -> tuple[str, ...]:
        # an "elastic P/D" row varies an elastic key, so it runs elastic on either device
        # (cluster.elastic = auto is the strict split on cuda); the presets name it themselves
        on = ("cluster.elastic=on",) if self.lever == "elastic P/D" \
            and self.mode == "disaggregated" else ()
        return on + tuple(f"kv.num_blocks={pool_blocks}" if s == POOL else s for s in self.sets)


ROWS: tuple[Row, ...] = (
    Row("coupled", "baseline", mode="coupled", base=""),
    Row("coupled-chunked", "baseline", mode="coupled-chunked", base="coupled"),
    Row("default", "defaults", base="coupled"),
    # the paper's three orders in the sort window (the default is srpt since session 41)
    Row("fcfs", "sort window", sets=("prefill.policy=fcfs",)),
    Row("sjf", "sort window", sets=("prefill.policy=sjf",)),
    Row("ljf", "sort window", sets=("prefill.policy=ljf",)),
    # the fewest remaining prompt tokens first over the whole queue, pausing a started prompt
    Row("srpt", "sort window", sets=("prefill.policy=srpt",)),
    # a chunk that finishes a prompt carries only prompts it finishes
    Row("finish-alone", "sort window", sets=("prefill.finish_alone=true",)),
    # prefill non-preemptive: a short prompt waits for the whole of a started long one (the
    # default to session 37; session 36's E48: short prompts' p90 start 2-5x coupled's)
    Row("overtake-0", "sort window", sets=("prefill.overtake_share=0",)),
    # prompts that fit whole in 3/4 of a step, not half, go ahead of a started long one
    Row("overtake-0.75", "sort window", sets=("prefill.overtake_share=0.75",)),
    Row("chunk-64", "chunk size", sets=("prefill.chunk_size=64",)),
    Row("chunk-256", "chunk size", sets=("prefill.chunk_size=256",)),
    Row("chunk-512", "chunk size", sets=("prefill.chunk_size=512",)),
    Row("admit-greedy", "decode admission", sets=("decode.policy=greedy",)),
    # the config refuses reserve admission without a prediction: none runs greedy
    Row("predictor-none", "predictor", sets=("predictor.kind=none", "decode.policy=greedy"),
        base="admit-greedy"),
    Row("predictor-oracle", "predictor", sets=("predictor.kind=oracle",)),
    Row("pool-reserve-dynamic", "decode admission (small pool)", sets=(POOL,)),
    Row("pool-reserve-static", "decode admission (small pool)",
        sets=(POOL, "decode.policy=reserve-static"), base="pool-reserve-dynamic"),
    Row("pool-greedy", "decode admission (small pool)", sets=(POOL, "decode.policy=greedy"),
        base="pool-reserve-dynamic"),
    # a preempted request recomputed whole in one step (to session 48), not 256 tokens a step
    Row("pool-recompute-whole", "recompute (small pool)",
        sets=(POOL, "decode.policy=greedy", "decode.recompute_tokens=0"), base="pool-greedy"),
    # running requests preempted while waiting ones keep their KV (session 48's order; the
    # session-49 hand-off check stays on)
    Row("pool-waiting-kv-kept", "preemption (small pool)",
        sets=(POOL, "decode.waiting_kv_first=false"), base="pool-reserve-dynamic"),
    Row("refined", "refined estimate", sets=("decode.estimate=refined",)),
    Row("pool-refined", "refined estimate (small pool)",
        sets=(POOL, "decode.estimate=refined"), base="pool-reserve-dynamic"),
    Row("dispatch-power-of-two", "dispatcher (2 decode workers)", sets=TWO_DECODE),
    Row("dispatch-round-robin", "dispatcher (2 decode workers)",
        sets=(*TWO_DECODE, "dispatch.policy=round-robin"), base="dispatch-power-of-two"),
    Row("flip", "flip (2 decode workers)", sets=(*TWO_DECODE, "flip.enabled=true", *FAST_FLIP),
        base="dispatch-power-of-two"),
    Row("split", "elastic P/D", mode="split"),  # the paper's strict split (elastic off)
    # ... with the prefill worker's queue in srpt order and finishing chunks alone (session 41)
    Row("split-srpt", "sort window (split)", mode="split",
        sets=("prefill.policy=srpt", "prefill.finish_alone=true"), base="split"),
    Row("elastic", "elastic P/D", mode="elastic"),
    Row("elastic-prefill", "elastic P/D", mode="elastic-prefill"),
    Row("elastic-decode", "elastic P/D", mode="elastic-decode"),
    # keep only while prompt steps took at most 30% of the last 10 s (the default to session 23
    # and in sessions 41-52; the default keeps whatever the load)
    Row("prompt-share-0.3", "elastic P/D", sets=("prefill.local_decode_max_prompt_share=0.3",)),
    # hand kept requests back when prompts queue (prefill.local_decode_hand_back)
    Row("hand-back", "elastic P/D", sets=("prefill.local_decode_hand_back=true",)),
    # keep a request at any load, not only where it decodes faster (the default to session 29)
    Row("keep-any", "elastic P/D", sets=("prefill.local_decode_balance=false",)),
    # the decode worker's prompt slices: 256 prompt tokens a step whatever the chunk (sessions
    # 27's E6-E9, when the default was 1024 a step), and 1024 a step (the default to session 28;
    # now at most the prefill chunk)
    Row("decode-slice-256", "elastic P/D", sets=("decode.local_prefill_tokens=256",
                                                 "decode.local_prefill_slice=fixed")),
    Row("decode-slice-1024", "elastic P/D", sets=("decode.local_prefill_slice=fixed",)),
    # steps with decode rows fill the whole chunk on both sides (the default to session 30)
    Row("mixed-full-chunk", "elastic P/D", sets=("prefill.local_decode_chunk=0",)),
    # ... on the prefill worker only: its steps with kept rows take the whole chunk (prompts
    # at the chunk's rate), the decode worker's prompt slices stay at 128 tokens beside its
    # batch (at most the chunk; E35-E37 ran with decode.local_prefill_slice=fixed, the same
    # slices where the chunk is over 128)
    Row("prefill-full-chunk", "elastic P/D", base="mixed-full-chunk",
        sets=("prefill.local_decode_chunk=0", "decode.local_prefill_tokens=128")),
    # ... and the prefill queue shortest-first (its short prompts waited behind whole chunks
    # of long ones: 1.25x coupled's TTFT at Mixed 1.5 req/s, long ones 1.06x; session 35)
    Row("prefill-full-chunk-sjf", "elastic P/D", base="prefill-full-chunk",
        sets=("prefill.local_decode_chunk=0", "decode.local_prefill_tokens=128",
              "prefill.policy=sjf")),
    # ... or 256 tokens (on the Intel machine of session 32, 94% of the chunk's prompt rate
    # beside 16 rows, against 76% at 128)
    Row("mixed-chunk-256", "elastic P/D", sets=("prefill.local_decode_chunk=256",)),
    # a prefill worker keeps up to 32 requests, not 16 (its chunk is calibrated with 32 rows)
    Row("local-decode-batch-32", "elastic P/D", sets=("prefill.local_decode_batch=32",)),
    # fewer kept requests: each adds its context's K/V reads to every prefill step (16 at
    # 500 tokens of context: a 128-token step 35 -> 59 ms on the Intel machine, session 35)
    Row("local-decode-batch-8", "elastic P/D", sets=("prefill.local_decode_batch=8",)),
    Row("local-decode-batch-4", "elastic P/D", sets=("prefill.local_decode_batch=4",)),
    # a prefill worker keeps a short request too, where it decodes faster there (balance)
    Row("keep-short", "elastic P/D", sets=("prefill.local_decode_min_tokens=0",)),
    # a prompt goes to a decode worker whenever the prefill worker has more queued, as a
    # coupled cluster spreads prompts (not only beyond a chunk more); then short ones kept too
    Row("decode-margin-0", "elastic P/D", sets=("decode.local_prefill_margin=0",)),
    # a prompt backlog within a mixed step runs alone, the kept rows waiting one step
    Row("prompt-first", "elastic P/D", sets=("prefill.local_decode_prompt_first=true",)),
    Row("margin-0-keep-short", "elastic P/D", base="decode-margin-0",
        sets=("decode.local_prefill_margin=0", "prefill.local_decode_min_tokens=0")),
    # a decode worker takes a prompt only while its recent step is at most 3x its fastest
    # (the benchmark's TPOT SLO: 3x the unloaded step)
    Row("decode-gap-3x", "elastic P/D", sets=("decode.local_prefill_max_gap_x=3",)),
    # past ~two Mixed prompts of backlog, the prefill worker's steps with kept rows take the
    # whole chunk (prompts at the chunk's rate) instead of local_decode_chunk
    Row("full-chunk-backlog", "elastic P/D",
        sets=("prefill.local_decode_full_chunk_backlog=1024",)),
    # ... or while steps with prompt tokens took less than 25% of the worker's last 10 s
    # (on Mixed on the Intel machine in session 33, about 0.9 req/s: whole chunks there had
    # the better TTFT and p99 gap, 128 the better p99 gap from about 1.2 req/s)
    Row("full-chunk-share-0.25", "elastic P/D",
        sets=("prefill.local_decode_full_chunk_share=0.25",)),
    # every request hands off, those of at most 16 tokens too (the default keeps them on the
    # prefill worker, its steps beside them at most 16 prompt tokens; session 42)
    Row("finish-0", "elastic P/D", sets=("prefill.local_finish_tokens=0",)),
)
ROW_NAMES = tuple(r.name for r in ROWS)


def select_rows(names: str | None) -> list[Row]:
    """The rows named (comma-separated; all when None) in table order, the coupled baseline
    always among them. An unknown name is an error listing the known ones."""
    if names is None:
        return list(ROWS)
    wanted = {n.strip() for n in names.split(",") if n.strip()}
    unknown = sorted(wanted - set(ROW_NAMES))
    if unknown:
        raise ValueError(f"unknown rows {', '.join(unknown)}; known: {', '.join(ROW_NAMES)}")
    return [r for r in ROWS if r.name in wanted | {BASELINE}]


def run_order(rows: Sequence[T], repeat: int) -> list[T]:
    """The rows of repeat ``repeat`` (from 0) in the order they run: as given on even repeats,
    reversed on odd ones, so a load that drifts steadily through the run weighs on every row
    alike over two repeats (A B C, C B A)."""
    return list(rows) if repeat % 2 == 0 else list(rows)[::-1]


def row_spec(row: Row, model: str, port: int, max_model_len: int, sets: Sequence[str],
             pool_blocks: int) -> ServerSpec:
    """The server of ``row``: ``sets`` (every row's) first, the row's own after, so they win."""
    spec = tetri_spec(row.mode, model, port, max_model_len, (*sets, *row.settings(pool_blocks)))
    return replace(spec, label=row.name)


def command_lines(rows: Sequence[Row], model: str, max_model_len: int, sets: Sequence[str],
                  pool_blocks: int) -> str:
    lines = []
    for r in rows:
        spec = row_spec(r, model, 0, max_model_len, sets, pool_blocks)
        lines.append(f"# {r.name} ({r.lever}; vs {r.base or '-'})\n{shlex.join(spec.argv)}")
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------------- the table


def _mean(xs: Sequence[float | None]) -> float | None:
    vals = [x for x in xs if x is not None]
    return statistics.fmean(vals) if vals else None


METRICS: dict[str, Callable[[Summary], float | None]] = {
    "ttft_mean_s": lambda s: s.ttft_s.mean,
    "ttft_p90_s": lambda s: s.ttft_s.p90,
    "jct_mean_s": lambda s: s.jct_s.mean,
    "itl_p99_s": lambda s: s.itl_s.p99,
    "slo_attainment": lambda s: s.slo_attainment,
}


def aggregate(summaries: Sequence[Summary]) -> dict[str, Any]:
    """Means over the repeats of one (workload, row); ``spread``: (max - min) / mean per
    metric (0 with one repeat); busy seconds averaged per ``worker:role``."""
    out: dict[str, Any] = {"repeats": len(summaries),
                           "done": sum(s.num_completed for s in summaries),
                           "sent": sum(s.num_requests for s in summaries), "spread": {}}
    for key, get in METRICS.items():
        vals = [v for v in map(get, summaries) if v is not None]
        out[key] = _mean(vals)
        out["spread"][key] = (max(vals) - min(vals)) / out[key] if vals and out[key] else 0.0
    busy: dict[str, list[float]] = {}
    for s in summaries:
        for k, v in (s.busy_s or {}).items():
            busy.setdefault(k, []).append(v)
    out["busy_s"] = {k: statistics.fmean(v) for k, v in sorted(busy.items())}
    return out


def _num(x: float | None, scale: float = 1.0, digits: int = 2) -> str:
    return "n/a" if x is None else f"{x * scale:.{digits}f}"


def _ratio(x: float | None, base: float | None) -> str:
    r = report.ratio(x, base)
    return "n/a" if r is None else f"{r:.2f}"


def _busy(busy: dict[str, float]) -> str:
    return " ".join(f"{k} {v:.1f}" for k, v in busy.items()) or "n/a"


def workload_table(workload: str, rows: Sequence[Row], agg: dict[str, dict[str, Any]]) -> str:
    """Markdown for one workload: a line per row that ran, ratios to the coupled row."""
    base = agg.get(BASELINE, {})
    head = (f"#### {workload}\n\n| row | changes | vs | done | TTFT mean / p90 (s) | JCT mean (s) "
            "| ITL p99 (ms) | SLO att. | busy s per worker | TTFT / JCT / ITL p99 vs coupled "
            "| JCT vs its base | spread (JCT) |\n" + "|---" * 12 + "|\n")
    lines = []
    for r in rows:
        a = agg.get(r.name)
        if a is None:
            continue
        changes = ", ".join(s.replace(POOL, "small pool") for s in r.sets) or (
            r.mode if r.mode != "disaggregated" else "-")
        ratios = " / ".join(_ratio(a[k], base.get(k))
                            for k in ("ttft_mean_s", "jct_mean_s", "itl_p99_s"))
        own_base = agg.get(r.base, {}) if r.base else {}
        lost = [x for x in (a, base, own_base) if x.get("done", 0) < x.get("sent", 0)]
        mark = " †" if lost else ""  # means over completed requests: a side lost some
        ratios += mark
        lines.append(
            f"| {r.name} | {changes} | {r.base or '-'} | {a['done']}/{a['sent']} "
            f"| {_num(a['ttft_mean_s'])} / {_num(a['ttft_p90_s'])} | {_num(a['jct_mean_s'])} "
            f"| {_num(a['itl_p99_s'], 1e3, 1)} | {_num(a['slo_attainment'])} "
            f"| {_busy(a['busy_s'])} | {ratios} "
            f"| {_ratio(a['jct_mean_s'], own_base.get('jct_mean_s'))}{mark} "
            f"| {a['spread']['jct_mean_s']:.0%} |")
    return head + "\n".join(lines) + "\n"


def tables(rows: Sequence[Row], results: Sequence[report.BenchResult], slo: SLO) -> str:
    by: dict[str, dict[str, list[Summary]]] = {}
    for res in results:
        by.setdefault(res.spec.name, {}).setdefault(res.mode, []).append(res.summary)
    text = "\n".join(workload_table(w, rows, {m: aggregate(ss) for m, ss in per.items()})
                     for w, per in by.items())
    return text + (f"\nSLO attainment: share of requests with TTFT <= {slo.ttft_s} s and "
                   f"TPOT <= {slo.tpot_s * 1e3:.0f} ms. Spread: (max - min) / mean over the "
                   "repeats. †: this row, coupled or its base failed requests (done < "
                   "sent); latency means cover completed requests only, so a side that lost "
                   "its slowest looks faster.\n")


# ---------------------------------------------------------------------- the command


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--rows", help=f"comma-separated subset of: {', '.join(ROW_NAMES)}")
    p.add_argument("--repeat", type=int, default=1, help="runs of every row (default 1)")
    p.add_argument("--pool-blocks", type=int, default=160,
                   help="kv.num_blocks of the small-pool rows (default 160: 2560 tokens)")
    p.add_argument("--json", type=Path, help="summary file (default --out/ablation.json)")
    p.add_argument("--dry-run", action="store_true", help="print every row's server command")
    p.add_argument("--set", action="append", default=[], help="key=value for every row")
    p.add_argument("--ready-timeout-s", type=float, default=300.0)


def main(args: argparse.Namespace, build: Callable[[argparse.Namespace],
                                                  list[tuple[WorkloadSpec, list[BenchRequest]]]],
         max_model_len: Callable[[argparse.Namespace], int]) -> int:
    try:
        rows = select_rows(args.rows)
    except ValueError as exc:
        raise SystemExit(str(exc)) from exc
    if args.dry_run:
        print(command_lines(rows, args.model, max_model_len(args), args.set, args.pool_blocks))
        return 0
    machine = report.machine_info()  # before the runs: the load average of an idle machine
    built = build(args)
    slo = SLO(args.slo_ttft_s, args.slo_tpot_s)
    # the oracle row reads each request's true length; the other rows ignore the field
    opts = CompareOptions(args.out, slo, args.max_concurrency, args.request_timeout_s,
                          not args.no_progress, send_true_output_len=True,
                          num_warmups=args.num_warmups,
                          hidden_len_context=max_model_len(args) if args.hide_output_len
                          else None)
    max_len = built[0][0].max_model_len
    results: list[report.BenchResult] = []
    for k in range(args.repeat):
        for r in run_order(rows, k):
            spec = row_spec(r, args.model, free_port(), max_len, args.set, args.pool_blocks)
            spec = replace(spec, ready_timeout_s=args.ready_timeout_s)
            print(f"ablation: repeat {k + 1}/{args.repeat}, row {r.name}", file=sys.stderr)
            results += run_against(spec, built, replace(opts, out_dir=args.out / f"r{k}"))
    text = tables(rows, results, slo)
    pooled = results_as_sweep([r.to_dict() for r in results])
    text += "\n" + breakdown_table(pooled)
    if not args.no_plots:
        plot_load_cdfs(pooled, args.out)  # cdf_<workload>_<rate>.png, every row's requests
    out_json = args.json or args.out / "ablation.json"
    out_json.parent.mkdir(parents=True, exist_ok=True)
    payload = {"argv": args.argv, "machine": machine,
               "rows": [vars_of(r, args.pool_blocks) for r in rows],
               "table": text, "results": [r.to_dict(include_records=False) for r in results]}
    out_json.write_text(json.dumps(payload, indent=1))
    report.write_json(results, args.out / "results.json", machine)  # every request's record
    (args.out / "table.md").write_text(text)
    print(text)
    print(f"results in {out_json}", file=sys.stderr)
    return 0 if all(r.summary.num_errors == 0 for r in results) else 1


def vars_of(row: Row, pool_blocks: int) -> dict[str, Any]:
    return {"name": row.name, "lever": row.lever, "mode": row.mode,
            "sets": list(row.settings(pool_blocks)), "base": row.base}
