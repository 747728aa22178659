"""The paper's table (TetriInfer §5, Figs 11-15) on the simulator.

Setting: OPT-13B fp16 on V100-32GB instances, KV hand-off over the emulated TS-RoCE link
(200 Gb/s), ChunkSize 512, PrefillSchedBatch 16 (FCFS), reserve-dynamic decode admission, a
predictor of 74.9% accuracy at granularity 200 emulated from the true length (misses land in a
neighbouring bucket) whose OPT-125M prefill runs in-line. TetriInfer is 1 prefill + 1 decode
instance against a vLLM-like coupled instance (prefill-first, unchunked, greedy admission):
one instance (the paper's sizing: "TetriInfer used two times the hardware") and two (equal
hardware). The paper gives neither request counts nor arrival rates. Each workload sends 128
requests at ``load`` x the rate one vLLM-like instance sustains on that workload (128 / the
makespan of a burst), Poisson; the default ``load = inf`` is that burst: all 128 at t = 0. The
paper's LPLD remark (2x the hardware, about 2x faster, resources about equal) says its
makespans were set by throughput, not by arrivals, which a burst reproduces.

Two settings model the paper's evaluation rather than the server, here only:

- **The mock hand-off** (``SimConfig.mock_handoff``, on by default here; ``handoff="server"``
  turns it off). The paper's KV transfer was emulated with KV caches precomputed offline, the
  decode instance waiting bytes / bandwidth (docs/tetriinfer.md §7): its prefill instance
  never held a prompt's KV for the pull, so it never back-pressured when decode was full. The
  server (and the simulator's default) keeps the blocks until the decode side has pulled them.
- **Resource usage** = the sum over instances of the wall-clock time each is active, from its
  first step to its last (docs/tetriinfer.md §8.1: "aggregate wall-clock time of all active
  instances"), not instances x makespan: under the latter the paper's LPHD cells (2x the
  hardware, JCT -47%, resources -38%) would need a 3.2x shorter makespan from a 1.9x lower
  mean JCT in a throughput-bound run, while an active-time sum allows it (the prefill instance
  is idle after the light prompts). ``held_delta_pct`` keeps instances x makespan.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from tetri_server.bench.workload import WorkloadSpec
from tetri_server.sim.cluster import SimConfig
from tetri_server.sim.cost import CostModel
from tetri_server.sim.profiles import load_hardware, load_model
from tetri_server.sim.report import pct_delta
from tetri_server.sim.run import predict, simulate
from tetri_server.sim.workload import from_workload

WORKLOADS = ("LPLD", "LPHD", "HPLD", "HPHD", "Mixed")
# (avg TTFT, avg JCT, resource usage) deltas of TetriInfer vs vLLM in percent; None: not given
PAPER_DELTAS: dict[str, tuple[float | None, float | None, float | None]] = {
    "LPLD": (-44.0, -40.0, None),  # "about the same": 2x the hardware, about 2x faster
    "LPHD": (-97.0, -47.0, -38.0),
    "HPLD": (-9.0, -23.0, 43.0),
    "HPHD": (None, -19.0, 7.0),  # TTFT "improved", size not recovered
    "Mixed": (-85.0, -50.0, -21.0),
}
PAPER_CONFIG = SimConfig(mode="disaggregated", num_prefill=1, num_decode=1, chunk_size=512,
                         sched_batch=16, prefill_policy="fcfs", decode_policy="reserve-dynamic",
                         max_batch=256, granularity=200, predictor_accuracy=0.749,
                         predictor_model="OPT-125M", max_model_len=2048, mock_handoff=True,
                         pad_chunks=True,  # TetriInfer's fixed-size chunks
                         recompute_tokens=0)  # vLLM (v0) recomputed a preempted context whole
HANDOFFS = ("mock", "server")


def _deltas(tetri: dict[str, Any], base: dict[str, Any]) -> dict[str, float | None]:
    return {"ttft_delta_pct": pct_delta(tetri["ttft_mean_s"], base["ttft_mean_s"]),
            "jct_delta_pct": pct_delta(tetri["jct_mean_s"], base["jct_mean_s"]),
            "resource_delta_pct": pct_delta(tetri["active_s"], base["active_s"]),
            "held_delta_pct": pct_delta(tetri["resource_s"], base["resource_s"])}


def paper_row(name: str, cost: CostModel, *, num_requests: int = 128, load: float = math.inf,
              seed: int = 0, data_folder: str | None = None,
              handoff: str = "mock") -> dict[str, Any]:
    if handoff not in HANDOFFS:
        raise ValueError(f"handoff must be one of {HANDOFFS}, got {handoff!r}")
    cfg = dataclasses.replace(PAPER_CONFIG, seed=seed, mock_handoff=handoff == "mock")
    vllm1 = dataclasses.replace(cfg, mode="coupled", num_instances=1)
    burst = from_workload(WorkloadSpec(name, num_requests, seed, cfg.max_model_len,
                                       rate_rps=math.inf), data_folder)
    predict(burst, cfg)
    capacity_rps = num_requests / simulate(vllm1, cost, burst)["duration_s"]
    rate = load * capacity_rps
    if math.isinf(rate):
        reqs = burst
    else:
        reqs = from_workload(WorkloadSpec(name, num_requests, seed, cfg.max_model_len,
                                          rate_rps=rate), data_folder)
        predict(reqs, cfg)
    tetri = simulate(cfg, cost, reqs)
    base1 = simulate(vllm1, cost, reqs)
    base2 = simulate(dataclasses.replace(vllm1, num_instances=2), cost, reqs)
    ttft, jct, res = PAPER_DELTAS[name]
    keep = ("ttft_mean_s", "jct_mean_s", "tpot_mean_s", "active_s", "resource_s", "busy_s",
            "duration_s", "num_preemptions", "num_kv_drops", "num_failed")
    return {
        **_deltas(tetri, base1),
        "equal_hardware": _deltas(tetri, base2),
        "paper": {"ttft_delta_pct": ttft, "jct_delta_pct": jct, "resource_delta_pct": res},
        # JSON has no Infinity: the burst's load is "inf"
        "rate_rps": None if math.isinf(rate) else rate, "load": "inf" if math.isinf(load) else load,
        "vllm_capacity_rps": capacity_rps, "num_requests": num_requests,
        "sizing": "TetriInfer 1 prefill + 1 decode; vLLM-like 1 instance (equal_hardware: 2)",
        "handoff": handoff,
        "resource": "sum of instances' active time (first step to last)",
        "tetri": {k: tetri[k] for k in keep},
        "vllm_1": {k: base1[k] for k in keep},
        "vllm_2": {k: base2[k] for k in keep},
        "config": tetri["config"],
    }


def paper_table(*, num_requests: int = 128, load: float = math.inf, seed: int = 0,
                data_folder: str | None = None, handoff: str = "mock") -> dict[str, Any]:
    hw = load_hardware("V100-32GB")
    cost = CostModel(hw, load_model("OPT-13B"), hw.link("ts-roce"))
    return {name: paper_row(name, cost, num_requests=num_requests, load=load, seed=seed,
                            data_folder=data_folder, handoff=handoff) for name in WORKLOADS}
