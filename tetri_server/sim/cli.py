"""``tetri-server sim``: the simulator's command line.

    tetri-server sim --hardware V100-32GB --model OPT-13B --workload Mixed --rate 1 \
        --num-requests 128 --compare coupled,coupled-chunked --json out.json
    tetri-server sim --hardware this-cpu --model bench --workload Arena \
        --tokenizer models/llama-bench --rate 0.4 --json out.json
    tetri-server sim --paper --json paper.json
    tetri-server sim fit --model PATH --out PROFILE.json     (sim/fitting.py)
    tetri-server sim compare --model PATH ...                 (sim/versus.py: sim vs real)
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
from pathlib import Path
from typing import Any

from tetri_server.bench.metrics import SLO
from tetri_server.bench.workload import WORKLOADS, WorkloadSpec
from tetri_server.policy import PREFILL_ORDERS, RIDER_CONTEXT, calibration_rows
from tetri_server.predictor.base import PredictorError
from tetri_server.sim.cluster import MODES, SimConfig
from tetri_server.sim.cost import CostModel, knee_chunk_size
from tetri_server.sim.profiles import load_hardware, load_model
from tetri_server.sim.run import compare_configs, predict, simulate
from tetri_server.sim.workload import from_trace, from_workload

# config.toml (section, key) -> SimConfig field
CONFIG_KEYS = {
    ("cluster", "mode"): "mode", ("cluster", "prefill_workers"): "num_prefill",
    ("cluster", "decode_workers"): "num_decode", ("cluster", "workers"): "num_instances",
    ("kv", "block_size"): "block_size", ("kv", "num_blocks"): "num_kv_blocks",
    ("prefill", "chunk_size"): "chunk_size", ("prefill", "policy"): "prefill_policy",
    ("prefill", "sched_batch"): "sched_batch", ("prefill", "token_budget"): "token_budget",
    ("prefill", "starve_tokens"): "starve_tokens", ("prefill", "finish_alone"): "finish_alone",
    ("prefill", "overtake_share"): "overtake_share",
    ("prefill", "local_decode_batch"): "local_decode_batch",
    ("prefill", "local_decode_min_tokens"): "local_decode_min_tokens",
    ("prefill", "local_decode_max_prompt_share"): "local_decode_max_prompt_share",
    ("prefill", "local_decode_hand_back"): "local_decode_hand_back",
    ("prefill", "local_decode_balance"): "local_decode_balance",
    ("prefill", "local_decode_balance_backlog"): "local_decode_balance_backlog",
    ("prefill", "local_decode_loaded_x"): "local_decode_loaded_x",
    ("prefill", "local_decode_min_held"): "local_decode_min_held",
    ("prefill", "local_decode_chunk"): "local_decode_chunk",
    ("prefill", "local_decode_prompt_first"): "local_decode_prompt_first",
    ("prefill", "local_decode_full_chunk_backlog"): "local_decode_full_chunk_backlog",
    ("prefill", "local_decode_full_chunk_share"): "local_decode_full_chunk_share",
    ("prefill", "local_finish_tokens"): "local_finish_tokens",
    ("decode", "local_prefill_tokens"): "local_prefill_tokens",
    ("decode", "local_prefill_slice"): "local_prefill_slice",
    ("decode", "local_prefill_margin"): "local_prefill_margin",
    ("decode", "local_prefill_max_gap_x"): "local_prefill_max_gap_x",
    ("decode", "policy"): "decode_policy", ("decode", "max_batch"): "max_batch",
    ("decode", "estimate"): "decode_estimate",
    ("decode", "recompute_tokens"): "recompute_tokens",
    ("decode", "waiting_kv_first"): "waiting_kv_first",
    ("predictor", "heavy_decode_tokens"): "heavy_decode_tokens",
    ("dispatch", "policy"): "dispatch", ("dispatch", "seed"): "seed",
    ("monitor", "interval_ms"): "monitor_interval_ms",
    ("flip", "enabled"): "flip", ("flip", "window_s"): "flip_window_s",
    ("flip", "idle_s"): "flip_idle_s", ("flip", "low_load"): "flip_low_load",
    ("flip", "min_interval_s"): "flip_min_interval_s",
}
# --flag -> SimConfig field (None = not given)
FLAGS = {
    "mode": "mode", "prefill_instances": "num_prefill", "decode_instances": "num_decode",
    "instances": "num_instances", "block_size": "block_size", "kv_blocks": "num_kv_blocks",
    "chunk_size": "chunk_size", "prefill_policy": "prefill_policy",
    "sched_batch": "sched_batch", "token_budget": "token_budget",
    "starve_tokens": "starve_tokens", "finish_alone": "finish_alone",
    "overtake_share": "overtake_share",
    "local_decode_batch": "local_decode_batch", "local_prefill_tokens": "local_prefill_tokens",
    "local_decode_min_tokens": "local_decode_min_tokens",
    "local_decode_max_prompt_share": "local_decode_max_prompt_share",
    "local_decode_hand_back": "local_decode_hand_back",
    "local_decode_balance": "local_decode_balance",
    "local_decode_balance_backlog": "local_decode_balance_backlog",
    "local_decode_loaded_x": "local_decode_loaded_x",
    "local_decode_min_held": "local_decode_min_held",
    "local_decode_chunk": "local_decode_chunk",
    "local_decode_prompt_first": "local_decode_prompt_first",
    "local_decode_full_chunk_backlog": "local_decode_full_chunk_backlog",
    "local_decode_full_chunk_share": "local_decode_full_chunk_share",
    "local_finish_tokens": "local_finish_tokens",
    "local_prefill_slice": "local_prefill_slice",
    "local_prefill_margin": "local_prefill_margin",
    "local_prefill_max_gap_x": "local_prefill_max_gap_x",
    "decode_policy": "decode_policy", "decode_estimate": "decode_estimate",
    "max_batch": "max_batch", "granularity": "granularity",
    "recompute_tokens": "recompute_tokens", "waiting_kv_first": "waiting_kv_first",
    "predictor_accuracy": "predictor_accuracy", "predictor_model": "predictor_model",
    "predictor_miss": "predictor_miss", "dispatch": "dispatch", "seed": "seed",
    "monitor_interval_ms": "monitor_interval_ms",
    "flip": "flip", "flip_window_s": "flip_window_s", "flip_min_interval_s": "flip_min_interval_s",
}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="tetri-server sim", description=(
        "Discrete-event simulation of a tetri_server cluster: the server's own policy objects "
        "driven by a roofline cost model. Also: 'tetri-server sim fit --help' (fit a hardware "
        "profile to this machine's engine), 'tetri-server sim compare --help' (the same "
        "workload through the real server and the simulator)."))
    p.add_argument("--paper", action="store_true",
                   help="the paper's five workloads on V100/OPT-13B, TetriInfer vs vLLM-like")
    p.add_argument("--paper-load", type=float, default=float("inf"),
                   help="--paper: arrival rate as a multiple of one vLLM-like instance's "
                        "capacity per workload (default inf: a burst)")
    p.add_argument("--paper-handoff", choices=("mock", "server"), default="mock",
                   help="--paper: the paper's mock KV transfer (the prefill instance frees a "
                        "prompt's KV at once, default) or the server's (KV held until pulled)")
    p.add_argument("--config", help="config.toml: cluster, kv, prefill, decode, dispatch, "
                                    "monitor sections (flags win)")
    p.add_argument("--hardware", default="V100-32GB",
                   help="V100-32GB | A100-80GB | H100 | H200 | this-cpu | PROFILE.json")
    p.add_argument("--model", default="OPT-13B",
                   help="OPT-13B | Llama-2-7B | Llama-3-8B | bench | tiny | SHAPE.json")
    p.add_argument("--link", help="KV link of the hardware profile (default: its default_link)")
    p.add_argument("--mode", choices=MODES)
    p.add_argument("--prefill-instances", type=int)
    p.add_argument("--decode-instances", type=int)
    p.add_argument("--instances", type=int, help="instances of a coupled mode")
    p.add_argument("--workload", choices=WORKLOADS)
    p.add_argument("--tokenizer", help="Arena: the model folder whose tokenizer counts tokens")
    p.add_argument("--rate", type=float, help="requests/s (Poisson unless --arrival)")
    p.add_argument("--arrival", default="poisson", help="poisson | constant | a trace name")
    p.add_argument("--num-requests", type=int, default=100)
    p.add_argument("--max-model-len", type=int, help="default: the model's")
    p.add_argument("--fixed-lens", help="Fixed workload: PROMPT,OUTPUT")
    p.add_argument("--data-dir", help="workload data folder (default ../shared/data)")
    p.add_argument("--trace", help="JSONL: arrival_s, prompt_tokens, output_tokens per line")
    p.add_argument("--compare", default="", help="more modes on the same requests, e.g. "
                                                 "coupled,coupled-chunked (equal hardware "
                                                 "unless --instances)")
    p.add_argument("--block-size", type=int)
    p.add_argument("--kv-blocks", type=int, help="per instance; default: what fits")
    p.add_argument("--chunk-size", type=int, help="0 = the cost model's knee")
    p.add_argument("--prefill-policy", choices=PREFILL_ORDERS)
    p.add_argument("--sched-batch", type=int)
    p.add_argument("--starve-tokens", type=int,
                   help="srpt: a prompt passed over by more prompt tokens than this goes first")
    p.add_argument("--finish-alone", action=argparse.BooleanOptionalAction, default=None,
                   help="a chunk that finishes its first prompt carries only prompts it finishes")
    p.add_argument("--token-budget", type=int)
    p.add_argument("--overtake-share", type=float,
                   help="disaggregated: share of a prefill step that goes first to waiting "
                        "prompts that fit in it whole, while a started one is at the head "
                        "(default 0: non-preemptive)")
    p.add_argument("--local-decode-batch", type=int,
                   help="elastic: requests a prefill instance decodes itself (0 = off)")
    p.add_argument("--local-decode-min-tokens", type=int,
                   help="elastic: keep only requests that can decode more than this (default 128)")
    p.add_argument("--local-decode-max-prompt-share", type=float,
                   help="elastic: keep only while prompt steps took at most this share of the "
                        "last 10 s (default 1: whatever the load)")
    p.add_argument("--local-decode-hand-back", action="store_true", default=None,
                   help="elastic: kept requests go to a decode instance when prompts queue")
    p.add_argument("--local-decode-balance", action=argparse.BooleanOptionalAction,
                   default=None,
                   help="elastic: keep a request only where its tokens would come faster than "
                        "on every decode instance")
    p.add_argument("--local-decode-balance-backlog", action=argparse.BooleanOptionalAction,
                   default=None,
                   help="elastic, with --local-decode-balance: that rule decides past a chunk "
                        "of prompt backlog too")
    p.add_argument("--local-decode-loaded-x", type=float,
                   help="elastic: keep a request only while every decode instance's step is at "
                        "least this many times its fastest (0 = at any load)")
    p.add_argument("--local-decode-min-held", type=int,
                   help="elastic: keep a request only while every decode instance holds at "
                        "least this many (0 = at any load)")
    p.add_argument("--local-decode-chunk", type=int,
                   help="elastic: most tokens of a prefill instance's step that carries its "
                        "kept requests' rows (0 = the chunk size)")
    p.add_argument("--local-decode-prompt-first", action=argparse.BooleanOptionalAction,
                   default=None,
                   help="elastic: a prompt backlog within --local-decode-chunk runs in a step "
                        "of its own, the kept rows waiting one step")
    p.add_argument("--local-decode-full-chunk-backlog", type=int,
                   help="elastic: beyond this many queued prompt tokens a step with kept rows "
                        "takes the whole chunk (default 0: never)")
    p.add_argument("--local-decode-full-chunk-share", type=float,
                   help="elastic: while steps with prompt tokens took less than this share of "
                        "the last 10 s, a step with kept rows takes the whole chunk (default 0: "
                        "never)")
    p.add_argument("--local-finish-tokens", type=int,
                   help="elastic: a request of at most this many tokens finishes on the prefill "
                        "instance, in steps of at most that many tokens (default 0: none)")
    p.add_argument("--local-prefill-tokens", type=int,
                   help="elastic: prompt tokens a decode instance prefills per step, for "
                   "the prompts that finish sooner there (0: none)")
    p.add_argument("--local-prefill-slice", choices=("chunk", "fixed"),
                   help="elastic: chunk = a decode instance's step also prefills at most the "
                        "chunk size (default); fixed = --local-prefill-tokens a step")
    p.add_argument("--local-prefill-margin", type=float,
                   help="elastic: a prompt goes to a decode instance when the prefill one has "
                        "this many chunks more queued (default 1; 0: more at all)")
    p.add_argument("--local-prefill-max-gap-x", type=float,
                   help="elastic: a decode instance takes a prompt only while its recent "
                        "step is at most this many times its fastest (default 0: no bound)")
    p.add_argument("--decode-policy", choices=("greedy", "reserve-static", "reserve-dynamic"))
    p.add_argument("--decode-estimate", choices=("bucket", "refined"),
                   help="refined: the expected output given the tokens so far, from the shipped "
                        "predictor artifact of --granularity (default bucket: the paper's)")
    p.add_argument("--max-batch", type=int)
    p.add_argument("--recompute-tokens", type=int,
                   help="most tokens a step recomputes of requests preempted for KV blocks "
                        "(default 256, as the server's; 0: a whole context in one step; "
                        "--paper: 0)")
    p.add_argument("--waiting-kv-first", action=argparse.BooleanOptionalAction, default=None,
                   help="drop the KV of requests waiting for admission before a running request "
                        "is preempted, where it covers the shortfall (default on, as the server)")
    p.add_argument("--granularity", type=int)
    p.add_argument("--predictor-accuracy", type=float, help="1.0 = oracle")
    p.add_argument("--predictor-miss", choices=("neighbour", "uniform"),
                   help="where a miss lands: a neighbouring bucket (default) or any other")
    p.add_argument("--predictor-model", help="e.g. OPT-125M: its prefill runs in-line")
    p.add_argument("--dispatch", choices=("power-of-two", "round-robin"))
    p.add_argument("--seed", type=int)
    p.add_argument("--monitor-interval-ms", type=float)
    p.add_argument("--flip", action="store_true", default=None,
                   help="instance flip on (policy.FlipPolicy every monitor tick)")
    p.add_argument("--flip-window-s", type=float, help="flip window and idle window")
    p.add_argument("--flip-min-interval-s", type=float, help="cooldown between flips")
    p.add_argument("--slo-ttft-s", type=float, default=SLO.ttft_s,
                   help="TTFT objective of the printed SLO attainment (default %(default)s)")
    p.add_argument("--slo-tpot-s", type=float, default=SLO.tpot_s,
                   help="TPOT objective of the printed SLO attainment (default %(default)s)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    p.add_argument("--json", required=True, metavar="OUT.json")
    return p


def _finite(obj: Any) -> Any:
    """``obj`` with every infinite or NaN float as None: JSON has neither (``Infinity`` breaks
    strict parsers such as jq)."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: _finite(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [_finite(v) for v in obj]
    return obj


