"""The Grafana dashboard against a live server: every panel query must return data.

    python tools/prom_check.py                      # 1 prefill + 1 decode worker, 40 requests
    python tools/prom_check.py --flip               # 2 prefill + 1 decode, one flip mid-load
    python tools/prom_check.py --png docs/img/dashboard.png --json /tmp/prom_check.json

Starts ``tetri-server serve builtin:tiny`` (disaggregated, CPU) and Prometheus (a temporary
config scraping it every second, a temporary TSDB), sends a light load (short completions,
streamed and not, a few bad requests), then runs every target of every panel of
``deploy/grafana.json`` through Prometheus's HTTP API (``/api/v1/query_range`` over the load
window, Grafana's variables substituted) and prints which return data. Exit 1 when any target
returns no series at all; a target whose series hold only NaN (e.g. a mean flip time with no
flip) is reported, not failed. ``--png`` draws the main panels from those results.

Prometheus: ``--prometheus PATH``, ``$PROMETHEUS`` or ``prometheus`` on PATH (Debian:
``apt-get install prometheus``, or ``apt-get download prometheus && dpkg-deb -x
prometheus_*.deb root`` for the static binary alone).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

import aiohttp

ROOT = Path(__file__).resolve().parent.parent
DASHBOARD = ROOT / "deploy" / "grafana.json"
URL_RE = re.compile(r"serving .* at (http://\S+)/v1")
MODEL = "tiny"
JOB = "tetri"
SCRAPE_S = 1
RATE_WINDOW = "10s"  # $__rate_interval: several scrapes
WORDS = ("alpha beta gamma delta river stone cloud paper light music table green quiet "
         "market window garden number story winter engine").split()
JSON = dict[str, Any]
# (panel, refId) that may stay zero or NaN under this load: nothing restarts or is preempted,
# the waiting queue may stay empty, and without --flip no flip happens
QUIET = {("Workers up, restarts, preemptions", "B"), ("Workers up, restarts, preemptions", "C"),
         ("Workers up, restarts, preemptions", "D"), ("Running / waiting requests", "B")}
QUIET_WITHOUT_FLIP = {("Instance flips", "A"), ("Instance flips", "B")}
# (panel, refId) where 0 is a real value: the shipped classifier puts these short random-word
# prompts in buckets >= 1, their outputs (<= 256 tokens) are mostly in bucket 0
ZERO_OK = {("Length predictor accuracy", "A")}
# the panels drawn in the PNG (titles in deploy/grafana.json)
MAIN_PANELS = (
    "Token throughput", "Running / waiting requests", "Requests finished by reason, and errors",
    "Time to first token", "Inter-token latency", "End-to-end request latency",
    "Queue, prefill and decode time", "KV cache usage per worker", "Worker roles",
    "Length predictor accuracy", "KV hand-off", "Disaggregated phases",
)


def targets(dashboard: JSON) -> list[tuple[str, str, str]]:
    """(panel title, refId, expr) of every query in the dashboard."""
    return [(p["title"], t["refId"], t["expr"]) for p in dashboard["panels"]
            for t in p.get("targets", [])]


def substitute(expr: str, *, range_s: int) -> str:
    """Grafana's variables as Grafana would fill them for this run."""
    return (expr.replace("$__rate_interval", RATE_WINDOW).replace("$__range", f"{range_s}s")
            .replace("$model_name", MODEL).replace("$job", JOB))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def find_prometheus(given: str | None) -> str:
    for c in (given, os.environ.get("PROMETHEUS"), shutil.which("prometheus"),
              "/usr/bin/prometheus"):
        if c and Path(c).is_file() and os.access(c, os.X_OK):
            return c
    raise SystemExit("prometheus not found: apt-get install prometheus, or pass --prometheus")


def get_json(url: str, timeout_s: float = 10.0) -> JSON:
    with urllib.request.urlopen(url, timeout=timeout_s) as r:
        return json.loads(r.read())


def wait_http(url: str, bound_s: float, what: str, proc: subprocess.Popen[bytes]) -> None:
    deadline = time.monotonic() + bound_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"{what} exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(url, timeout=2):
                return
        except OSError:
            time.sleep(0.2)
    raise SystemExit(f"{what} not up within {bound_s:.0f} s")


