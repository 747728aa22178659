"""Metrics of a simulated run, by the benchmark's definitions (``bench/metrics.py``):
simulated requests become ``RequestRecord``s and go through ``summarize``. Resource usage:
``resource_s`` = instance-seconds held (instances x duration); ``active_s`` = the sum of each
instance's time from its first step to its last (what the paper's table compares, see
``sim/paper.py``)."""

from __future__ import annotations

from typing import Any

from tetri_server.bench.client import RequestRecord, RunResult
from tetri_server.bench.metrics import SLO, summarize
from tetri_server.sim.cluster import SimConfig, SimResult


def records(result: SimResult) -> list[RequestRecord]:
    return [RequestRecord(request_id=r.req_id, kind=r.kind, prompt_len=r.prompt_len,
                          output_len=r.output_len, arrival_s=r.arrival_s, send_s=r.arrival_s,
                          first_token_s=r.first_token_s, end_s=r.end_s,
                          num_output_tokens=r.output_len, num_prompt_tokens=r.prompt_len,
                          error=r.error)
            for r in result.requests]


def mode_metrics(result: SimResult, cfg: SimConfig, slo: SLO | None = None) -> dict[str, Any]:
    """The flat keys scripts read (``ttft_mean_s`` ...) and the benchmark's whole summary."""
    busy = {f"{i['id']}:{i['role']}": float(i["busy_s"]) for i in result.instances}  # type: ignore[arg-type]
    run = RunResult(records(result), result.duration_s, 0.0, busy_before={}, busy_after=busy)
    s = summarize(run, slo or SLO(), num_workers=cfg.num_held_instances)
    return {
        "ttft_mean_s": s.ttft_s.mean, "ttft_p90_s": s.ttft_s.p90,
        "jct_mean_s": s.jct_s.mean, "jct_p90_s": s.jct_s.p90,
        "tpot_mean_s": s.tpot_s.mean, "tpot_p90_s": s.tpot_s.p90,
        "num_requests": s.num_requests, "num_completed": s.num_completed,
        "num_failed": s.num_errors, "duration_s": s.duration_s,
        "num_instances": cfg.num_held_instances, "resource_s": s.held_worker_s,
        "busy_s": s.busy_s_total, "utilization": s.utilization,
        "active_s": sum(float(i["active_s"]) for i in result.instances),  # type: ignore[arg-type, misc]
        "perf_per_dollar": s.perf_per_dollar,
        "num_preemptions": sum(int(i["preemptions"]) for i in result.instances),  # type: ignore[call-overload]
        "num_kv_drops": sum(int(i["kv_drops"]) for i in result.instances),  # type: ignore[call-overload]
        "instances": result.instances, "flips": result.flips,
        "sim_events": result.num_events, "sim_wall_s": result.wall_s,
        "summary": s.to_dict(),
    }


def pct_delta(new: float | None, base: float | None) -> float | None:
    """(new - base) / base in percent; negative = lower than the base."""
    if new is None or base is None or base == 0:
        return None
    return 100.0 * (new - base) / base
