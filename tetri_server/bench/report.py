"""Benchmark output: JSON (with the server config), Markdown tables, PNG plots.

matplotlib is imported only when a plot is drawn (it belongs in the ``bench`` extra).
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from tetri_server.bench.client import RequestRecord, RunResult
from tetri_server.bench.metrics import Summary, jct_s, ttft_s
from tetri_server.bench.workload import WorkloadSpec
from tetri_server.hostinfo import cpuinfo

BASELINE_MODE = "coupled"
# TetriInfer vs vanilla vLLM, avg TTFT / avg JCT change in % (docs/tetriinfer.md §8.2)
PAPER_DELTAS_PCT: dict[str, tuple[float | None, float | None]] = {
    "LPLD": (-44.0, -40.0),
    "LPHD": (-97.0, -47.0),
    "HPLD": (-9.0, -23.0),
    "HPHD": (None, -19.0),
    "Mixed": (-85.0, -50.0),
}


def git_commit(cwd: Path | None = None) -> str:
    """The short commit of the checkout at ``cwd`` (default: the current directory), the one
    a benchmark's servers run, with "-dirty" when tracked files differ from it (a number from
    uncommitted code is not the commit's); "unknown" outside git."""
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                             text=True, cwd=cwd, timeout=10)
        dirty = subprocess.run(["git", "diff", "--quiet", "HEAD", "--"], cwd=cwd,
                               capture_output=True, timeout=10).returncode == 1
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"
    commit = out.stdout.strip()
    return (commit + "-dirty" if dirty else commit) if commit else "unknown"


@dataclass
class BenchResult:
    """One workload run against one server configuration."""

    mode: str  # label of the server configuration, e.g. "coupled", "vllm-cpu"
    spec: WorkloadSpec
    summary: Summary
    run: RunResult
    server_config: dict[str, Any] = field(default_factory=dict)

    def to_dict(self, include_records: bool = True) -> dict[str, Any]:
        out: dict[str, Any] = {
            "mode": self.mode,
            "workload": self.spec.to_dict(),
            "server_config": self.server_config,
            "summary": self.summary.to_dict(),
            "started_unix_s": self.run.started_unix_s,
        }
        if include_records:
            out["records"] = [asdict(r) for r in self.run.records]
        return out


def machine_info() -> dict[str, Any]:
    """nproc, CPU model, ISA, load average now (take it before the runs), and what ran: the
    commit (``git_commit``, "-dirty" for uncommitted changes) and the torch version."""
    import torch

    model = cpuinfo("model name") or platform.processor()
    return {"nproc": os.cpu_count(), "cpu_model": model,
            "isa": torch.backends.cpu.get_cpu_capability(), "load_avg": os.getloadavg(),
            "commit": git_commit(), "torch": torch.__version__}


def write_json(results: Sequence[BenchResult], path: Path,
               machine: dict[str, Any] | None = None) -> None:
    """A list of runs, each with ``machine`` (``machine_info()``, taken before the runs by a
    caller that can; now if None): the machine and checkout the command ran on, as
    sweep.json says it. That is the server's for compare, ablation and spawned sweeps, the
    client's for ``run --url`` and ``sweep --url`` (the server may run elsewhere)."""
    machine = machine if machine is not None else machine_info()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps([r.to_dict() | {"machine": machine} for r in results], indent=1))


def _num(x: float | None, scale: float = 1.0, digits: int = 3) -> str:
    return "n/a" if x is None else f"{x * scale:.{digits}f}"


