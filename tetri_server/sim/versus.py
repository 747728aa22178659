"""``tetri-server sim compare``: one trace through the real server and through the simulator.

    tetri-server sim compare --model models/llama-bench --workload Mixed --rate 0.4 \
        --num-requests 80 --repeat 2 --json simreal.json

The real side is ``tetri-server serve`` in disaggregated mode, 1 prefill + 1 decode worker
(each pinned to its own core), started and stopped as ``tetri-server bench compare`` does
(``bench/compare.py``), and sent the benchmark's workload (``bench/workload.py``: the same
lengths and arrivals for the same seed). The simulated side runs the same requests on the
``--hardware`` profile (default ``this-cpu``, fitted by ``tetri-server sim fit``) with the same
settings: chunk size, sort window, admission, max batch, KV blocks per worker, monitor
interval, the oracle predictor (the real server gets ``predictor.kind=oracle`` and each
request's true length). The real workers write decision logs (``monitor.decision_log``, beside
the server log in ``--out``) and the simulated instances record the same kinds; both are
summarised per kind and compared as sequences (``sim/decisions.py``): with ``--arrival
constant`` at a low rate, where no two requests meet, they must be identical. ``--quiet-below``
waits for the other tenants of a shared machine to
go quiet before each real run. ``--repeat`` runs the real server again on the same requests, to show
the noise; the simulation is deterministic and runs once. Prints TTFT / TPOT / JCT mean and p90
side by side with the relative error of the simulation, and the other tenants' load during each
real run.
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from tetri_server.bench import data
from tetri_server.bench.client import RequestRecord
from tetri_server.bench.metrics import jct_s, ttft_s
from tetri_server.bench.workload import BenchRequest, WorkloadSpec, build_workload
from tetri_server.config import load_config
from tetri_server.sim import decisions
from tetri_server.sim.cli import CONFIG_KEYS
from tetri_server.sim.cluster import SimConfig, SimResult, Simulation
from tetri_server.sim.cost import CostModel
from tetri_server.sim.instances import SimRequest
from tetri_server.sim.profiles import load_hardware, load_model
from tetri_server.sim.report import mode_metrics, records
from tetri_server.sim.run import predict

METRICS = ("ttft_mean_s", "ttft_p90_s", "tpot_mean_s", "tpot_p90_s", "jct_mean_s", "jct_p90_s")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="tetri-server sim compare", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="checkpoint folder the server loads")
    p.add_argument("--sim-model", default="bench", help="the simulator's model shape")
    p.add_argument("--hardware", default="this-cpu", help="the simulator's profile")
    p.add_argument("--workload", default="Mixed")
    p.add_argument("--rate", type=float, default=0.4, help="requests/s")
    p.add_argument("--arrival", choices=("poisson", "constant"), default="poisson",
                   help="arrival process at --rate (constant: one every 1/rate s)")
    p.add_argument("--num-requests", type=int, default=80)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-model-len", type=int, default=1024)
    p.add_argument("--chunk-size", type=int, default=512)
    p.add_argument("--sched-batch", type=int, default=16)
    p.add_argument("--decode-policy", default="reserve-dynamic")
    p.add_argument("--max-batch", type=int, default=32)
    p.add_argument("--kv-blocks", type=int, default=2048, help="per worker")
    p.add_argument("--monitor-interval-ms", type=float, default=100.0)
    p.add_argument("--repeat", type=int, default=1, help="real runs (the noise)")
    p.add_argument("--quiet-below", type=float, help="before each real run, wait until other "
                   "processes use less than this many cores (sampled over 10 s)")
    p.add_argument("--quiet-wait-s", type=float, default=900.0,
                   help="--quiet-below: give up waiting after this long and run anyway")
    p.add_argument("--data-dir")
    p.add_argument("--out", type=Path, default=Path("bench_results/sim-compare"),
                   help="server logs")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--json", type=Path, required=True, metavar="OUT.json")
    return p


def sim_config(args: argparse.Namespace) -> SimConfig:
    """The simulation of what the server runs: every key the simulator models
    (``sim.cli.CONFIG_KEYS``) read from the server's resolved config, defaults included —
    pinning only some let the two sides run different chunking rules (overtake_share,
    finish_alone) once the server's defaults moved."""
    cfg = load_config(None, server_sets(args)).resolve(cpu_count=2)
    mirrored = {name: getattr(getattr(cfg, section), key)
                for (section, key), name in CONFIG_KEYS.items()
                if (section, key) != ("cluster", "workers")}  # the coupled modes' count
    return SimConfig(**mirrored, predictor_accuracy=1.0, max_model_len=args.max_model_len)


