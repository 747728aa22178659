"""What-if sweeps on the simulator (issue 13 item 6): cluster size 2-64 instances, P:D ratio,
predictor accuracy 50-100% under the three decode admission policies (the paper's Fig. 18
question), chunk size, the sort window (PrefillSchedBatch 1-64 under FCFS / SJF / LJF), flip on
and off over a load sweep, and predictor misses one bucket off against misses anywhere. Every
point is one ``tetri_server.sim`` run of the server's own policies on V100-32GB / OPT-13B (the
paper's setting) with the ShareGPT lengths.

    .venv/bin/python tools/sim_whatif.py [--out docs/img] [--json whatif.json] [--quick]
        [--only scale,pd,accuracy,chunk,sort,flip,misses]

Writes ``sim-scale.png``, ``sim-pd-ratio.png``, ``sim-accuracy.png``, ``sim-chunk.png``,
``sim-sort.png``, ``sim-flip.png``, ``sim-misses.png`` into ``--out`` (each sweep's plot, for
the sweeps run; ``--json`` gets the rows of the sweeps run) and prints one markdown table per
sweep.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from tetri_server.bench.workload import WorkloadSpec
from tetri_server.sim.cluster import SimConfig
from tetri_server.sim.cost import CostModel
from tetri_server.sim.profiles import load_hardware, load_model
from tetri_server.sim.run import predict, simulate
from tetri_server.sim.workload import from_workload

HW, MODEL = "V100-32GB", "OPT-13B"
PER_INSTANCE_RPS = 0.15  # Mixed: 1 P + 1 D saturates near 0.25 req/s (decode-bound)
SORT_RPS = 1.2  # HPLD on 1 P + 3 D: ~80% of the one prefill instance's capacity
KEYS = ("ttft_mean_s", "ttft_p90_s", "jct_mean_s", "jct_p90_s", "tpot_mean_s", "resource_s",
        "num_preemptions", "num_completed")


def cost() -> CostModel:
    hw = load_hardware(HW)
    return CostModel(hw, load_model(MODEL), hw.link())


def run(cfg: SimConfig, workload: str, rate: float, num: int, seed: int = 0) -> dict[str, Any]:
    spec = WorkloadSpec(name=workload, num_requests=num, seed=seed,
                        max_model_len=cfg.max_model_len, rate_rps=rate)
    reqs = from_workload(spec)
    predict(reqs, cfg)
    out = simulate(cfg, cost(), reqs)
    flips = sum(not f.get("cancelled") for f in out["flips"])  # cancelled drains not counted
    return {k: out[k] for k in KEYS} | {"sim_wall_s": out["sim_wall_s"], "num_flips": flips}


def sweep_scale(quick: bool) -> list[dict[str, Any]]:
    """n instances, per-instance load fixed: disaggregated 1:3 (P = n/4) vs the coupled modes."""
    rows = []
    for n in (2, 4, 8, 16) if quick else (2, 4, 8, 16, 32, 64):
        rate, num = PER_INSTANCE_RPS * n, max(200, 40 * n)
        p = max(1, n // 4)
        for mode in ("disaggregated", "coupled", "coupled-chunked"):
            cfg = SimConfig(mode=mode, num_prefill=p, num_decode=n - p, num_instances=n,
                            predictor_accuracy=0.749)
            rows.append({"instances": n, "mode": mode, "rate_rps": rate,
                         **run(cfg, "Mixed", rate, num)})
    return rows


def sweep_pd(quick: bool) -> list[dict[str, Any]]:
    """8 instances split P:D, three workloads at a load 8 coupled instances serve."""
    rows = []
    rates = {"LPHD": 0.6, "HPLD": 3.0, "Mixed": 0.8}
    for workload, rate in rates.items():
        for p in range(1, 8):
            cfg = SimConfig(num_prefill=p, num_decode=8 - p, predictor_accuracy=0.749)
            rows.append({"workload": workload, "prefill": p, "decode": 8 - p, "rate_rps": rate,
                         **run(cfg, workload, rate, 200 if quick else 400)})
    return rows


def sweep_accuracy(quick: bool) -> list[dict[str, Any]]:
    """A burst of 200 LPHD requests on 1 prefill + 1 decode instance (the decode pool is the
    bottleneck), each decode policy at each accuracy, under both dispatchers: power-of-two
    (TetriInfer's, which already checks predicted room) and round-robin (which does not, so
    the decode instance's own admission is all that guards its pool)."""
    rows = []
    accs = (0.5, 0.749, 1.0) if quick else (0.5, 0.6, 0.7, 0.749, 0.8, 0.9, 1.0)
    for dispatch in ("power-of-two", "round-robin"):
        for policy in ("greedy", "reserve-static", "reserve-dynamic"):
            for acc in accs if policy != "greedy" else (1.0,):
                cfg = SimConfig(decode_policy=policy, predictor_accuracy=acc,  # type: ignore[arg-type]
                                dispatch=dispatch)
                rows.append({"dispatch": dispatch, "policy": policy, "accuracy": acc,
                             **run(cfg, "LPHD", float("inf"), 200)})
    return rows


def sweep_chunk(quick: bool) -> list[dict[str, Any]]:
    rows = []
    for chunk in (128, 256, 512, 1024, 2048):
        cfg = SimConfig(chunk_size=chunk, predictor_accuracy=0.749)
        rows.append({"chunk_size": chunk, **run(cfg, "Mixed", 0.2, 200 if quick else 400)})
    return rows


def sweep_sort(quick: bool) -> list[dict[str, Any]]:
    """The prefill queue's order within its sort window: HPLD (prompts of 513-2,048 tokens,
    short decodes) on 1 prefill + 3 decode instances, so the prefill instance queues."""
    rows = []
    for policy in ("fcfs", "sjf", "ljf"):
        for batch in (1, 4, 16, 64) if quick else (1, 2, 4, 8, 16, 32, 64):
            cfg = SimConfig(num_prefill=1, num_decode=3, prefill_policy=policy,  # type: ignore[arg-type]
                            sched_batch=batch, predictor_accuracy=0.749)
            rows.append({"policy": policy, "sched_batch": batch, "rate_rps": SORT_RPS,
                         **run(cfg, "HPLD", SORT_RPS, 200 if quick else 400)})
    return rows


def sweep_flip(quick: bool) -> list[dict[str, Any]]:
    """A wrong static split of 4 instances, flip off and on, over the load: LPHD on 3 prefill
    + 1 decode, HPLD on 1 prefill + 3 decode (the flip what-if's windows: 5 s, 10 s apart)."""
    rows = []
    loads = {"LPHD": (3, (0.1, 0.2, 0.4, 0.6, 0.8)), "HPLD": (1, (0.5, 1.0, 1.5, 2.0, 3.0))}
    for workload, (p, rates) in loads.items():
        for rate in rates[::2] if quick else rates:
            for flip in (False, True):
                cfg = SimConfig(num_prefill=p, num_decode=4 - p, flip=flip, flip_window_s=5,
                                flip_idle_s=5, flip_min_interval_s=10,
                                predictor_accuracy=0.749)
                rows.append({"workload": workload, "prefill": p, "decode": 4 - p,
                             "rate_rps": rate, "flip": flip,
                             **run(cfg, workload, rate, 100 if quick else 200)})
    return rows


def sweep_misses(quick: bool) -> list[dict[str, Any]]:
    """``sweep_accuracy``'s burst with a predictor whose misses land anywhere (uniform over
    the other buckets) beside the one whose misses are a neighbouring bucket."""
    rows = []
    accs = (0.5, 0.749, 1.0) if quick else (0.5, 0.6, 0.749, 0.9, 1.0)
    for dispatch in ("power-of-two", "round-robin"):
        for policy in ("greedy", "reserve-static", "reserve-dynamic"):
            for miss in ("neighbour", "uniform"):
                for acc in accs:
                    cfg = SimConfig(decode_policy=policy, predictor_accuracy=acc,  # type: ignore[arg-type]
                                    predictor_miss=miss, dispatch=dispatch)
                    rows.append({"dispatch": dispatch, "policy": policy, "miss": miss,
                                 "accuracy": acc, **run(cfg, "LPHD", float("inf"), 200)})
    return rows


def md(rows: list[dict[str, Any]], cols: Iterable[str]) -> str:
    cols = list(cols)
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for r in rows:
        cells = [f"{r[c]:.3g}" if isinstance(r[c], float) else str(r[c]) for c in cols]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot_all(res: dict[str, list[dict[str, Any]]], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    def two(title: str) -> tuple[Any, Any]:
        fig, axes = plt.subplots(1, 2, figsize=(10, 3.8))
        fig.suptitle(f"{title} ({HW}, {MODEL}, simulated)")
        return fig, axes

    def finish(fig: Any, panels: tuple[tuple[Any, str], ...], xlabel: str, name: str,
               xlog: bool = False, ylog: bool = False, legend: bool = True) -> None:
        """Label each (axes, y label) panel alike and write the figure to ``out / name``."""
        for ax, y in panels:
            if xlog:
                ax.set_xscale("log", base=2)
            if ylog:
                ax.set_yscale("log")
            ax.set_xlabel(xlabel)
            ax.set_ylabel(y)
            if legend:
                ax.legend()
        fig.tight_layout()
        fig.savefig(out / name, dpi=110)

    if "scale" in res:
        fig, (a, b) = two(f"Cluster size, {PER_INSTANCE_RPS} req/s per instance, Mixed")
        for mode in ("disaggregated", "coupled", "coupled-chunked"):
            rows = [r for r in res["scale"] if r["mode"] == mode]
            xs = [r["instances"] for r in rows]
            a.plot(xs, [r["ttft_mean_s"] for r in rows], "o-", label=mode)
            b.plot(xs, [r["jct_mean_s"] for r in rows], "o-", label=mode)
        finish(fig, ((a, "mean TTFT (s)"), (b, "mean JCT (s)")),
               "instances (disaggregated: P = n/4)", "sim-scale.png", xlog=True)

    if "pd" in res:
        fig, (a, b) = two("P:D split of 8 instances")
        for wl in dict.fromkeys(r["workload"] for r in res["pd"]):
            rows = [r for r in res["pd"] if r["workload"] == wl]
            xs = [f"{r['prefill']}:{r['decode']}" for r in rows]
            a.plot(xs, [r["ttft_mean_s"] for r in rows], "o-", label=f"{wl} @{rows[0]['rate_rps']}")
            b.plot(xs, [r["jct_mean_s"] for r in rows], "o-", label=wl)
        finish(fig, ((a, "mean TTFT (s)"), (b, "mean JCT (s)")), "prefill : decode instances",
               "sim-pd-ratio.png", ylog=True)

    if "accuracy" in res:
        fig, (a, b) = two("Predictor accuracy, a burst of 200 LPHD, 1 P + 1 D")
        for dispatch, style in (("power-of-two", "o-"), ("round-robin", "s--")):
            rows = [r for r in res["accuracy"] if r["dispatch"] == dispatch]
            greedy = next(r for r in rows if r["policy"] == "greedy")
            for pol in ("reserve-static", "reserve-dynamic"):
                mine = [r for r in rows if r["policy"] == pol]
                xs = [100 * r["accuracy"] for r in mine]
                a.plot(xs, [r["jct_mean_s"] / greedy["jct_mean_s"] for r in mine], style,
                       label=f"{pol}, {dispatch}")
                b.plot(xs, [r["num_preemptions"] for r in mine], style, label=f"{pol}, {dispatch}")
            b.axhline(greedy["num_preemptions"], color="grey", ls=style[1:],
                      label=f"greedy, {dispatch}")
        a.axhline(1.0, color="grey", ls=":", label="greedy (each dispatcher)")
        a.set_ylabel("mean JCT / greedy's")
        b.set_ylabel("preemptions")
        for ax in (a, b):
            ax.set_xlabel("predictor accuracy (%)")
            ax.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(out / "sim-accuracy.png", dpi=110)

    if "chunk" in res:
        fig, (a, b) = two("Chunk size, Mixed 0.2 req/s, 1 P + 1 D")
        xs = [r["chunk_size"] for r in res["chunk"]]
        a.plot(xs, [r["ttft_mean_s"] for r in res["chunk"]], "o-")
        b.plot(xs, [r["jct_mean_s"] for r in res["chunk"]], "o-")
        finish(fig, ((a, "mean TTFT (s)"), (b, "mean JCT (s)")), "ChunkSize (tokens)",
               "sim-chunk.png", xlog=True, legend=False)

    if "sort" in res:
        fig, (a, b) = two(f"Sort window, HPLD {SORT_RPS} req/s, 1 P + 3 D")
        for policy in ("fcfs", "sjf", "ljf"):
            rows = [r for r in res["sort"] if r["policy"] == policy]
            xs = [r["sched_batch"] for r in rows]
            a.plot(xs, [r["ttft_mean_s"] for r in rows], "o-", label=policy)
            b.plot(xs, [r["ttft_p90_s"] for r in rows], "o-", label=policy)
        finish(fig, ((a, "mean TTFT (s)"), (b, "p90 TTFT (s)")), "PrefillSchedBatch (requests)",
               "sim-sort.png", xlog=True)

    if "flip" in res:
        fig, (a, b) = two("Flip on/off, 4 instances split wrong")
        for wl, ax in (("LPHD", a), ("HPLD", b)):
            for flip, style in ((False, "s--"), (True, "o-")):
                rows = [r for r in res["flip"] if r["workload"] == wl and r["flip"] == flip]
                ax.plot([r["rate_rps"] for r in rows], [r["jct_mean_s"] for r in rows], style,
                        label=f"flip {'on' if flip else 'off'}")
            p, d = rows[0]["prefill"], rows[0]["decode"]
            ax.set_title(f"{wl}, {p} P + {d} D at start", fontsize=9)
            ax.set_yscale("log")
            ax.set_xlabel("arrival rate (req/s)")
            ax.set_ylabel("mean JCT (s)")
            ax.legend()
        fig.tight_layout()
        fig.savefig(out / "sim-flip.png", dpi=110)

    if "misses" in res:
        fig, (a, b) = two("Predictor misses, a burst of 200 LPHD, 1 P + 1 D")
        for ax, dispatch in ((a, "power-of-two"), (b, "round-robin")):
            rows = [r for r in res["misses"] if r["dispatch"] == dispatch]
            oracle = next(r for r in rows if r["policy"] == "greedy" and r["accuracy"] == 1.0)
            for policy in ("greedy", "reserve-static", "reserve-dynamic"):
                for miss, style in (("neighbour", "s--"), ("uniform", "o-")):
                    mine = [r for r in rows if r["policy"] == policy and r["miss"] == miss]
                    ax.plot([100 * r["accuracy"] for r in mine],
                            [r["jct_mean_s"] / oracle["jct_mean_s"] for r in mine], style,
                            label=f"{policy}, {miss}")
            ax.set_title(f"{dispatch} dispatch", fontsize=9)
            ax.set_xlabel("predictor accuracy (%)")
            ax.set_ylabel("mean JCT / greedy's with an oracle")
            ax.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(out / "sim-misses.png", dpi=110)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=Path("docs/img"))
    p.add_argument("--json", type=Path, default=Path("bench_results/sim-whatif.json"))
    p.add_argument("--quick", action="store_true")
    p.add_argument("--only", help="comma-separated: scale,pd,accuracy,chunk,sort,flip,misses")
    args = p.parse_args(argv)
    sweeps = {"scale": sweep_scale, "pd": sweep_pd, "accuracy": sweep_accuracy,
              "chunk": sweep_chunk, "sort": sweep_sort, "flip": sweep_flip,
              "misses": sweep_misses}
    names = args.only.split(",") if args.only else list(sweeps)
    res: dict[str, list[dict[str, Any]]] = {}
    for name in names:
        t0 = time.perf_counter()
        res[name] = sweeps[name](args.quick)
        print(f"{name}: {time.perf_counter() - t0:.1f} s", file=sys.stderr)
    cols = {"scale": ("instances", "mode", "rate_rps"), "pd": ("workload", "prefill", "decode"),
            "accuracy": ("dispatch", "policy", "accuracy"), "chunk": ("chunk_size",),
            "sort": ("policy", "sched_batch"),
            "flip": ("workload", "rate_rps", "flip", "num_flips"),
            "misses": ("dispatch", "policy", "miss", "accuracy")}
    for name, rows in res.items():
        print(f"\n### {name}\n")
        print(md(rows, (*cols[name], "ttft_mean_s", "ttft_p90_s", "jct_mean_s", "jct_p90_s",
                        "num_preemptions", "num_completed")))
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(res, indent=1))
    args.out.mkdir(parents=True, exist_ok=True)
    plot_all(res, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

