"""Decision logs of a real run and of a simulation, summarised and compared (``sim compare``).

A record is what a worker's ``DecisionLog`` writes (``workers/trace.py``), one JSON object per
line of ``<prefix>.w<worker_id>.jsonl``; the simulated instances hand the same dicts to their
``Instance.decisions`` hook. Here a log is a list of ``(worker_id, record)`` in the order each
worker wrote them.

Two views of a log:

- ``summarize``: counts per decision kind (chunks and their fill, dispatches per decode worker,
  decode steps and their batch, admissions, preemptions), comparable under any timing.
- ``sequences``: the decisions with what timing changes left out (step numbers, free blocks,
  which requests share a decode batch), per worker in order, request ids replaced by their rank
  (the server numbers requests in the order it receives them, the simulator in arrival order:
  the same ranks when requests do not arrive together). On a trace whose requests never meet
  (one every few seconds on one prefill and one decode worker) these must be identical; under
  load the prompts that share a chunk depend on timing, and so does everything after.
"""

from __future__ import annotations

import json
import re
from collections import Counter
from pathlib import Path
from typing import Any

Log = list[tuple[int, dict[str, Any]]]


def read_logs(prefix: Path) -> Log:
    """Every ``<prefix>.w<N>.jsonl``, worker by worker (ascending id)."""
    files = []
    for path in prefix.parent.glob(prefix.name + ".w*.jsonl"):
        m = re.fullmatch(re.escape(prefix.name) + r"\.w(\d+)\.jsonl", path.name)
        if m:
            files.append((int(m.group(1)), path))
    log: Log = []
    for wid, path in sorted(files):
        log += [(wid, json.loads(line)) for line in path.read_text().splitlines() if line]
    return log


STEP_KINDS = ("decode_step", "mixed_step", "coupled_step")


def split_preempt(steps: list[dict[str, Any]]) -> tuple[int, int]:
    """(preemptions, waiting requests' KV drops) among the ``preempt`` ids of one worker's
    step records in order: an id in the previous step's ``run`` was running (every running
    request is a row of every step), any other was waiting for admission."""
    preempted = dropped = 0
    running: set[int] = set()
    for r in steps:
        for rid in r.get("preempt", ()):
            if rid in running:
                preempted += 1
            else:
                dropped += 1
        running = set(r.get("run", ()))
    return preempted, dropped


def summarize(log: Log, chunk_size: int) -> dict[str, Any]:
    """Counts per decision kind; ``chunk_fill_mean`` = prompt tokens / ``chunk_size``."""
    chunks = [r for _, r in log if r["kind"] == "chunk"]
    steps = [r for _, r in log if r["kind"] in STEP_KINDS]
    per_worker = [split_preempt([r for w, r in log if w == wid and r["kind"] in STEP_KINDS])
                  for wid in sorted({w for w, _ in log})]
    dispatches = [r for _, r in log if r["kind"] == "dispatch"]
    tokens = [sum(s[2] for s in r["slices"]) for r in chunks]
    return {
        "num_chunks": len(chunks),
        "chunk_fill_mean": sum(tokens) / (chunk_size * len(chunks)) if chunks else None,
        "num_padded_chunks": sum(r["pad"] > 0 for r in chunks),
        "num_slices": sum(len(r["slices"]) for r in chunks),
        "num_dispatches": len(dispatches),
        "dispatches_per_decode": {str(k): v for k, v in
                                  sorted(Counter(r["to"] for r in dispatches).items())},
        "num_heavy_dispatches": sum(bool(r["heavy"]) for r in dispatches),
        "num_decode_steps": len(steps),
        "decode_batch_mean": (sum(len(r["run"]) for r in steps) / len(steps)) if steps else None,
        "num_admissions": sum(len(r.get("admit", ())) for r in steps),
        "num_preemptions": sum(p for p, _ in per_worker),
        "num_kv_drops": sum(d for _, d in per_worker),
        "num_failed": sum(len(r.get("fail", ())) for r in steps),
        "num_kept": sum(r["kind"] == "keep" for _, r in log),
        "num_handed_back": sum(r["kind"] == "hand_back" for _, r in log),
    }


