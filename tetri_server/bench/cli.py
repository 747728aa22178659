"""``python -m tetri_server.bench run|compare|sweep`` (also ``tools/bench.py``).

run      send workloads to a running OpenAI-compatible server (``--url``)
compare  start tetri_server in each mode (and vLLM-CPU when installed), run the same workloads
         against each in turn, print one table of ratios against ``coupled``
sweep    SLO goodput: calibrate unloaded latencies, run one workload at each of ``--rates``
         against a server (``--url``) or each mode started in turn (``--modes``), print
         goodput and attainment per rate (bench/slo.py has the definitions)
ablation one table per workload, each row one server changing one thing from the defaults
         (bench/ablation.py), each against coupled in the same run; --dry-run prints them
run and compare write results.json (config, summaries, every request), table.md and PNG plots
to --out; sweep writes --json (default --out/sweep.json), table.md, goodput.png (attainment,
TTFT and TPOT against the rate per mode), cdf_<rate>_req_s.png (TTFT and JCT CDFs per mode)
and the server logs; ablation writes results.json, ablation.json, table.md and
cdf_<workload>_<rate>_req_s.png (a line per row, repeats pooled). --no-plots: no PNG.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import sys
import time
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import aiohttp

from tetri_server.bench import ablation, report
from tetri_server.bench.breakdown import breakdown_table, plot_load_cdfs
from tetri_server.bench.client import (
    ClientConfig,
    add_server_arguments,
    fetch_model_name,
    run_benchmark,
)
from tetri_server.bench.compare import (
    TETRI_MODES,
    VLLM_LABEL,
    CompareOptions,
    ServerSpec,
    find_vllm,
    free_port,
    run_against,
    tetri_spec,
    vllm_spec,
    warm_up,
)
from tetri_server.bench.metrics import SLO, summarize
from tetri_server.bench.options import (
    Built,
    add_workload_args,
    build_requests,
    max_model_len_of,
    sweep_workloads,
    workload_vocab,
)
from tetri_server.bench.slo import Calibration, SLOScale
from tetri_server.bench.sweep import (
    ModeSweep,
    check_calibration_context,
    parse_rates,
    reference_mode,
    sweep_interleaved,
    sweep_spawned,
    sweep_url,
)
from tetri_server.bench.sweep import (
    add_arguments as add_sweep_arguments,
)
from tetri_server.bench.sweep_report import sweep_json, sweep_table


def write_outputs(
    results: list[report.BenchResult],
    out: Path,
    plots: bool,
    baseline: str = report.BASELINE_MODE,
    machine: dict[str, Any] | None = None,
) -> None:
    report.write_json(results, out / "results.json", machine)
    text = report.markdown_table(results)
    if any(r.mode == baseline for r in results) and len({r.mode for r in results}) > 1:
        text += "\n" + report.ratio_table(results, baseline)
    (out / "table.md").write_text(text)
    print(text)
    if plots:
        for name in dict.fromkeys(r.spec.name for r in results):
            report.plot_cdfs([r for r in results if r.spec.name == name], out / f"cdf_{name}.png")
        report.plot_bars(results, out / "bars.png")
    print(f"results in {out}", file=sys.stderr)


def _server_config(arg: str | None) -> dict[str, Any]:
    if not arg:
        return {}
    text = Path(arg[1:]).read_text() if arg.startswith("@") else arg
    loaded = json.loads(text)
    if not isinstance(loaded, dict):
        raise SystemExit("--server-config must be a JSON object")
    return loaded


def _client_config(args: argparse.Namespace, label: str) -> ClientConfig:
    """The client for ``--url``: the served model (asked of the server unless given)."""
    base_url = args.url.rstrip("/")
    try:
        model = args.model_name or asyncio.run(fetch_model_name(base_url))
    except (aiohttp.ClientError, TimeoutError) as exc:
        raise SystemExit(f"cannot list models at {base_url}/v1/models: {exc}") from exc
    return ClientConfig(base_url, model, args.max_concurrency, args.request_timeout_s,
                        api_key=args.api_key, progress=not args.no_progress, label=label,
                        send_true_output_len=args.send_true_output_len,
                        hidden_len_context=_hidden_len_context(args))


def _hidden_len_context(args: argparse.Namespace) -> int | None:
    """``--hide-output-len``: the context length max_tokens is taken from (the workloads')."""
    return max_model_len_of(args) if args.hide_output_len else None


def cmd_run(args: argparse.Namespace) -> int:
    machine = report.machine_info()  # before the runs: the load average of an idle machine
    built = build_requests(args)
    base_url = args.url.rstrip("/")
    base = _client_config(args, args.label)
    model = base.model
    slo = SLO(args.slo_ttft_s, args.slo_tpot_s)
    results = []
    warm_up(base, built[0][1], args.num_warmups)
    for spec, requests in built:
        cfg = dataclasses.replace(base, label=f"{args.label}/{spec.name}")
        run = asyncio.run(run_benchmark(requests, cfg))
        summary = summarize(run, slo, args.num_workers)
        config = {"url": base_url, "served_model": model, **_server_config(args.server_config)}
        results.append(report.BenchResult(args.label, spec, summary, run, config))
    write_outputs(results, args.out, not args.no_plots, machine=machine)
    return 0 if all(r.summary.num_errors == 0 for r in results) else 1


def cmd_compare(args: argparse.Namespace) -> int:
    machine = report.machine_info()  # before the runs: the load average of an idle machine
    built = build_requests(args)
    opts = CompareOptions(
        args.out,
        SLO(args.slo_ttft_s, args.slo_tpot_s),
        args.max_concurrency,
        args.request_timeout_s,
        not args.no_progress,
        args.send_true_output_len,
        args.num_warmups,
        _hidden_len_context(args),
    )
    max_len = built[0][0].max_model_len
    try:
        specs = [
            tetri_spec(mode, args.model, free_port(), max_len, args.set)
            for mode in args.modes.split(",")
            if mode  # --modes "" runs vLLM alone
        ]
    except ValueError as exc:
        raise SystemExit(str(exc)) from exc
    vllm_cmd = None if args.no_vllm else find_vllm(args.vllm_bin)
    if vllm_cmd is not None:
        specs.append(vllm_spec(vllm_cmd, args.model, free_port(), max_len, args.vllm_workers))
    else:
        print("vLLM not found (--vllm-bin PATH to add it): skipped", file=sys.stderr)
    results: list[report.BenchResult] = []
    for spec in specs:
        results += run_against(replace(spec, ready_timeout_s=args.ready_timeout_s), built, opts)
    write_outputs(results, args.out, not args.no_plots, args.baseline, machine)
    return 0 if all(r.summary.num_errors == 0 for r in results) else 1


def _load_calibration(path: str) -> Calibration:
    """A calibration from an earlier sweep's JSON (its SLO calibration) or a bare one."""
    loaded = json.loads(Path(path).read_text())
    return Calibration.from_dict(loaded.get("slo_calibration", loaded))


def _sweep_specs(args: argparse.Namespace, max_len: int) -> list[ServerSpec]:
    specs = []
    for mode in args.modes.split(","):
        if mode == VLLM_LABEL:
            cmd = find_vllm(args.vllm_bin)
            if cmd is None:
                raise SystemExit("vllm-cpu in --modes, but vLLM was not found (--vllm-bin)")
            spec = vllm_spec(cmd, args.model, free_port(), max_len, args.vllm_workers)
        else:
            spec = tetri_spec(mode, args.model, free_port(), max_len, args.set)
        specs.append(replace(spec, ready_timeout_s=args.ready_timeout_s))
    return specs


def _sweep_one_url(
    args: argparse.Namespace, built: Built, vocab: tuple[int, frozenset[int]], measure: bool
) -> ModeSweep:
    base_url = args.url.rstrip("/")
    cfg = _client_config(args, args.label)
    model = cfg.model
    config = {"url": base_url, "served_model": model, **_server_config(args.server_config)}
    return sweep_url(cfg, built, vocab, measure, args.seed, args.num_workers, config,
                     args.num_warmups)


def sweep_options(args: argparse.Namespace) -> CompareOptions:
    """The client options of a sweep of servers it starts."""
    return CompareOptions(
        args.out,
        SLO(),  # the fixed-SLO fields of each summary are not used by the sweep
        args.max_concurrency,
        args.request_timeout_s,
        not args.no_progress,
        args.send_true_output_len,
        args.num_warmups,
        hidden_len_context=_hidden_len_context(args),
    )


def cmd_sweep(args: argparse.Namespace) -> int:
    if args.interleave and args.url:
        raise SystemExit("--interleave starts the modes itself: give --modes, not --url")
    if args.max_concurrency is not None:
        raise SystemExit("sweep sends each request at its arrival time (the SLOs count the "
                         "queueing from then): --max-concurrency would hide it in the client")
    try:
        scale = SLOScale(args.slo_ttft_x, args.slo_tpot_x, args.slo_target)
        rates = parse_rates(args.rates)
    except ValueError as exc:
        raise SystemExit(str(exc)) from exc
    vocab = workload_vocab(args)
    if vocab is None or args.prompt_mode != "ids":
        raise SystemExit("sweep sends token-id prompts: give --model (or --vocab-size)")
    loaded = _load_calibration(args.calibration) if args.calibration else None
    try:
        built = sweep_workloads(args, rates)  # a context too small for the workload: here
        specs = [] if args.url else _sweep_specs(args, built[0][0].max_model_len)
        labels = [args.label] if args.url else [s.label for s in specs]
        ref = reference_mode(labels, args.slo_reference)
        if loaded is None:  # before a server starts: the calibration's requests must fit
            check_calibration_context(built[0][0].max_model_len)
    except ValueError as exc:
        raise SystemExit(str(exc)) from exc
    started, machine = time.time(), report.machine_info()
    measure = loaded is None
    if args.url:
        sweeps = [_sweep_one_url(args, built, vocab, measure)]
    else:
        opts = sweep_options(args)
        sweeps = (sweep_interleaved(specs, built, vocab, opts, measure, args.seed)
                  if args.interleave else
                  [sweep_spawned(s, built, vocab, opts, measure, args.seed) for s in specs])
    cal = loaded or next(s.calibration for s in sweeps if s.label == ref)
    assert cal is not None
    text = sweep_table(sweeps, cal, scale)
    extra = {"argv": args.argv, "workload": {**built[0][0].to_dict(), "rate_rps": None}}
    out_json = args.json or args.out / "sweep.json"
    out_json.parent.mkdir(parents=True, exist_ok=True)
    result = sweep_json(sweeps, cal, scale, started, extra, machine)
    out_json.write_text(json.dumps(result, indent=1))
    text += "\n" + breakdown_table(result)
    (out_json.parent / "table.md").write_text(text)
    if not args.no_plots:
        report.plot_sweep(result, out_json.parent / "goodput.png")
        plot_load_cdfs(result, out_json.parent)  # cdf_<rate>_req_s.png, every mode's requests
    print(text)
    print(f"results in {out_json}", file=sys.stderr)
    return 0 if all(r.summary.num_errors == 0 for s in sweeps for r in s.results) else 1


def cmd_ablation(args: argparse.Namespace) -> int:
    return ablation.main(args, build_requests, max_model_len_of)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m tetri_server.bench",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = p.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="benchmark a running server")
    run.add_argument("--url", required=True, help="e.g. http://127.0.0.1:8010")
    add_server_arguments(run)
    add_workload_args(run)
    cmp = sub.add_parser("compare", help="start each server mode in turn and compare")
    cmp.add_argument(
        "--modes",
        default=",".join(TETRI_MODES),
        help="comma-separated modes or presets, each optionally MODE:key=value+key=value "
        "(settings of that server alone, e.g. disaggregated:prefill.chunk_size=256)",
    )
    cmp.add_argument(
        "--set",
        action="append",
        default=[],
        help="key=value for every tetri server (e.g. the worker count, equal across modes)",
    )
    cmp.add_argument("--vllm-bin", help="vllm executable (e.g. /tmp/vllm-peer/bin/vllm)")
    cmp.add_argument("--no-vllm", action="store_true")
    cmp.add_argument("--vllm-workers", type=int, default=1, help="workers vLLM counts as (perf/$)")
    cmp.add_argument("--ready-timeout-s", type=float, default=300.0)
    cmp.add_argument(
        "--baseline",
        default=report.BASELINE_MODE,
        help=f"mode the ratio table divides by (default {report.BASELINE_MODE}; e.g. vllm-cpu)",
    )
    add_workload_args(cmp)
    swp = sub.add_parser("sweep", help="SLO goodput: one workload at several rates")
    add_sweep_arguments(swp)
    add_workload_args(swp, sweep=True)
    abl = sub.add_parser("ablation", help="one row per lever changed from the defaults")
    ablation.add_arguments(abl)
    add_workload_args(abl)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = parser().parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)  # recorded by sweep
    if args.out is None:
        args.out = Path("bench_results") / time.strftime("%Y%m%d-%H%M%S")
    if args.command == "sweep" and args.spawn:
        args.modes = ",".join(TETRI_MODES)
    spawns = args.command in ("compare", "ablation") or (args.command == "sweep" and not args.url)
    if spawns and not args.model:
        raise SystemExit(f"{args.command} needs --model (the folder every server loads)")
    if args.model and args.model.startswith("builtin:"):
        from tetri_server.modelinfo import resolve_model_path  # makes the model on first use

        args.model = str(resolve_model_path(args.model))
    commands = {"run": cmd_run, "compare": cmd_compare, "sweep": cmd_sweep,
                "ablation": cmd_ablation}
    return commands[args.command](args)