def start_server(args: argparse.Namespace, log_path: Path) -> tuple[subprocess.Popen[bytes], str]:
    cmd = [sys.executable, "-m", "tetri_server", "serve", "builtin:tiny", "--port", "0",
           "--served-model-name", MODEL, "--mode", "disaggregated",
           "--prefill-workers", str(2 if args.flip else 1), "--decode-workers", "1",
           "--set", "monitor.interval_ms=200", "--set", "flip.enabled=false",
           # a small pool, so that the KV usage of this light load is visible
           "--set", "kv.num_blocks=256"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=log_path.open("ab"), cwd=ROOT)
    assert proc.stdout is not None
    deadline = time.monotonic() + 300
    for raw in proc.stdout:
        if m := URL_RE.search(raw.decode(errors="replace")):
            break
        if time.monotonic() > deadline:
            break
    else:
        raise SystemExit(f"server exited ({proc.wait()}) before serving; see {log_path}")
    if m is None:
        raise SystemExit(f"server not serving within 300 s; see {log_path}")
    url = m.group(1)
    wait_http(url + "/health", 300, "server", proc)
    return proc, url


def start_prometheus(binary: str, url: str, work: Path) -> tuple[subprocess.Popen[bytes], str]:
    port = free_port()
    target = urllib.parse.urlparse(url).netloc
    cfg = work / "prometheus.yml"
    cfg.write_text(f"global:\n  scrape_interval: {SCRAPE_S}s\n  evaluation_interval: "
                   f"{SCRAPE_S}s\nscrape_configs:\n  - job_name: {JOB}\n    static_configs:\n"
                   f"      - targets: ['{target}']\n")
    cmd = [binary, f"--config.file={cfg}", f"--storage.tsdb.path={work / 'tsdb'}",
           f"--web.listen-address=127.0.0.1:{port}", "--log.level=warn"]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL,
                            stderr=(work / "prometheus.log").open("ab"))
    prom = f"http://127.0.0.1:{port}"
    wait_http(prom + "/-/ready", 60, "prometheus", proc)
    return proc, prom


async def one_request(session: aiohttp.ClientSession, url: str, rng: random.Random,
                      stream: bool) -> str:
    body = {"model": MODEL, "prompt": " ".join(rng.choices(WORDS, k=rng.randint(4, 60))),
            "max_tokens": rng.randint(16, 256), "temperature": 0.8, "ignore_eos": True,
            "stream": stream}
    async with session.post(url + "/v1/completions", json=body) as r:
        await r.read()
        return str(r.status)


async def load(url: str, num_requests: int, duration_s: float, seed: int,
               flip: bool) -> dict[str, int]:
    """``num_requests`` completions sent at random times over ``duration_s`` (at most 8 in
    flight), and two bad ones; with ``flip``, worker 1 flips prefill -> decode half-way."""
    rng = random.Random(seed)
    sends = sorted(rng.uniform(0, duration_s) for _ in range(num_requests))
    statuses: dict[str, int] = {}
    sem = asyncio.Semaphore(8)
    timeout = aiohttp.ClientTimeout(total=300)
    async with aiohttp.ClientSession(timeout=timeout) as session:

        async def run(i: int, at_s: float) -> None:
            await asyncio.sleep(at_s)
            async with sem:
                s = await one_request(session, url, random.Random(seed * 1000 + i), i % 2 == 0)
                statuses[s] = statuses.get(s, 0) + 1

        tasks = [asyncio.create_task(run(i, t)) for i, t in enumerate(sends)]
        await asyncio.sleep(duration_s / 4)
        for bad in ({"model": MODEL, "prompt": "x", "temperature": -1},
                    {"model": MODEL, "prompt": "x", "max_tokens": -3}):
            async with session.post(url + "/v1/completions", json=bad) as r:
                statuses[str(r.status)] = statuses.get(str(r.status), 0) + 1
        if flip:
            await asyncio.sleep(duration_s / 4)
            async with session.post(url + "/admin/flip",
                                    json={"worker": 1, "role": "decode"}) as r:
                print(f"flip worker 1 prefill -> decode: HTTP {r.status} {await r.text()}")
        await asyncio.gather(*tasks)
    return statuses


