"""One simulated run per mode on the same requests."""

from __future__ import annotations

import dataclasses
from typing import Any

from tetri_server.bench.metrics import SLO
from tetri_server.bench.progress import Progress
from tetri_server.sim.cluster import SimConfig, Simulation
from tetri_server.sim.cost import CostModel
from tetri_server.sim.instances import SimRequest
from tetri_server.sim.predictor import EmulatedPredictor
from tetri_server.sim.profiles import load_model
from tetri_server.sim.report import mode_metrics
from tetri_server.sim.workload import assign_buckets, fresh


def predict(requests: list[SimRequest], cfg: SimConfig) -> None:
    """Draw every request's bucket (once, so all modes see the same predictions)."""
    assign_buckets(requests, EmulatedPredictor(granularity=cfg.granularity,
                                               num_buckets=cfg.num_buckets,
                                               accuracy=cfg.predictor_accuracy, seed=cfg.seed,
                                               miss=cfg.predictor_miss))


def simulate(cfg: SimConfig, cost: CostModel, requests: list[SimRequest], *,
             progress: bool = False, slo: SLO | None = None) -> dict[str, Any]:
    """Run ``requests`` (buckets assigned) through ``cfg``; the mode's metrics, SLO attainment
    against ``slo`` (default ``SLO()``). ``progress``: the benchmark's progress bar on stderr,
    per finished request."""
    pred_cost = None
    if cfg.predictor_model and cfg.mode == "disaggregated":
        pred_cost = CostModel(cost.hw, load_model(cfg.predictor_model), cost.link)
    bar = Progress(len(requests), enabled=progress, label=f"sim {cfg.mode}")
    result = Simulation(cfg, cost, fresh(requests), pred_cost,
                        on_finished=lambda r: bar.update(r.error is None)).run()
    bar.close()
    out = mode_metrics(result, cfg, slo)
    out["config"] = cfg.to_dict()
    return out


def compare_configs(cfg: SimConfig, modes: list[str],
                    num_instances: int | None) -> list[SimConfig]:
    """``cfg`` first, then each other mode; coupled modes get ``num_instances`` (default: the
    disaggregated cluster's instance count, equal hardware)."""
    out = [cfg]
    for mode in modes:
        if mode == cfg.mode:
            continue
        n = num_instances or (cfg.num_prefill + cfg.num_decode if cfg.mode == "disaggregated"
                              else cfg.num_instances)
        out.append(dataclasses.replace(cfg, mode=mode, num_instances=n))
    return out