def server_sets(args: argparse.Namespace) -> list[str]:
    """The server settings the simulation mirrors (``sim_config``)."""
    return ["cluster.prefill_workers=1", "cluster.decode_workers=1", "kv.block_size=16",
            f"kv.num_blocks={args.kv_blocks}", f"prefill.chunk_size={args.chunk_size}",
            f"prefill.sched_batch={args.sched_batch}", "prefill.policy=fcfs",
            f"decode.policy={args.decode_policy}", f"decode.max_batch={args.max_batch}",
            "predictor.kind=oracle", f"monitor.interval_ms={args.monitor_interval_ms:g}",
            f"dispatch.seed={args.seed}", "cluster.elastic=off"]  # the paper's split, both sides


def to_sim(requests: list[BenchRequest]) -> list[SimRequest]:
    return [SimRequest(r.request_id, r.prompt_len, r.output_len, r.arrival_s, r.kind)
            for r in requests]


def real_metrics(summary: Any) -> dict[str, Any]:
    s = summary
    return {"ttft_mean_s": s.ttft_s.mean, "ttft_p90_s": s.ttft_s.p90,
            "tpot_mean_s": s.tpot_s.mean, "tpot_p90_s": s.tpot_s.p90,
            "jct_mean_s": s.jct_s.mean, "jct_p90_s": s.jct_s.p90,
            "num_completed": s.num_completed, "num_requests": s.num_requests,
            "duration_s": s.duration_s, "busy_s": s.busy_s,
            "others_cores": (s.other_cpu_s / s.duration_s
                             if s.other_cpu_s is not None and s.duration_s else None),
            "server_cpu_s": s.server_cpu_s_total}


def by_class(recs: list[RequestRecord]) -> dict[str, dict[str, float]]:
    """Mean TTFT and JCT per length class (LPLD, ...) of the completed requests."""
    out: dict[str, dict[str, float]] = {}
    for kind in sorted({r.kind for r in recs}):
        done = [r for r in recs if r.kind == kind and r.ok]
        if done:
            out[kind] = {"num": len(done),
                         "ttft_mean_s": sum(map(ttft_s, done)) / len(done),
                         "jct_mean_s": sum(map(jct_s, done)) / len(done)}
    return out


def class_table(sim: dict[str, Any], reals: list[dict[str, Any]]) -> str:
    rows = ["| class | sim TTFT / JCT (s) | " + " | ".join(
        f"real #{i + 1} TTFT / JCT (s)" for i in range(len(reals))) + " |",
        "|" + "---|" * (2 + len(reals))]
    for kind, s in sim["by_class"].items():
        cells = [f"{kind} ({s['num']})", f"{s['ttft_mean_s']:.3f} / {s['jct_mean_s']:.2f}"]
        for real in reals:
            r = real["by_class"].get(kind)
            cells.append("-" if r is None else f"{r['ttft_mean_s']:.3f} / {r['jct_mean_s']:.2f}")
        rows.append("| " + " | ".join(cells) + " |")
    return "\n".join(rows)


def rel_err(sim: float | None, real: float | None) -> float | None:
    if sim is None or real is None or real == 0:
        return None
    return sim / real - 1.0


def table(sim: dict[str, Any], reals: list[dict[str, Any]]) -> str:
    head = "| metric | sim | " + " | ".join(
        f"real #{i + 1} | sim vs #{i + 1}" for i in range(len(reals))) + " |"
    rows = [head, "|" + "---|" * (2 + 2 * len(reals))]
    for key in METRICS:
        cells = [key, f"{sim[key]:.3f}"]
        for real in reals:
            err = rel_err(sim[key], real[key])
            cells += [f"{real[key]:.3f}", "-" if err is None else f"{100 * err:+.0f}%"]
        rows.append("| " + " | ".join(cells) + " |")
    load = ["others' load (cores)", "-"]
    for real in reals:
        o = real["others_cores"]
        load += ["-" if o is None else f"{o:.2f}", ""]
    rows.append("| " + " | ".join(load) + " |")
    return "\n".join(rows)


def decision_prefix(out: Path, label: str) -> Path:
    """Where a real run's workers write their decision logs (``<prefix>.w<id>.jsonl``); logs
    left by an earlier run of the same label are removed (a worker appends)."""
    prefix = (out / f"{label}.decisions").resolve()
    for path in prefix.parent.glob(prefix.name + ".w*.jsonl"):
        path.unlink()
    return prefix