def query_range(prom: str, expr: str, start_s: float, end_s: float) -> list[JSON]:
    q = urllib.parse.urlencode({"query": expr, "start": f"{start_s:.3f}", "end": f"{end_s:.3f}",
                                "step": f"{SCRAPE_S}"})
    out = get_json(f"{prom}/api/v1/query_range?{q}")
    if out.get("status") != "success":
        raise SystemExit(f"query failed: {expr}: {out}")
    return list(out["data"]["result"])


def summarize(result: list[JSON]) -> tuple[int, int, bool]:
    """(series, finite points, any finite non-zero point)."""
    points = [float(v) for s in result for _, v in s["values"]]
    finite = [v for v in points if math.isfinite(v)]
    return len(result), len(finite), any(v != 0 for v in finite)


def check(prom: str, dashboard: JSON, start_s: float, end_s: float) -> list[JSON]:
    rows = []
    range_s = max(1, math.ceil(end_s - start_s))
    for title, ref, expr in targets(dashboard):
        q = substitute(expr, range_s=range_s)
        result = query_range(prom, q, start_s, end_s)
        series, finite, nonzero = summarize(result)
        rows.append({"panel": title, "ref": ref, "expr": q, "series": series, "finite": finite,
                     "nonzero": nonzero, "result": result})
    return rows


def verdict(r: JSON) -> str:
    return ("NO DATA" if r["series"] == 0 else "NaN only" if r["finite"] == 0
            else "data" if r["nonzero"] else "zeros")


def report(rows: list[JSON], flip: bool) -> list[str]:
    """Print the table; the failures: a target with no series, or one that should have seen
    this load (not in ``QUIET``) whose values are all zero or NaN."""
    quiet = QUIET | (set() if flip else QUIET_WITHOUT_FLIP)
    failures = []
    print(f"{'panel':42} ref series points nonzero  verdict")
    for r in rows:
        v = verdict(r)
        key = (r["panel"], r["ref"])
        expected = key in quiet or (v == "zeros" and key in ZERO_OK)
        if v == "NO DATA" or (v != "data" and not expected):
            failures.append(f"{r['panel']} {r['ref']}: {v}: {r['expr']}")
        note = " (expected quiet)" if expected and v != "data" else ""
        print(f"{r['panel'][:42]:42} {r['ref']:3} {r['series']:6} {r['finite']:6} "
              f"{str(r['nonzero']):7}  {v}{note}")
    return failures


UNITS = {"s": "seconds", "reqps": "requests/s", "percentunit": "0-1", "Bps": "bytes/s, log",
         "short": ""}
ROLE_COLOURS = {"prefill": "tab:blue", "decode": "tab:orange", "coupled": "tab:green"}


def _label(fmt: str, metric: JSON) -> str:
    return re.sub(r"\{\{(\w+)\}\}", lambda m: str(metric.get(m.group(1), "")), fmt)


def _patch(colour: str, label: str) -> Any:
    from matplotlib.patches import Patch

    return Patch(color=colour, label=label)


def _roles(ax: Any, rows: list[JSON], start_s: float) -> None:
    """The state timeline: one lane per worker, coloured by the role it had."""
    for r in (r for r in rows if r["panel"] == "Worker roles"):
        for s in r["result"]:
            worker, role = int(s["metric"]["worker"]), s["metric"]["role"]
            xs = [float(t) - start_s for t, _ in s["values"]]
            ax.broken_barh([(x, SCRAPE_S) for x in xs], (worker - 0.4, 0.8),
                           color=ROLE_COLOURS.get(role, "grey"))
    ax.set_ylabel("worker")
    ax.set_yticks(sorted({int(s["metric"]["worker"]) for r in rows
                          if r["panel"] == "Worker roles" for s in r["result"]}))
    ax.legend(handles=[_patch(c, role) for role, c in ROLE_COLOURS.items()],
              fontsize=7, loc="upper right")


