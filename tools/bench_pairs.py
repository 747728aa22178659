"""Two long prompts in quick succession: does the first one decode while the second is
prefilled? The scenario behind HPLD's slow decodes (elastic P/D, docs/benchmarks.md).

    .venv/bin/python tools/bench_pairs.py [--model models/llama-bench] [--pairs 6] [--gap-s 0.5]
        [--rows coupled,disaggregated,split] [--repeat 2] [--json OUT.json]

Per pair: A (``--prompt-len`` random tokens, ``--output-len`` tokens, ``ignore_eos``) at t, B
(the same lengths) at t + ``--gap-s`` — B arrives while A is still being prefilled — with
pairs ``--period-s`` apart (open loop: keep it above a pair's JCT). With 1 prefill + 1 decode
worker and the elastic decode side on, B goes to the idle decode worker and is prefilled there
in one long step; A, prefilled meanwhile on the prefill worker, then either waits behind B's
prefill on the decode worker or is kept and decoded by the (now idle) prefill worker. Coupled
runs A and B on its two workers side by side: the baseline. Each row is a server of
``compare.tetri_spec`` (a cluster mode or a preset such as ``split``), started fresh, rows in
reverse order every other repeat. The report: A's JCT, B's TTFT and JCT (means over the pairs
but the first, a warm-up), the ratios against coupled's in the same repeat, the machine's ISA
and the other tenants' load.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

from tetri_server.bench.ablation import run_order
from tetri_server.bench.client import ClientConfig, fetch_model_name, run_benchmark
from tetri_server.bench.compare import free_port, running_server, tetri_spec
from tetri_server.bench.cpu import machine_busy_cpu_s
from tetri_server.bench.report import git_commit
from tetri_server.bench.workload import BenchRequest

MAX_MODEL_LEN = 2048


def pair_requests(num_pairs: int, prompt_len: int, output_len: int, gap_s: float,
                  period_s: float, vocab: int, seed: int) -> list[BenchRequest]:
    """A at 2i, B at 2i + 1 (request ids), random prompts (ids 0-3 are the specials)."""
    rng = random.Random(seed)
    out = []
    for i in range(num_pairs):
        for j, at in enumerate((i * period_s, i * period_s + gap_s)):
            prompt = [rng.randrange(4, vocab) for _ in range(prompt_len)]
            out.append(BenchRequest(2 * i + j, prompt, prompt_len, output_len, at, "AB"[j],
                                    "random"))
    return out


def measure(base_url: str, reqs: list[BenchRequest]) -> dict[str, Any]:
    model = asyncio.run(fetch_model_name(base_url))
    cfg = ClientConfig(base_url, model, progress=False, label="pairs")  # ignore_eos: always
    busy0, t0 = machine_busy_cpu_s(), time.monotonic()
    result = asyncio.run(run_benchmark(reqs, cfg, scrape_metrics=False))
    busy = (machine_busy_cpu_s() - busy0) / (time.monotonic() - t0)
    recs = sorted(result.records, key=lambda r: r.request_id)
    failed = [r for r in recs if not r.ok]
    if failed:
        raise RuntimeError(f"{len(failed)} requests failed, first: {failed[0].error}")
    pairs = [(recs[k], recs[k + 1]) for k in range(2, len(recs), 2)]  # the first: a warm-up

    def mean(xs: list[float]) -> float:
        return statistics.fmean(xs)

    return {"a_ttft_s": mean([a.first_token_s - a.send_s for a, _ in pairs]),
            "a_jct_s": mean([a.end_s - a.send_s for a, _ in pairs]),
            "b_ttft_s": mean([b.first_token_s - b.send_s for _, b in pairs]),
            "b_jct_s": mean([b.end_s - b.send_s for _, b in pairs]),
            "a_jct_per_pair_s": [a.end_s - a.send_s for a, _ in pairs],
            "machine_busy_cores": busy}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="models/llama-bench")
    ap.add_argument("--rows", default="coupled,disaggregated,split")
    ap.add_argument("--pairs", type=int, default=6, help="pairs per server, the first a warm-up")
    ap.add_argument("--prompt-len", type=int, default=1000)
    ap.add_argument("--output-len", type=int, default=20)
    ap.add_argument("--gap-s", type=float, default=0.5, help="B's arrival after A's")
    ap.add_argument("--period-s", type=float, default=4.0, help="between pairs")
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--set", action="append", default=[], help="key=value for every server")
    ap.add_argument("--logs", default="bench_results/pairs-logs")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    model = str(Path(args.model).resolve())
    vocab = json.loads((Path(model) / "config.json").read_text())["vocab_size"]
    rows = [r.strip() for r in args.rows.split(",") if r.strip()]
    if "coupled" not in rows:
        rows.insert(0, "coupled")
    reqs = pair_requests(args.pairs + 1, args.prompt_len, args.output_len, args.gap_s,
                         args.period_s, vocab, seed=7)
    runs: list[dict[str, dict[str, Any]]] = []
    for k in range(args.repeat):
        got: dict[str, dict[str, Any]] = {}
        for row in run_order(rows, k):
            print(f"repeat {k + 1}/{args.repeat}: {row}", file=sys.stderr, flush=True)
            spec = tetri_spec(row, model, free_port(), MAX_MODEL_LEN, args.set)
            with running_server(spec, Path(args.logs) / f"{row}-{k}.log"):
                got[row] = measure(spec.base_url, reqs)
        runs.append(got)

    isa = torch.backends.cpu.get_cpu_capability()
    print(f"`tools/bench_pairs.py --rows {','.join(rows)} --pairs {args.pairs} --gap-s "
          f"{args.gap_s} --repeat {args.repeat}` at {git_commit()}, "
          f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, {platform.machine()}, ISA "
          f"{isa}, {os.cpu_count()} cores; prompts {args.prompt_len} tokens, outputs "
          f"{args.output_len}")
    print()
    print("| repeat | row | A JCT (s) | B TTFT (s) | B JCT (s) | A JCT / B TTFT / mean JCT vs "
          "coupled | machine busy (cores) |")
    print("|---|---|---:|---:|---:|---|---:|")
    for k, got in enumerate(runs):
        base = got["coupled"]
        for row, r in got.items():
            mean_jct = (r["a_jct_s"] + r["b_jct_s"]) / 2
            base_jct = (base["a_jct_s"] + base["b_jct_s"]) / 2
            print(f"| {k + 1} | {row} | {r['a_jct_s']:.2f} | {r['b_ttft_s']:.2f} "
                  f"| {r['b_jct_s']:.2f} | {r['a_jct_s'] / base['a_jct_s']:.2f} / "
                  f"{r['b_ttft_s'] / base['b_ttft_s']:.2f} / {mean_jct / base_jct:.2f} "
                  f"| {r['machine_busy_cores']:.2f} |")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps({"runs": runs, "argv": sys.argv, "isa": isa,
                                               "commit": git_commit()}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