def run_real(args: argparse.Namespace, wspec: WorkloadSpec,
             requests: list[BenchRequest], label: str) -> tuple[dict[str, Any], decisions.Log]:
    from tetri_server.bench.compare import CompareOptions, free_port, run_against, tetri_spec

    prefix = decision_prefix(args.out, label)
    spec = tetri_spec("disaggregated", args.model, free_port(), args.max_model_len,
                      [*server_sets(args), f"monitor.decision_log={prefix}"])
    spec = replace(spec, label=label)
    opts = CompareOptions(args.out, progress=not args.no_progress, send_true_output_len=True)
    (result,) = run_against(spec, [(wspec, requests)], opts)
    metrics = {**real_metrics(result.summary), "by_class": by_class(result.run.records)}
    return metrics, decisions.read_logs(prefix)


def run_sim(cfg: SimConfig, cost: CostModel,
            requests: list[SimRequest]) -> tuple[SimResult, decisions.Log]:
    """The simulation, with every instance's decision records (worker id, record)."""
    sim = Simulation(cfg, cost, requests)
    log: decisions.Log = []

    def hook(wid: int, rec: dict[str, Any]) -> None:
        log.append((wid, rec))

    for inst in sim.instances:
        inst.decisions = functools.partial(hook, inst.worker_id)
    return sim.run(), log


def wait_quiet(below: float, max_wait_s: float) -> float:
    """Wait (bounded) until other processes use less than ``below`` cores; the last sample."""
    from tetri_server.bench.cpu import others_cores

    deadline = time.monotonic() + max_wait_s
    while True:
        load = others_cores(10.0)
        if load < below or time.monotonic() > deadline:
            return load
        print(f"others use {load:.2f} cores: waiting for < {below}", file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.chunk_size < 1:  # 0 (calibrate) would give the two sides different chunks
        parser.error("--chunk-size must be a size (>= 1): the server and the simulator run the "
                     "same chunk")
    from tetri_server.bench.prompts import load_tokenizer, model_vocab
    from tetri_server.modelinfo import resolve_model_path

    args.model = str(resolve_model_path(args.model))
    wspec = WorkloadSpec(name=args.workload, num_requests=args.num_requests, seed=args.seed,
                         max_model_len=args.max_model_len, rate_rps=args.rate,
                         arrival=args.arrival)
    tokenizer = load_tokenizer(args.model) if args.workload == "Arena" else None
    requests = build_workload(wspec, data.data_dir(args.data_dir),
                              vocab=model_vocab(args.model), tokenizer=tokenizer)
    cfg = sim_config(args)
    hw = load_hardware(args.hardware)
    cost = CostModel(hw, load_model(args.sim_model))
    sim_reqs = to_sim(requests)
    predict(sim_reqs, cfg)
    result, sim_log = run_sim(cfg, cost, sim_reqs)
    sim = {**mode_metrics(result, cfg), "by_class": by_class(records(result))}
    sim_decisions = decisions.summarize(sim_log, cfg.chunk_size)
    reals, real_decisions, same = [], [], []
    for i in range(args.repeat):
        before = None if args.quiet_below is None else wait_quiet(args.quiet_below,
                                                                  args.quiet_wait_s)
        started = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())
        real, real_log = run_real(args, wspec, requests, f"real-{i + 1}")
        real["started"], real["others_cores_before"] = started, before
        reals.append(real)
        real_decisions.append(decisions.summarize(real_log, cfg.chunk_size))
        same.append(decisions.compare(sim_log, real_log))
        print(f"real run {i + 1}: {real['num_completed']}/{real['num_requests']} completed, "
              f"others' load {real['others_cores']}", file=sys.stderr)
    out = {"workload": wspec.to_dict(), "server_sets": server_sets(args),
           "sim_config": cfg.to_dict(), "hardware": args.hardware, "sim_model": args.sim_model,
           "sim": {k: v for k, v in sim.items() if k not in ("instances", "summary")},
           "real": reals,
           "rel_error": [{k: rel_err(sim[k], r[k]) for k in METRICS} for r in reals],
           "decisions": {"sim": sim_decisions, "real": real_decisions, "same": same}}
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(out, indent=1, default=str))
    print(table(sim, reals))
    print()
    print(class_table(sim, reals))
    print()
    print(decisions.table(sim_decisions, real_decisions, same))
    if any((r["others_cores"] or 0.0) > 0.3 for r in reals):
        print("\nnote: other processes used > 0.3 cores during a real run; the simulation "
              "(a profile fitted on CPU time) models an unshared machine", file=sys.stderr)
    return 0 if all(r["num_completed"] == r["num_requests"] for r in reals) else 1