def markdown_table(results: Sequence[BenchResult]) -> str:
    """One row per (workload, mode): latency, throughput, goodput, resource usage, perf/$."""
    head = (
        "| workload | mode | done | TTFT mean / p50 / p90 / p99 (s) | TPOT mean (ms) "
        "| ITL p99 (ms) | JCT mean / p50 / p90 / p99 (s) | req/s | goodput req/s "
        "| busy (worker·s) "
        "| server CPU (s) | other CPU (s) | held (worker·s) | perf/$ (req per worker·s) |\n"
        + "|---" * 14
        + "|\n"
    )
    rows = []
    for r in results:
        s = r.summary
        rows.append(
            f"| {r.spec.name} | {r.mode} | {s.num_completed}/{s.num_requests} "
            f"| {_num(s.ttft_s.mean)} / {_num(s.ttft_s.p50)} / {_num(s.ttft_s.p90)} "
            f"/ {_num(s.ttft_s.p99)} "
            f"| {_num(s.tpot_s.mean, 1e3, 1)} | {_num(s.itl_s.p99, 1e3, 1)} "
            f"| {_num(s.jct_s.mean)} / {_num(s.jct_s.p50)} / {_num(s.jct_s.p90)} "
            f"/ {_num(s.jct_s.p99)} "
            f"| {_num(s.request_throughput_rps)} | {_num(s.goodput_rps)} "
            f"| {_num(s.busy_s_total, digits=1)} | {_num(s.server_cpu_s_total, digits=1)} "
            f"| {_num(s.other_cpu_s, digits=1)} "
            f"| {_num(s.held_worker_s, digits=1)} "
            f"| {_num(s.perf_per_dollar, digits=4)} |"
        )
    slos = sorted({(r.summary.slo.ttft_s, r.summary.slo.tpot_s) for r in results})
    note = "".join(f"\nGoodput SLO: TTFT <= {a} s, TPOT <= {b * 1e3:.0f} ms." for a, b in slos)
    note += (
        "\nServer CPU: CPU seconds of all the server's processes during the run; other CPU: "
        "what the rest of the machine used meanwhile (other tenants, not the client)."
    )
    return head + "\n".join(rows) + "\n" + note + "\n"


def ratio(value: float | None, base: float | None) -> float | None:
    if value is None or base is None or base == 0:
        return None
    return value / base


def _fmt_ratio(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.2f}× ({(x - 1) * 100:+.0f}%)"


def ratio_table(results: Sequence[BenchResult], baseline: str = BASELINE_MODE) -> str:
    """Each mode against ``baseline`` on the same workload (lower is better for latency and
    resource usage, higher for perf/$), with the paper's TetriInfer-vs-vLLM deltas beside."""
    base = {r.spec.name: r.summary for r in results if r.mode == baseline}
    head = (
        f"| workload | mode | TTFT mean vs {baseline} | JCT mean vs {baseline} "
        f"| busy vs {baseline} | server CPU vs {baseline} | perf/$ vs {baseline} "
        "| paper TTFT / JCT vs vLLM |\n" + "|---" * 8 + "|\n"
    )
    rows = []
    for r in results:
        b = base.get(r.spec.name)
        if r.mode == baseline or b is None:
            continue
        s = r.summary
        paper = (
            PAPER_DELTAS_PCT.get(r.spec.name, (None, None)) if r.mode == "disaggregated" else None
        )
        paper_txt = (
            "" if paper is None else " / ".join("?" if p is None else f"{p:+.0f}%" for p in paper)
        )
        # means over completed requests only: a side that lost its slowest looks faster
        lost = f" † {s.num_errors}/{b.num_errors} failed" if s.num_errors or b.num_errors else ""
        rows.append(
            f"| {r.spec.name} | {r.mode} "
            f"| {_fmt_ratio(ratio(s.ttft_s.mean, b.ttft_s.mean))}{lost} "
            f"| {_fmt_ratio(ratio(s.jct_s.mean, b.jct_s.mean))}{lost} "
            f"| {_fmt_ratio(ratio(s.busy_s_total, b.busy_s_total))} "
            f"| {_fmt_ratio(ratio(s.server_cpu_s_total, b.server_cpu_s_total))} "
            f"| {_fmt_ratio(ratio(s.perf_per_dollar, b.perf_per_dollar))} | {paper_txt} |"
        )
    note = ("\n† requests failed (this mode / the baseline): TTFT and JCT means cover the "
            "completed ones only, so a side that lost its slowest requests looks faster.\n"
            if any("†" in row for row in rows) else "")
    return head + "\n".join(rows) + "\n" + note


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(plt: Any, fig: Any, path: Path) -> None:
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_cdfs(results: Sequence[BenchResult], path: Path) -> None:
    """CDFs of TTFT and JCT, one line per mode (pass the results of one workload; the runs of
    a mode, its repeats, are pooled)."""
    curves: dict[str, list[RequestRecord]] = {}
    for r in results:
        curves.setdefault(r.mode, []).extend(r.run.records)
    names = sorted({r.spec.name for r in results})
    plot_record_cdfs(curves, f"workload {', '.join(names)}", path)