def sequences(log: Log) -> dict[str, list[Any]]:
    """``"<kind> w<worker>"`` -> that worker's decisions of that kind, in order, timing left
    out (see the module docstring)."""
    ids = sorted({rid for _, r in log for rid in _req_ids(r)})
    rank = {rid: i for i, rid in enumerate(ids)}
    out: dict[str, list[Any]] = {}

    def add(kind: str, wid: int, item: Any) -> None:
        out.setdefault(f"{kind} w{wid}", []).append(item)

    for wid, r in log:
        kind = r["kind"]
        if kind == "chunk":
            add("chunk", wid, [[rank[s[0]], s[1], s[2]] for s in r["slices"]])
        elif kind == "dispatch":
            add("dispatch", wid, [rank[r["req"]], r["to"], r["blocks"], r["heavy"]])
        elif kind in ("keep", "hand_back"):
            add(kind, wid, rank[r["req"]])
        else:
            for key in ("admit", "preempt", "fail"):
                for rid in r.get(key, ()):
                    add(key, wid, rank[rid])
            for rid, n in r.get("recompute_tokens", ()):
                add("recompute_tokens", wid, [rank[rid], n])
    return out


def _req_ids(r: dict[str, Any]) -> list[int]:
    ids = [s[0] for s in (*r.get("slices", ()), *r.get("recompute_tokens", ()))]
    for key in ("run", "admit", "preempt", "fail", "recompute"):
        ids += r.get(key, ())
    if "req" in r:
        ids.append(r["req"])
    return ids


def compare(sim: Log, real: Log) -> dict[str, dict[str, Any]]:
    """Per sequence (``sequences``' keys of either log): identical, or where it first differs."""
    a, b = sequences(sim), sequences(real)
    out = {}
    for key in sorted(a.keys() | b.keys()):
        s, r = a.get(key, []), b.get(key, [])
        first = next((i for i, (x, y) in enumerate(zip(s, r, strict=False)) if x != y),
                     None if len(s) == len(r) else min(len(s), len(r)))
        out[key] = {"identical": first is None, "num_sim": len(s), "num_real": len(r),
                    "first_difference": first,
                    "sim": None if first is None or first >= len(s) else s[first],
                    "real": None if first is None or first >= len(r) else r[first]}
    return out


SUMMARY_ROWS = ("num_chunks", "chunk_fill_mean", "num_padded_chunks", "num_slices",
                "num_dispatches", "dispatches_per_decode", "num_heavy_dispatches",
                "num_decode_steps", "decode_batch_mean", "num_admissions", "num_preemptions",
                "num_kv_drops", "num_failed", "num_kept", "num_handed_back")


def table(sim: dict[str, Any], reals: list[dict[str, Any]],
          same: list[dict[str, dict[str, Any]]]) -> str:
    """Markdown: the summaries side by side, then per real run which sequences are identical."""
    rows = ["| decisions | sim | " + " | ".join(f"real #{i + 1}" for i in range(len(reals)))
            + " |", "|" + "---|" * (2 + len(reals))]
    for key in SUMMARY_ROWS:
        rows.append("| " + " | ".join([key, *(_cell(s[key]) for s in (sim, *reals))]) + " |")
    for i, cmp in enumerate(same):
        diff = [k for k, v in cmp.items() if not v["identical"]]
        rows.append("")
        if not diff:
            rows.append(f"real #{i + 1}: every decision sequence identical "
                        f"({', '.join(cmp)})")
            continue
        rows.append(f"real #{i + 1}: identical: {', '.join(k for k in cmp if k not in diff)}"
                    f" -- differ: " + "; ".join(
                        f"{k} at #{cmp[k]['first_difference']} (sim {cmp[k]['sim']}, "
                        f"real {cmp[k]['real']}; {cmp[k]['num_sim']} vs {cmp[k]['num_real']})"
                        for k in diff))
    return "\n".join(rows)


def _cell(v: Any) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.3f}"
    if isinstance(v, dict):
        return ", ".join(f"w{k}: {n}" for k, n in v.items()) or "-"
    return str(v)
