"""The workload and client options every ``bench`` command shares, and the requests they
build (``cli`` is the commands; ``sweep`` and ``ablation`` take these too)."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from tetri_server.bench import data
from tetri_server.bench.metrics import SLO
from tetri_server.bench.prompts import PromptTokenizer, load_tokenizer, model_max_len, model_vocab
from tetri_server.bench.slo import SLOScale
from tetri_server.bench.sweep import requests_at
from tetri_server.bench.workload import (
    CLASSES,
    RATE_ARRIVALS,
    WORKLOADS,
    BenchRequest,
    WorkloadSpec,
    build_workload,
)

DEFAULT_MAX_MODEL_LEN = 4096
DEFAULT_RATE_RPS = 1.0  # Poisson without --rate; a trace without --rate keeps its own timing
DEFAULT_SWEEP_REQUESTS = 50  # per rate, without --num-requests or --duration-s
Built = list[tuple[WorkloadSpec, list[BenchRequest]]]


def add_workload_args(p: argparse.ArgumentParser, sweep: bool = False) -> None:
    """The options every sub-command shares; ``sweep`` swaps the one rate for ``--rates`` and
    the fixed SLOs for multiples of the calibrated unloaded latencies."""
    g = p.add_argument_group("workload")
    g.add_argument(
        "--workload",
        action="append",
        help=f"{', '.join(WORKLOADS)}"
        + (
            " (one); default Mixed"
            if sweep
            else " or 'all' (the five paper workloads); repeat or comma-separate; default Mixed"
        ),
    )
    g.add_argument("--seed", type=int, default=0)
    if sweep:
        g.add_argument("--rates", required=True, help="comma-separated requests/s, e.g. 0.2,0.4")
        n = g.add_mutually_exclusive_group()
        n.add_argument(
            "--num-requests", type=int, help=f"per rate (default {DEFAULT_SWEEP_REQUESTS})"
        )
        n.add_argument("--duration-s", type=float, help="per rate: rate x this many requests")
    else:
        g.add_argument("--num-requests", type=int, default=100)
        g.add_argument(
            "--rate",
            action="append",
            default=[],
            help="requests/s ('inf' = burst; "
            "default 1); NAME=RATE sets one workload's rate; for a trace: the target "
            "mean rate (default: the trace's own timing)",
        )
    g.add_argument(
        "--arrival",
        default="poisson",
        help=f"poisson, constant (evenly spaced) or {', '.join(data.TRACE_FILES)}",
    )
    g.add_argument("--time-scale", type=float, help="trace: multiply the trace's gaps by this")
    g.add_argument("--trace-start", type=int, default=0, help="trace: first row used")
    g.add_argument("--prompt-mode", choices=("ids", "text"), default="ids")
    g.add_argument(
        "--model", help="model folder or builtin:NAME (vocab size, tokenizer, context length)"
    )
    g.add_argument("--vocab-size", type=int, help="for id prompts without --model")
    g.add_argument("--max-model-len", type=int, help="default: the model's, else 4096")
    g.add_argument("--arena-model", help="Arena: only this model's responses")
    g.add_argument("--arena-all-prompts", action="store_true",
                   help="Arena: every prompt, also those the shipped length predictor was "
                        "trained on (default: only its held-out ones)")
    g.add_argument("--input-len", type=int, help="Fixed: prompt tokens of every request")
    g.add_argument("--output-len", type=int, help="Fixed: output tokens of every request")
    g.add_argument("--data-dir", help="default $TETRI_DATA_DIR or ../shared/data")
    c = p.add_argument_group("client and metrics")
    c.add_argument("--max-concurrency", type=int)
    c.add_argument("--request-timeout-s", type=float, default=600.0)
    if sweep:
        c.add_argument(
            "--slo-ttft-x",
            type=float,
            default=SLOScale.ttft_x,
            help="TTFT SLO = this x the unloaded prefill of the prompt",
        )
        c.add_argument(
            "--slo-tpot-x",
            type=float,
            default=SLOScale.tpot_x,
            help="TPOT SLO = this x the unloaded decode step",
        )
        c.add_argument(
            "--slo-target",
            type=float,
            default=SLOScale.target,
            help="fraction of requests that must meet both",
        )
    else:
        c.add_argument("--slo-ttft-s", type=float, default=SLO.ttft_s)
        c.add_argument("--slo-tpot-s", type=float, default=SLO.tpot_s)
    c.add_argument(
        "--num-warmups",
        type=int,
        default=2,
        help="unmeasured requests, one at a time, before the first workload on each server "
        "(its longest and shortest prompts, in another order so no prompt is sent twice; "
        "default 2; sweep: on each server it starts, each point of --interleave, and before "
        "the first rate of --url)",
    )
    c.add_argument("--out", type=Path, help="default bench_results/<time>")
    c.add_argument("--no-progress", action="store_true")
    c.add_argument("--no-plots", action="store_true")
    c.add_argument(
        "--hide-output-len",
        action="store_true",
        help="ask each request for max_tokens = the context left after its prompt (no length "
        "in mind, as most clients) and stop reading at its true length, which disconnects: "
        "no policy sees the length (default: max_tokens = the true length, as vllm bench "
        "serve)",
    )
    c.add_argument(
        "--send-true-output-len",
        action="store_true",
        help="send each request's output length as true_output_len (tetri_server's field for "
        "predictor.kind=oracle; compare never sends it to vLLM)",
    )


def parse_rate_items(items: Sequence[str]) -> tuple[float | None, dict[str, float]]:
    default: float | None = None
    per: dict[str, float] = {}
    for item in items:
        for part in item.split(","):
            name, _, val = part.rpartition("=")
            if name:
                per[name] = float(val)
            else:
                default = float(val)
    return default, per


def workload_vocab(args: argparse.Namespace) -> tuple[int, frozenset[int]] | None:
    if args.model:
        return model_vocab(args.model)
    return (args.vocab_size, frozenset()) if args.vocab_size else None


def fixed_lens(args: argparse.Namespace) -> tuple[int, int]:
    if args.input_len is None or args.output_len is None:
        raise SystemExit("the Fixed workload needs --input-len and --output-len")
    return args.input_len, args.output_len


def build_requests(args: argparse.Namespace) -> Built:
    names: list[str] = []
    for item in args.workload or ["Mixed"]:
        names += [*CLASSES, "Mixed"] if item == "all" else item.split(",")
    max_len = max_model_len_of(args, note=True)
    rate, per = parse_rate_items(args.rate)
    folder = data.data_dir(args.data_dir)
    vocab = workload_vocab(args)
    tok: PromptTokenizer | None = None
    if args.model and (args.prompt_mode == "text" or "Arena" in names):
        tok = load_tokenizer(args.model)
    if rate is None and args.arrival in RATE_ARRIVALS:
        rate = DEFAULT_RATE_RPS
    built: Built = []
    for name in names:
        spec = WorkloadSpec(
            name=name,
            num_requests=args.num_requests,
            seed=args.seed,
            max_model_len=max_len,
            prompt_mode=args.prompt_mode,
            arrival=args.arrival,
            rate_rps=per.get(name, rate),
            time_scale=args.time_scale,
            trace_start=args.trace_start,
            arena_model=args.arena_model,
            arena_held_out=not getattr(args, "arena_all_prompts", False),
            fixed_lens=fixed_lens(args) if name == "Fixed" else None,
            prompt_salt=getattr(args, "prompt_salt", 0),
        )
        built.append((spec, build_workload(spec, folder, vocab=vocab, tokenizer=tok)))
    return built


def sweep_workloads(args: argparse.Namespace, rates: Sequence[float]) -> Built:
    """The same workload at each rate; with a fixed count, every rate gets the same lengths
    (they do not depend on the arrival process) and prompts of its own."""
    names = [n for item in args.workload or ["Mixed"] for n in item.split(",")]
    if len(names) != 1 or names[0] == "all":
        raise SystemExit("sweep runs one workload (--workload NAME)")
    if args.time_scale is not None:
        raise SystemExit("sweep sets the rate: --time-scale does not apply")
    num, dur = args.num_requests, args.duration_s
    if num is None and dur is None:
        num = DEFAULT_SWEEP_REQUESTS
    built: Built = []
    for k, rate in enumerate(rates):
        ns = argparse.Namespace(**vars(args))
        ns.rate, ns.num_requests = [repr(rate)], requests_at(rate, num, dur)
        # the same lengths at every rate, other prompts: a server with prefix caching kept up
        # across the rates (--url) would serve a rate's prompts from the last one's cache
        ns.prompt_salt = k  # (Arena's prompts are its dataset's: the same at every rate)
        built += build_requests(ns)
    return built


def max_model_len_of(args: argparse.Namespace, *, note: bool = False) -> int:
    """``--max-model-len``, else the model's, else the default (``note``: say so on stderr)."""
    got = args.max_model_len or (model_max_len(args.model) if args.model else None)
    if got:
        return int(got)
    if note:
        print(f"max_model_len not given: using {DEFAULT_MAX_MODEL_LEN}", file=sys.stderr)
    return DEFAULT_MAX_MODEL_LEN
