"""The decode worker's steps from its decision log (``monitor.decision_log``): how long its
steps took, and those that carried a recompute after a preemption beside other rows (the
gap those rows waited through).

    .venv/bin/python tools/decode_steps.py RUN/decisions.w1.jsonl [...]

A step's time runs from its record's stamp (``t``) to the next record's, so a step the worker
idled after reads long: read the percentiles, not the maximum of all steps.
"""

from __future__ import annotations

import argparse
import json
import statistics
from dataclasses import dataclass
from pathlib import Path

from tetri_server.sim.decisions import split_preempt


@dataclass(frozen=True)
class Steps:
    num_steps: int
    p50_s: float
    p99_s: float
    num_preemptions: int  # running requests preempted
    num_kv_drops: int  # waiting requests whose KV was dropped
    recompute_s: list[float]  # the steps with a recompute beside other rows
    recompute_tokens: list[int]  # their recompute tokens


def decode_steps(records: list[dict]) -> Steps:
    durations, recompute_s, tokens = [], [], []
    preempted, dropped = split_preempt([r for r in records if r["kind"] == "decode_step"])
    for rec, nxt in zip(records, records[1:], strict=False):
        if rec["kind"] != "decode_step":
            continue
        if not rec["run"]:
            continue
        step_s = nxt["t"] - rec["t"]
        durations.append(step_s)
        rows = rec.get("recompute_tokens", [])
        if rows and len(rec["run"]) > len(rows):
            recompute_s.append(step_s)
            tokens.append(sum(n for _, n in rows))
    if not durations:
        raise ValueError("no decode step with a next record to time it by")
    durations.sort()

    def at(p: float) -> float:
        return durations[min(len(durations) - 1, int(p * len(durations)))]

    return Steps(len(durations), at(0.5), at(0.99), preempted, dropped, recompute_s, tokens)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("logs", nargs="+", type=Path)
    args = p.parse_args(argv)
    for path in args.logs:
        records = [json.loads(line) for line in path.open()]
        s = decode_steps([r for r in records if "t" in r])
        rec = (f"{len(s.recompute_s)}, at most {max(s.recompute_tokens)} tokens, "
               f"{statistics.mean(s.recompute_s) * 1e3:.0f} ms mean, "
               f"{max(s.recompute_s) * 1e3:.0f} ms max" if s.recompute_s else "none")
        print(f"{path}: {s.num_steps} steps, p50 {s.p50_s * 1e3:.0f} ms, p99 "
              f"{s.p99_s * 1e3:.0f} ms; preemptions {s.num_preemptions}; waiting KV dropped "
              f"{s.num_kv_drops}; steps with a "
              f"recompute beside other rows: {rec}")


if __name__ == "__main__":
    main()