def draw(rows: list[JSON], dashboard: JSON, path: Path, start_s: float) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    units = {p["title"]: p.get("fieldConfig", {}).get("defaults", {}).get("unit", "")
             for p in dashboard["panels"]}
    legends = {(p["title"], t["refId"]): t.get("legendFormat", "")
               for p in dashboard["panels"] for t in p.get("targets", [])}
    fig, axes = plt.subplots(4, 3, figsize=(16, 15))
    for ax, title in zip(axes.flat, MAIN_PANELS, strict=True):
        unit = units.get(title, "")
        if title == "Worker roles":
            _roles(ax, rows, start_s)
        series = [(r, s) for r in rows if r["panel"] == title and title != "Worker roles"
                  for s in r["result"]]
        nonzero = [any(math.isfinite(float(v)) and float(v) != 0 for _, v in s["values"])
                   for _, s in series]
        for (r, s), busy in zip(series, nonzero, strict=True):
            if not busy and any(nonzero):
                continue  # all zero beside others that are not (an error kind never seen)
            xs = [float(t) - start_s for t, _ in s["values"]]
            ys = [float(v) for _, v in s["values"]]
            ax.plot(xs, ys, label=_label(legends[(title, r["ref"])] or r["ref"], s["metric"]),
                    linewidth=1.2)
        if unit == "Bps":
            ax.set_yscale("log")
        ax.set_title(f"{title}" + (f" ({UNITS.get(unit, unit)})" if UNITS.get(unit) else ""),
                     fontsize=10)
        ax.set_xlabel("s since the load started", fontsize=8)
        ax.tick_params(labelsize=8)
        ax.grid(alpha=0.3)
        if ax.lines:
            ax.legend(fontsize=7, loc="best")
    fig.suptitle("tetri_server dashboard (deploy/grafana.json) drawn from Prometheus "
                 "query_range results: builtin:tiny, CPU, disaggregated", fontsize=12)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=80)
    print(f"wrote {path}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--prometheus", help="the prometheus binary")
    p.add_argument("--requests", type=int, default=80)
    p.add_argument("--duration", type=float, default=40.0, help="seconds the load is spread on")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--flip", action="store_true",
                   help="2 prefill workers, and worker 1 flips to decode mid-load")
    p.add_argument("--png", type=Path, help="draw the main panels into this PNG")
    p.add_argument("--json", type=Path, help="write every query and its result here")
    p.add_argument("--replot", type=Path, metavar="JSON",
                   help="only draw --png from the results a former run wrote with --json")
    args = p.parse_args(argv)
    dashboard = json.loads(DASHBOARD.read_text())
    if args.replot:
        if not args.png:
            raise SystemExit("--replot needs --png")
        saved = json.loads(args.replot.read_text())
        draw(saved["rows"], dashboard, args.png, saved["start_s"])
        return 0
    binary = find_prometheus(args.prometheus)
    with tempfile.TemporaryDirectory(prefix="prom_check.") as tmp:
        work = Path(tmp)
        server, url = start_server(args, work / "server.log")
        prom_proc = None
        try:
            prom_proc, prom = start_prometheus(binary, url, work)
            print(f"server {url}, prometheus {prom}")
            time.sleep(3 * SCRAPE_S)  # a few idle scrapes first: rate() has a baseline
            start_s = time.time()
            statuses = asyncio.run(load(url, args.requests, args.duration, args.seed, args.flip))
            print(f"load: {statuses} in {time.time() - start_s:.1f} s")
            time.sleep(4 * SCRAPE_S)  # the last state scraped
            end_s = time.time()
            rows = check(prom, dashboard, start_s - 3 * SCRAPE_S, end_s)
        finally:
            if prom_proc is not None:
                prom_proc.terminate()
                prom_proc.wait(30)
            server.send_signal(signal.SIGTERM)
            try:
                server.wait(60)
            except subprocess.TimeoutExpired:
                server.kill()
    failures = report(rows, args.flip)
    if args.json:
        args.json.write_text(json.dumps({"start_s": start_s, "end_s": end_s, "rows": rows}))
    if args.png:
        draw(rows, dashboard, args.png, start_s)
    n = len(rows)
    if failures:
        print(f"FAIL: {len(failures)} of {n} dashboard queries:", *failures, sep="\n  ",
              file=sys.stderr)
        return 1
    print(f"OK: all {n} dashboard queries returned series; "
          f"{sum(verdict(r) == 'data' for r in rows)} with non-zero values, the others "
          "expected quiet under this load")
    return 0


if __name__ == "__main__":
    sys.exit(main())