def _emulated_predictor(section: dict[str, Any], accuracy_given: bool) -> dict[str, Any]:
    """The server's ``[predictor]`` as the simulator emulates it: its artifact's granularity,
    and the accuracy of its kind (oracle: 1.0; classifier: the artifact's held-out accuracy;
    none: not emulated, so ``accuracy_given`` must say --predictor-accuracy was)."""
    from tetri_server.predictor import artifact

    out: dict[str, Any] = {}
    meta = artifact.read_meta(artifact.resolve(section.get("artifact") or None))
    out["granularity"] = int(meta["granularity"])
    if section.get("artifact"):  # a trained one: its bucket count and tails
        out["predictor_artifact"] = str(section["artifact"])
    kind = section.get("kind")
    if kind == "oracle":
        out["predictor_accuracy"] = 1.0
    elif kind == "classifier" and "accuracy" in meta.get("heldout", {}):
        out["predictor_accuracy"] = float(meta["heldout"]["accuracy"])
    elif kind == "none" and not accuracy_given:
        raise ValueError("the config's predictor.kind = none (every request in bucket 0) is "
                         "not emulated: give --predictor-accuracy")
    return out


def sim_config(args: argparse.Namespace, cost: CostModel) -> SimConfig:
    values: dict[str, Any] = {"max_model_len": args.max_model_len or cost.model.max_model_len}
    if args.config:
        from tetri_server.config import load_config

        # resolved as the server resolves it (cluster.elastic's split among the rest)
        cfg = load_config(args.config).resolve(cpu_count=1).to_dict()
        for (section, key), name in CONFIG_KEYS.items():
            if key in cfg.get(section, {}):
                values[name] = cfg[section][key]
        values.update(_emulated_predictor(cfg.get("predictor", {}),
                                          args.predictor_accuracy is not None))
        if "drain_timeout_s" in cfg.get("server", {}):  # FlipController.timeout_s
            values["flip_timeout_s"] = float(cfg["server"]["drain_timeout_s"]) + 60.0
    for attr, name in FLAGS.items():
        if getattr(args, attr) is not None:
            values[name] = getattr(args, attr)
    if args.flip_window_s is not None:
        values["flip_idle_s"] = args.flip_window_s
    if values.get("chunk_size", 512) == 0:
        rows = calibration_rows(values.get("local_decode_batch", 0),
                                values.get("local_decode_chunk", 0),
                                values.get("local_decode_full_chunk_backlog", 0),
                                values.get("local_decode_full_chunk_share", 0.0))
        longest = max(1, values["max_model_len"] - 1)  # calibrate.measure's packing
        values["chunk_size"] = knee_chunk_size(cost, min(longest, 1024), rows,
                                               min(RIDER_CONTEXT, longest))
    if values.get("num_kv_blocks") is None:
        values["num_kv_blocks"] = 0
    return SimConfig(**values)


