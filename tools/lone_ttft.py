"""Lone-request TTFT by prompt length, per server configuration: is a mode's TTFT under load
queueing, or a slower prefill?

    .venv/bin/python tools/lone_ttft.py [--model models/llama-bench] [--lens 64,256,512,895]
        [--repeat 4] --server coupled --server disaggregated \\
        --server "disaggregated:predictor.kind=none,decode.policy=greedy"

Each ``--server`` is a ``bench compare`` mode (or preset), optionally followed by ``:`` and
comma-separated ``key=value`` settings. The servers run one at a time, each started fresh;
one client sends every prompt (random token ids, ``max_tokens`` 2) one at a time, after a
warm-up of one prompt per length. Prints the median TTFT per length for each server.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
from pathlib import Path

from tetri_server.bench.client import ClientConfig, fetch_model_name, run_benchmark
from tetri_server.bench.compare import free_port, running_server, split_mode, tetri_spec
from tetri_server.bench.metrics import ttft_s
from tetri_server.bench.workload import BenchRequest


def probes(lens: list[int], repeat: int, vocab: int, seed: int) -> list[BenchRequest]:
    rng = random.Random(seed)
    out: list[BenchRequest] = []
    for _ in range(repeat):
        for n in lens:
            prompt = [rng.randrange(4, vocab) for _ in range(n)]  # ids 0-3 are the specials
            out.append(BenchRequest(len(out), prompt, n, 2, 0.0, "probe", "random"))
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="models/llama-bench")
    p.add_argument("--max-model-len", type=int, default=1024)
    p.add_argument("--lens", default="64,256,512,895")
    p.add_argument("--repeat", type=int, default=4)
    p.add_argument("--vocab-size", type=int, default=8000)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--server", action="append", required=True)
    p.add_argument("--log-dir", default="bench_results/lone-ttft")
    args = p.parse_args()
    lens = [int(x) for x in args.lens.split(",")]
    reqs = probes(lens, args.repeat, args.vocab_size, args.seed)
    for text in args.server:
        mode, sets = split_mode(text, sep=",")
        port = free_port()
        spec = tetri_spec(mode, args.model, port, args.max_model_len, sets)
        log = Path(args.log_dir) / f"{mode}-{len(sets)}.log"
        with running_server(spec, log):
            url = f"http://127.0.0.1:{port}"
            cfg = ClientConfig(url, asyncio.run(fetch_model_name(url)), max_concurrency=1,
                               progress=False)
            asyncio.run(run_benchmark(reqs[:len(lens)], cfg, scrape_metrics=False))  # warm-up
            run = asyncio.run(run_benchmark(reqs, cfg, scrape_metrics=False))
        by_len: dict[int, list[float]] = {}
        for r in run.records:
            if not r.ok:
                raise SystemExit(f"{text}: request {r.request_id} failed: {r.error}")
            by_len.setdefault(r.prompt_len, []).append(ttft_s(r) * 1e3)
        cells = "  ".join(f"{n}: {statistics.median(v):.0f}" for n, v in sorted(by_len.items()))
        print(f"{text:60s} {cells} ms (median of {args.repeat})", flush=True)


if __name__ == "__main__":
    main()