def cdf_points(values: Sequence[float], num_all: int) -> tuple[list[float], list[float]]:
    """The CDF steps of ``values`` as fractions of ``num_all`` requests (failed ones count:
    the curve ends at the share that succeeded)."""
    xs = sorted(values)
    return xs, [(i + 1) / max(1, num_all) for i in range(len(xs))]


def plot_record_cdfs(curves: Mapping[str, Sequence[RequestRecord]], title: str,
                     path: Path) -> None:
    """CDFs of TTFT and JCT, one line per label: the requests that succeeded, as a fraction
    of all (a curve that stays below 1 shows the failed ones)."""
    plt = _pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for ax, (label, fn) in zip(axes, (("TTFT (s)", ttft_s), ("JCT (s)", jct_s)), strict=True):
        for name, records in curves.items():
            xs, ys = cdf_points([fn(rec) for rec in records if rec.ok], len(records))
            ax.step(xs, ys, where="post", label=name)
        ax.set_xlabel(label)
        ax.set_ylabel("fraction of requests")
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle(title)
    _save(plt, fig, path)


def plot_bars(results: Sequence[BenchResult], path: Path) -> None:
    """Bars per workload and mode: mean TTFT, mean JCT, perf/$."""
    plt = _pyplot()
    workloads = list(dict.fromkeys(r.spec.name for r in results))
    modes = list(dict.fromkeys(r.mode for r in results))
    by_key = {(r.spec.name, r.mode): r.summary for r in results}
    panels = (
        ("mean TTFT (s)", lambda s: s.ttft_s.mean),
        ("mean JCT (s)", lambda s: s.jct_s.mean),
        ("perf/$ (req per worker·s)", lambda s: s.perf_per_dollar),
    )
    fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 4))
    width = 0.8 / max(1, len(modes))
    for ax, (label, get) in zip(axes, panels, strict=True):
        for j, mode in enumerate(modes):
            vals = [by_key.get((w, mode)) for w in workloads]
            heights = [(get(s) or 0.0) if s is not None else 0.0 for s in vals]
            ax.bar([i + j * width for i in range(len(workloads))], heights, width, label=mode)
        ax.set_xticks([i + 0.4 - width / 2 for i in range(len(workloads))], workloads)
        ax.set_title(label)
        ax.grid(axis="y", alpha=0.3)
    axes[0].legend()
    _save(plt, fig, path)


def plot_sweep(sweep: dict[str, Any], path: Path) -> None:
    """Goodput curves of a ``bench sweep`` result (its JSON as a dict): SLO attainment, mean TTFT
    and mean TPOT against the offered rate, one line per mode; the target line and each mode's
    goodput marked."""
    plt = _pyplot()
    target = sweep["scale"]["target"]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    for m in sweep["modes"]:
        rates = m["rates"]
        line = axes[0].plot(rates, [100 * a for a in m["attainment"]], marker="o",
                            label=f"{m['mode']} (goodput {m['goodput_rps']:g} req/s)")[0]
        if m["goodput_rps"] > 0:
            axes[0].axvline(m["goodput_rps"], color=line.get_color(), alpha=0.3, ls=":")
        for ax, key, unit in ((axes[1], "ttft_s", 1.0), (axes[2], "tpot_s", 1e3)):
            ys = [(p["summary"][key] or {}).get("mean") for p in m["points"]]
            ax.plot(rates, [None if y is None else y * unit for y in ys], marker="o",
                    color=line.get_color(), label=m["mode"])
    axes[0].axhline(100 * target, color="grey", ls="--", label=f"{100 * target:g}% target")
    for ax, label in zip(axes, ("requests within both SLOs (%)", "mean TTFT (s)",
                                "mean TPOT (ms)"), strict=True):
        ax.set_xlabel("offered rate (req/s)")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    work = sweep.get("workload", {}).get("name", "")
    fig.suptitle(f"SLO goodput sweep, workload {work} ({sweep.get('started_utc', '')})")
    _save(plt, fig, path)
