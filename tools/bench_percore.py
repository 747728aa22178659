"""Per core against vLLM-CPU: the same model, fp32, both eager, compute on ONE core.

    .venv/bin/python tools/bench_percore.py [--model models/llama-bench] [--vllm PATH]
        [--repeat 2] [--prefill-requests 5] [--streams 16] [--json OUT.json]
        [--baseline-checkout DIR]

tetri_server runs ``coupled`` with one worker and one torch thread (pinned to core 0; the
API/control process floats); vLLM-CPU runs as in docs/peer-vllm-cpu.md (eager, float32, no
prefix caching, no chunked prefill) with ``VLLM_CPU_OMP_THREADS_BIND=0`` (its worker's compute
on core 0; its frontend on the other core). The servers run one at a time, ``--repeat`` rounds
alternating ours / vLLM, each started fresh; one client (tetri_server's benchmark client, the
same for both). Per round and server:

- prefill: ``--prefill-requests`` prompts of 1,024 random token ids, ``max_tokens`` 1, one at a
  time; the median latency (send to end of response);
- decode: ``--streams`` concurrent requests of 128-token prompts and 128 output tokens
  (``ignore_eos``); the mean inter-token gap over all streams (first token excluded);

after a warm-up of two short requests. ``--baseline-checkout DIR`` adds another checkout
(a worktree of an older commit) to every round, served from its directory, for a before/after
in the same run. The report prints each number per round, the
ratios ours / vLLM (target <= 0.8 for both), the machine's ISA and the other tenants' load.
Without vLLM installed it measures ours alone and says so.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
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
from tetri_server.bench.client import (
    ClientConfig,
    RequestRecord,
    RunResult,
    fetch_model_name,
    run_benchmark,
)
from tetri_server.bench.compare import (
    find_vllm,
    free_port,
    running_server,
    tetri_spec,
    vllm_spec,
)
from tetri_server.bench.cpu import machine_busy_cpu_s
from tetri_server.bench.metrics import itls_s
from tetri_server.bench.report import git_commit
from tetri_server.bench.workload import BenchRequest

PREFILL_LEN = 1024
STREAM_PROMPT_LEN = 128
STREAM_OUTPUT_LEN = 128
MAX_MODEL_LEN = 2048
TARGET = 0.8


def random_prompt(rng: random.Random, n: int, vocab: int) -> list[int]:
    return [rng.randrange(4, vocab) for _ in range(n)]  # ids 0-3 are the specials


def requests(prompts: list[list[int]], output_len: int) -> list[BenchRequest]:
    return [BenchRequest(i, p, len(p), output_len, 0.0, "percore", "random")
            for i, p in enumerate(prompts)]


def completed(rec: RequestRecord) -> bool:
    """Answered in full: a one-token reply of a random model may be a partial UTF-8 character,
    so no text arrives; usage still counts the token."""
    return rec.ok or (rec.http_status == 200 and rec.num_output_tokens == rec.output_len)


def run(reqs: list[BenchRequest], base_url: str, model: str, concurrency: int | None,
        label: str) -> RunResult:
    cfg = ClientConfig(base_url, model, max_concurrency=concurrency, progress=False,
                       label=label)
    result = asyncio.run(run_benchmark(reqs, cfg, scrape_metrics=False))
    failed = [r for r in result.records if not completed(r)]
    if failed:
        raise RuntimeError(f"{label}: {len(failed)} requests failed, first: {failed[0].error}")
    return result


def measure(base_url: str, rng: random.Random, vocab: int, n_prefill: int,
            n_streams: int) -> dict[str, Any]:
    """The two numbers of one round against a running server."""
    model = asyncio.run(fetch_model_name(base_url))
    warm = [random_prompt(rng, 16, vocab) for _ in range(2)]
    run(requests(warm, 4), base_url, model, 1, "warm-up")
    pre = run(requests([random_prompt(rng, PREFILL_LEN, vocab) for _ in range(n_prefill)], 1),
              base_url, model, 1, "prefill")
    latencies = [r.end_s - r.send_s for r in pre.records
                 if r.end_s is not None and r.send_s is not None]
    streams = run(requests([random_prompt(rng, STREAM_PROMPT_LEN, vocab)
                            for _ in range(n_streams)], STREAM_OUTPUT_LEN),
                  base_url, model, None, "decode")
    gaps = [g for r in streams.records for g in itls_s(r)]
    return {"prefill_latency_s": latencies, "prefill_median_s": statistics.median(latencies),
            "itl_mean_s": statistics.fmean(gaps), "itl_p50_s": statistics.median(gaps),
            "num_gaps": len(gaps)}


def serve_and_measure(spec: Any, log: Path, rng_seed: int, vocab: int, n_prefill: int,
                      n_streams: int) -> dict[str, Any]:
    busy0, t0 = machine_busy_cpu_s(), time.monotonic()
    with running_server(spec, log):
        start_s = time.monotonic() - t0
        busy1, t1 = machine_busy_cpu_s(), time.monotonic()
        out = measure(spec.base_url, random.Random(rng_seed), vocab, n_prefill, n_streams)
        out["machine_busy_cores"] = (machine_busy_cpu_s() - busy1) / (time.monotonic() - t1)
    out["start_s"] = start_s
    out["startup_busy_cores"] = (busy1 - busy0) / max(t1 - t0, 1e-9)  # its own loading included
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="models/llama-bench")
    ap.add_argument("--vllm", default=None, help="path of the vllm CLI (default: on PATH)")
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--prefill-requests", type=int, default=5)
    ap.add_argument("--streams", type=int, default=16)
    ap.add_argument("--logs", default="bench_results/percore-logs")
    ap.add_argument("--json", default=None)
    ap.add_argument("--baseline-checkout", default=None,
                    help="another checkout of tetri_server (e.g. `git worktree add /tmp/old "
                         "REV`), served from its directory in the same rounds as 'baseline'")
    args = ap.parse_args()
    model = str(Path(args.model).resolve())
    vocab = json.loads((Path(model) / "config.json").read_text())["vocab_size"]
    vllm_cmd = find_vllm(args.vllm)
    logs = Path(args.logs)

    def ours(cwd: str | None = None) -> Any:
        spec = tetri_spec("coupled", model, free_port(), MAX_MODEL_LEN,
                          ("cluster.workers=1", "cluster.threads_per_worker=1"))
        return dataclasses.replace(spec, cwd=cwd)

    def baseline() -> Any:
        return ours(str(Path(args.baseline_checkout).resolve()))

    def vllm() -> Any:
        assert vllm_cmd is not None
        spec = vllm_spec(vllm_cmd, model, free_port(), MAX_MODEL_LEN)
        spec.env["VLLM_CPU_OMP_THREADS_BIND"] = "0"
        return spec

    rounds: list[dict[str, Any]] = []
    for i in range(args.repeat):
        row: dict[str, Any] = {}
        # reversed every other round (``run_order``), so a machine that drifts steadily through
        # the run weighs on each server alike over two rounds
        order = (("baseline", baseline), ("tetri", ours), ("vllm", vllm))
        for label, make in run_order(order, i):
            if (label == "vllm" and vllm_cmd is None
                    or label == "baseline" and not args.baseline_checkout):
                continue
            print(f"round {i + 1}/{args.repeat}: {label}", file=sys.stderr, flush=True)
            row[label] = serve_and_measure(make(), logs / f"{label}-{i}.log", 1000 + i, vocab,
                                           args.prefill_requests, args.streams)
        rounds.append(row)

    isa = torch.backends.cpu.get_cpu_capability()
    print(f"`tools/bench_percore.py --repeat {args.repeat}` at {git_commit()} on "
          f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, {platform.machine()}, ISA "
          f"{isa}, {os.cpu_count()} cores; model {Path(model).name} fp32; compute on core 0 "
          "for both; vLLM " + ("`" + " ".join(vllm_cmd) + "`" if vllm_cmd else "NOT INSTALLED")
          + (f"; baseline: `{args.baseline_checkout}` at "
             f"{git_commit(Path(args.baseline_checkout))}" if args.baseline_checkout else ""))
    print()
    print("| round | server | 1024-token prefill, median (ms) | mean inter-token gap, "
          f"{args.streams} streams (ms) | machine busy during (cores) "
          "| busy during its start-up, its own loading included (cores) |")
    print("|---|---|---:|---:|---:|---:|")
    for i, row in enumerate(rounds):
        for label, r in row.items():
            print(f"| {i + 1} | {label} | {1e3 * r['prefill_median_s']:.1f} "
                  f"| {1e3 * r['itl_mean_s']:.2f} | {r['machine_busy_cores']:.2f} "
                  f"| {r['startup_busy_cores']:.2f} |")
    summary: dict[str, Any] = {}
    if vllm_cmd is not None:
        print()
        for key, name in (("prefill_median_s", "1024-token prefill latency"),
                          ("itl_mean_s", "mean inter-token gap")):
            ratios = [row["tetri"][key] / row["vllm"][key] for row in rounds]
            r = statistics.median(ratios)
            summary[key] = ratios
            verdict = "MET" if r <= TARGET else "MISSED"
            print(f"- {name}: ours / vLLM = {r:.2f} (per round "
                  f"{', '.join(f'{x:.2f}' for x in ratios)}; target <= {TARGET}): {verdict}")
            if args.baseline_checkout:
                base = [row["baseline"][key] / row["vllm"][key] for row in rounds]
                summary[f"baseline_{key}"] = base
                print(f"  - baseline checkout / vLLM = {statistics.median(base):.2f} (per round "
                      f"{', '.join(f'{x:.2f}' for x in base)})")
    if args.baseline_checkout:
        print()
        for key, name in (("prefill_median_s", "1024-token prefill latency"),
                          ("itl_mean_s", "mean inter-token gap")):
            ratios = [row["tetri"][key] / row["baseline"][key] for row in rounds]
            summary[f"over_baseline_{key}"] = ratios
            print(f"- {name}: ours / baseline = {statistics.median(ratios):.2f} (per round "
                  f"{', '.join(f'{x:.2f}' for x in ratios)})")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps({"rounds": rounds, "ratios": summary,
                                               "isa": isa, "commit": git_commit()}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
