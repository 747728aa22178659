"""Fit a hardware profile's cost-model parameters to measured forward passes (pure; numpy).

``tetri-server sim fit`` measures the engine (``bench/engine_profile.py``: prefill chunks and
decode steps of known shapes) and calls ``fit_hardware`` here. The fitted parameters are the
five the cost model's step time depends on besides the model's shape (``sim/cost.py``):

    effective peak P = peak_flops x compute_eff      (FLOP/s at a large pass)
    effective bandwidth B = mem_bw_Bps x mem_eff     (bytes/s)
    half_tokens h, step_overhead_s o, overlap (share of min(compute, memory) hidden)

chosen to minimise the squared log error of ``CostModel.step_s`` against the measured times
(relative error: the times span 1 ms to 1 s), by Levenberg-Marquardt on log parameters from a
grid of starts. The result is written back as a profile: ``peak_flops`` / ``mem_bw_Bps`` stay
the machine's measured baselines and the efficiencies become P / peak and B / bandwidth (a
fitted rate above its baseline raises the baseline instead: efficiencies stay in (0, 1]).
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from tetri_server.sim.cost import CostModel
from tetri_server.sim.profiles import Hardware, ModelShape

PARAMS = ("peak_eff_flops", "mem_eff_Bps", "half_tokens", "step_overhead_s", "overlap")
_STARTS = {  # log-spaced starting points per parameter
    "peak_eff_flops": (1e9, 3e10, 1e12),
    "mem_eff_Bps": (1e9, 1e10, 1e11),
    "half_tokens": (2.0, 30.0, 400.0),
    "step_overhead_s": (1e-3,),
    "overlap": (0.05, 1.0),
}
_BOUNDS = np.log(np.array([  # the search stays in physical ranges (log space)
    (1e6, 1e16), (1e6, 1e15), (1e-3, 1e5), (1e-8, 1.0), (1e-4, 1.0)]))


@dataclass(frozen=True)
class StepSample:
    """One measured forward pass: ``items`` = (new tokens, prefix tokens) per sequence, as
    ``CostModel.step_s`` takes them; ``num_sampled`` rows through the LM head (None: one per
    item); ``kind`` only labels the report ("prefill", "decode")."""

    kind: str
    items: tuple[tuple[int, int], ...]
    time_s: float
    num_sampled: int | None = None

    def to_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "items": [list(i) for i in self.items],
                "time_s": self.time_s, "num_sampled": self.num_sampled}


@dataclass(frozen=True)
class Fit:
    params: dict[str, float]  # PARAMS -> value
    rel_errors: list[float]  # per sample: predicted / measured - 1
    hardware: Hardware  # the profile with the fitted values

    @property
    def rms_log_error(self) -> float:
        return float(np.sqrt(np.mean([math.log1p(e) ** 2 for e in self.rel_errors])))


def with_params(base: Hardware, params: dict[str, float], peak_flops: float | None = None,
                mem_bw_Bps: float | None = None) -> Hardware:
    """``base`` with the fitted values; ``peak_flops`` / ``mem_bw_Bps``: the machine's measured
    baselines the efficiencies are expressed against (default: the fitted rates, efficiency 1)."""
    peak = max(peak_flops or 0.0, params["peak_eff_flops"])
    bw = max(mem_bw_Bps or 0.0, params["mem_eff_Bps"])
    return dataclasses.replace(
        base, peak_flops=peak, compute_eff=params["peak_eff_flops"] / peak, mem_bw_Bps=bw,
        mem_eff=params["mem_eff_Bps"] / bw, half_tokens=params["half_tokens"],
        step_overhead_s=params["step_overhead_s"], overlap=params.get("overlap", base.overlap))


def predict(samples: Sequence[StepSample], hw: Hardware, model: ModelShape) -> list[float]:
    cost = CostModel(hw, model)
    return [cost.step_s(s.items, 0, s.num_sampled) for s in samples]


def _clip(logp: np.ndarray) -> np.ndarray:
    return np.clip(logp, _BOUNDS[:, 0], _BOUNDS[:, 1])


def _residuals(logp: np.ndarray, samples: Sequence[StepSample], base: Hardware,
               model: ModelShape, log_meas: np.ndarray) -> np.ndarray:
    params = dict(zip(PARAMS, np.exp(_clip(logp)).tolist(), strict=True))
    pred = predict(samples, with_params(base, params), model)
    return np.log(np.maximum(pred, 1e-12)) - log_meas


def _lm(logp: np.ndarray, fn: Any, iters: int = 60) -> tuple[np.ndarray, float]:
    """Levenberg-Marquardt with a forward-difference Jacobian; (parameters, cost)."""
    r = fn(logp)
    cost, lam = float(r @ r), 1e-2
    for _ in range(iters):
        jac = np.empty((len(r), len(logp)))
        for k in range(len(logp)):
            step = np.zeros_like(logp)
            step[k] = 1e-5
            jac[:, k] = (fn(logp + step) - r) / 1e-5
        jtj, jtr = jac.T @ jac, jac.T @ r
        improved = False
        while lam < 1e8:
            delta = np.linalg.solve(jtj + lam * np.diag(np.diag(jtj) + 1e-9), -jtr)
            cand = _clip(logp + delta)
            rc = fn(cand)
            cc = float(rc @ rc)
            if cc < cost:
                logp, r, improved = cand, rc, cost - cc > 1e-12 * max(cost, 1e-30)
                cost, lam = cc, max(lam / 3, 1e-7)
                break
            lam *= 4
        if not improved:
            break
    return logp, cost


def fit_hardware(samples: Sequence[StepSample], model: ModelShape, base: Hardware,
                 peak_flops: float | None = None, mem_bw_Bps: float | None = None) -> Fit:
    """The profile ``base`` with the five parameters fitted to ``samples`` (module doc)."""
    if len(samples) < len(PARAMS):
        raise ValueError(f"need at least {len(PARAMS)} samples, got {len(samples)}")
    if min(s.time_s for s in samples) <= 0:
        raise ValueError("measured times must be > 0")
    log_meas = np.log([s.time_s for s in samples])

    def fn(logp: np.ndarray) -> np.ndarray:
        return _residuals(logp, samples, base, model, log_meas)

    best: tuple[float, np.ndarray] | None = None
    for start in itertools.product(*(_STARTS[p] for p in PARAMS)):
        logp, cost = _lm(np.log(np.array(start, dtype=float)), fn)
        if best is None or cost < best[0]:
            best = (cost, logp)
    assert best is not None
    params = {p: float(v) for p, v in zip(PARAMS, np.exp(_clip(best[1])), strict=True)}
    hw = with_params(base, params, peak_flops, mem_bw_Bps)
    pred = predict(samples, hw, model)
    return Fit(params, [p / s.time_s - 1 for p, s in zip(pred, samples, strict=True)], hw)


def profile_json(fit: Fit, samples: Sequence[StepSample], notes: str,
                 extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """The profile file: the Hardware keys ``load_hardware`` reads, ``notes``, and under
    ``fit`` the samples, the fitted parameters and each sample's error (for the record)."""
    hw = dataclasses.asdict(fit.hardware)
    hw.pop("name")
    return {"notes": notes, **hw, "fit": {
        "params": fit.params, "rms_log_error": fit.rms_log_error, **(extra or {}),
        "samples": [{**s.to_dict(), "rel_error": round(e, 4)}
                    for s, e in zip(samples, fit.rel_errors, strict=True)]}}