def load_requests(args: argparse.Namespace, cfg: SimConfig) -> tuple[list[Any], dict[str, Any]]:
    if args.trace:
        if args.workload:
            raise ValueError("give --workload or --trace, not both")
        return from_trace(args.trace, cfg.max_model_len), {"trace": args.trace}
    if not args.workload:
        raise ValueError("give --workload W --rate R --num-requests N, or --trace FILE.jsonl")
    fixed = tuple(int(x) for x in args.fixed_lens.split(",")) if args.fixed_lens else None
    spec = WorkloadSpec(name=args.workload, num_requests=args.num_requests,
                        seed=cfg.seed, max_model_len=cfg.max_model_len, arrival=args.arrival,
                        rate_rps=args.rate, fixed_lens=fixed)  # type: ignore[arg-type]
    source: dict[str, Any] = {"workload": spec.to_dict()}
    if args.tokenizer:
        source["tokenizer"] = args.tokenizer
    return from_workload(spec, args.data_dir, args.tokenizer), source


def main(argv: list[str] | None = None) -> int:
    if argv and argv[0] == "fit":
        from tetri_server.sim.fitting import main as fit_main

        return fit_main(argv[1:])
    if argv and argv[0] == "compare":
        from tetri_server.sim.versus import main as compare_main

        return compare_main(argv[1:])
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.paper:  # the paper's table runs its own requests, seed and policies
        kept = {"paper", "paper_load", "paper_handoff", "data_dir", "json", "no_progress"}
        given = sorted(k for k, v in vars(args).items()
                       if k not in kept and v != parser.get_default(k))
        if given:
            parser.error(f"--paper runs the paper's requests and policies; it does not take "
                         f"{', '.join('--' + k.replace('_', '-') for k in given)}")
    if args.json:  # before the run: a missing folder must not lose its results
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    try:
        if args.paper:
            from tetri_server.sim.paper import paper_table

            out: dict[str, Any] = paper_table(load=args.paper_load, data_folder=args.data_dir,
                                              handoff=args.paper_handoff)
        else:
            hw = load_hardware(args.hardware)
            cost = CostModel(hw, load_model(args.model), hw.link(args.link))
            cfg = sim_config(args, cost)
            requests, source = load_requests(args, cfg)
            slo = SLO(args.slo_ttft_s, args.slo_tpot_s)
            predict(requests, cfg)
            modes = [m.strip() for m in args.compare.split(",") if m.strip()]
            bad = [m for m in modes if m not in MODES]
            if bad:
                raise ValueError(f"--compare: unknown modes {bad}; modes: {MODES}")
            out = {"modes": {}, "config": {
                "hardware": dataclasses.asdict(hw), "model": dataclasses.asdict(cost.model),
                "link": dataclasses.asdict(cost.link), "sim": cfg.to_dict(), **source}}
            for run_cfg in compare_configs(cfg, modes, args.instances):
                out["modes"][run_cfg.mode] = simulate(run_cfg, cost, requests,
                                                      progress=not args.no_progress, slo=slo)
    except (ValueError, FileNotFoundError, PredictorError) as e:
        print(f"tetri-server sim: {e}", file=sys.stderr)
        return 2
    Path(args.json).write_text(json.dumps(_finite(out), indent=1, allow_nan=False))
    _print(out)
    return 0


def _print(out: dict[str, Any]) -> None:
    def f(x: Any) -> str:
        return "-" if x is None else f"{x:.3f}" if isinstance(x, float) else str(x)

    if "modes" in out:
        print("mode               ttft_mean_s ttft_p90_s jct_mean_s jct_p90_s tpot_mean_s "
              "resource_s slo_attainment")
        for mode, m in out["modes"].items():
            print(f"{mode:18} {f(m['ttft_mean_s']):>11} {f(m['ttft_p90_s']):>10} "
                  f"{f(m['jct_mean_s']):>10} {f(m['jct_p90_s']):>9} {f(m['tpot_mean_s']):>11} "
                  f"{f(m['resource_s']):>10} {f(m['summary']['slo_attainment']):>14}")
        return
    print("workload  ttft_delta_pct jct_delta_pct resource_delta_pct (paper sizing)")
    for name, row in out.items():
        print(f"{name:9} {f(row['ttft_delta_pct']):>14} {f(row['jct_delta_pct']):>13} "
              f"{f(row['resource_delta_pct']):>18}")
