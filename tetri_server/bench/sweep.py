"""``bench sweep``: SLO goodput found by a rate sweep (definitions in ``slo.py``).

For one running server (``--url``) or for each mode started in turn (``--modes``, as
``compare`` starts them): calibrate the unloaded latencies with a few sequential requests, then
send the same workload open-loop at each rate in ascending order. The server stays up between
rates; a rate's run ends when its last request has. Attainment is computed per rate, the goodput
over the rates. With ``--interleave`` (``--modes`` only) every mode runs at a rate before any
runs at the next, each on a server started for that point, the modes' order reversed at every
other rate: a machine whose speed drifts through the run (session 30 measured coupled's share
within the SLOs at one rate move from 51% to 88% between runs) then weighs on every mode
alike, instead of on whichever mode ran in the slow spell.

One SLO for every mode: the SLO is the *model's* unloaded latency on this machine, so all modes
are judged against the calibration of one reference mode (``coupled`` when it is swept, else
the first; ``--slo-reference``), or one loaded with ``--calibration``. Each mode's own
calibration is stored beside it.
"""

from __future__ import annotations

import argparse
import asyncio
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

from tetri_server.bench.ablation import run_order
from tetri_server.bench.client import (
    ClientConfig,
    add_server_arguments,
    fetch_model_name,
    run_benchmark,
)
from tetri_server.bench.compare import (
    TETRI_MODES,
    VLLM_LABEL,
    CompareOptions,
    ServerSpec,
    client_config,
    run_workloads,
    running_server,
    warm_up,
)
from tetri_server.bench.metrics import SLO, summarize, tpot_s, ttft_s
from tetri_server.bench.prompts import RandomIdPrompts
from tetri_server.bench.report import BenchResult
from tetri_server.bench.slo import (
    Calibration,
    SLOScale,
    attainment,
    calibration_from_samples,
    goodput_rps,
)
from tetri_server.bench.workload import BenchRequest, WorkloadSpec, length_class

PROBE_OUTPUT_TOKENS = 2  # prefill probes: only their TTFT is used
SHORT_PROBE_TOKENS = 4  # the shortest probe: its lone TTFT floors every prompt's TTFT SLO
STEP_PROMPT_TOKENS = 32
STEP_OUTPUT_TOKENS = 64
NUM_PROBE_REPEATS = 3  # per prompt length; the fit uses every sample
NUM_STEP_STREAMS = 2
MIN_CALIBRATION_CONTEXT = STEP_PROMPT_TOKENS + STEP_OUTPUT_TOKENS  # also holds every probe
_Built = Sequence[tuple[WorkloadSpec, list[BenchRequest]]]  # one (spec, requests) per rate


def parse_rates(text: str) -> list[float]:
    """'0.2,0.4,0.6' -> ascending distinct rates, each > 0 and finite."""
    try:
        rates = sorted({float(x) for x in text.split(",") if x.strip()})
    except ValueError as exc:
        raise ValueError(f"--rates: {exc}") from exc
    if not rates or any(not np.isfinite(r) or r <= 0 for r in rates):
        raise ValueError("--rates needs one or more finite rates > 0, e.g. 0.2,0.4,0.6")
    return rates


def requests_at(rate_rps: float, num_requests: int | None, duration_s: float | None) -> int:
    """Requests sent at one rate: a fixed count, or rate x duration (at least 1)."""
    if (num_requests is None) == (duration_s is None):
        raise ValueError("give exactly one of num_requests and duration_s")
    if num_requests is not None:
        return num_requests
    assert duration_s is not None
    return max(1, round(rate_rps * duration_s))


def probe_lengths(max_model_len: int) -> tuple[int, ...]:
    """A few tokens (the floor of the TTFT SLO), then three lengths spanning what the context
    admits: ~1/8, 1/2 and all of it."""
    top = max_model_len - PROBE_OUTPUT_TOKENS
    return tuple(sorted({SHORT_PROBE_TOKENS, max(16, top // 8), max(16, top // 2), top}))


def check_calibration_context(max_model_len: int) -> None:
    """``ValueError`` when the calibration's requests do not fit ``max_model_len`` (they
    would fail as the server's 400s, which read as its fault)."""
    if max_model_len < MIN_CALIBRATION_CONTEXT:
        raise ValueError(f"the SLO calibration sends requests of up to "
                         f"{MIN_CALIBRATION_CONTEXT} tokens (a lone decode stream of "
                         f"{STEP_OUTPUT_TOKENS} tokens after {STEP_PROMPT_TOKENS}); a context "
                         f"of {max_model_len} cannot hold them: raise --max-model-len")


def calibration_requests(
    max_model_len: int, vocab: tuple[int, frozenset[int]], seed: int
) -> tuple[list[BenchRequest], list[BenchRequest], list[BenchRequest]]:
    """(warm-up, prefill probes, lone decode streams); all arrive at 0 and are sent one at a
    time (concurrency 1), so each is alone on the server. Raises ``ValueError`` for a context
    too small for them (``check_calibration_context``)."""
    check_calibration_context(max_model_len)
    rng = np.random.default_rng([seed, 7])
    maker = RandomIdPrompts(*vocab)
    made: list[BenchRequest] = []

    def add(prompt_len: int, output_len: int) -> BenchRequest:
        prompt, got = maker.make(prompt_len, rng)
        req = BenchRequest(
            len(made), prompt, got, output_len, 0.0, length_class(got, output_len), "calibration"
        )
        made.append(req)
        return req

    lens = probe_lengths(max_model_len)
    warm = [add(lens[-1], PROBE_OUTPUT_TOKENS), add(STEP_PROMPT_TOKENS, 8)]
    probes = [add(p, PROBE_OUTPUT_TOKENS) for _ in range(NUM_PROBE_REPEATS) for p in lens]
    steps = [add(STEP_PROMPT_TOKENS, STEP_OUTPUT_TOKENS) for _ in range(NUM_STEP_STREAMS)]
    return warm, probes, steps


def calibrate(
    client: ClientConfig,
    max_model_len: int,
    vocab: tuple[int, frozenset[int]],
    seed: int = 0,
) -> Calibration:
    """Measure the unloaded prefill line and decode step of the server ``client`` points at,
    one request at a time with the run's other settings (its key, timeout, and the true output
    lengths an oracle predictor needs). Raises if any calibration request fails (an SLO from
    partial samples would be wrong)."""
    warm, probes, steps = calibration_requests(max_model_len, vocab, seed)
    label = client.label
    cfg = replace(client, max_concurrency=1, label=f"{label}/calibration")
    run = asyncio.run(run_benchmark([*warm, *probes, *steps], cfg, scrape_metrics=False))
    failed = [r for r in run.records if not r.ok]
    if failed:
        raise RuntimeError(f"calibration: {len(failed)} requests failed: {failed[0].error}")
    recs = {r.request_id: r for r in run.records}
    pre = [(recs[q.request_id].prompt_len, ttft_s(recs[q.request_id])) for q in probes]
    step = [tpot_s(recs[q.request_id]) for q in steps]
    return calibration_from_samples(pre, [t for t in step if t is not None], source=label)


def reference_mode(labels: Sequence[str], explicit: str | None = None) -> str:
    """The mode whose calibration sets everyone's SLO: ``explicit``, else coupled, else first."""
    if explicit is not None:
        if explicit not in labels:
            raise ValueError(f"--slo-reference {explicit!r} is not among {list(labels)}")
        return explicit
    return "coupled" if "coupled" in labels else labels[0]


@dataclass
class ModeSweep:
    """One server configuration's runs, one per rate, ascending."""

    label: str
    calibration: Calibration | None  # its own (None when a calibration was loaded instead)
    results: list[BenchResult] = field(default_factory=list)

    def attainments(self, cal: Calibration, scale: SLOScale) -> list[float]:
        return [attainment(r.run.records, cal, scale) for r in self.results]

    def goodput_rps(self, cal: Calibration, scale: SLOScale) -> float:
        rates = [r.spec.rate_rps or 0.0 for r in self.results]
        return goodput_rps(
            list(zip(rates, self.attainments(cal, scale), strict=True)), scale.target
        )


def sweep_url(
    cfg: ClientConfig,
    built: _Built,
    vocab: tuple[int, frozenset[int]],
    measure: bool = True,
    seed: int = 0,
    num_workers: int | None = None,
    server_config: dict[str, Any] | None = None,
    num_warmups: int = 0,
) -> ModeSweep:
    """Calibrate (if ``measure``), warm up, and sweep the running server ``cfg`` points at;
    rows are labelled ``cfg.label``. Its CPU use is unknown (it was not started here)."""
    label = cfg.label
    cal = None
    if measure:
        max_len = built[0][0].max_model_len
        cal = calibrate(cfg, max_len, vocab, seed)
    if built:
        warm_up(cfg, built[0][1], num_warmups)
    sweep = ModeSweep(label, cal)
    for spec, requests in built:
        at = replace(cfg, label=f"{label}/{spec.name}@{spec.rate_rps:g}")
        run = asyncio.run(run_benchmark(requests, at))
        summary = summarize(run, SLO(), num_workers)
        sweep.results.append(BenchResult(label, spec, summary, run, server_config or {}))
    return sweep


def calibrate_started(spec: ServerSpec, max_model_len: int, vocab: tuple[int, frozenset[int]],
                      seed: int, opts: CompareOptions) -> Calibration:
    """``calibrate`` the server of ``spec``, started here, under its own label, as its
    workloads are sent."""
    model = asyncio.run(fetch_model_name(spec.base_url))
    client = replace(client_config(spec, model, opts), label=spec.label)
    return calibrate(client, max_model_len, vocab, seed)


def interleaved_order(num_rates: int, specs: Sequence[ServerSpec]) -> list[tuple[int, ServerSpec]]:
    """(rate index, mode) in the order ``sweep_interleaved`` runs them: every mode at a rate
    before the next rate, the modes as given at even rates and reversed at odd ones (A B C,
    C B A, ...; ``ablation.run_order``)."""
    return [(k, s) for k in range(num_rates) for s in run_order(specs, k)]


def sweep_interleaved(
    specs: Sequence[ServerSpec],
    built: _Built,
    vocab: tuple[int, frozenset[int]],
    opts: CompareOptions,
    measure: bool = True,
    seed: int = 0,
) -> list[ModeSweep]:
    """Each (rate, mode) of ``interleaved_order`` on a server started for it (its log:
    ``opts.out_dir/<label>@<rate>.log``); a mode is calibrated (if ``measure``) at its first
    start. One ``ModeSweep`` per spec, its results ascending by rate as ``sweep_spawned``'s."""
    sweeps = {s.label: ModeSweep(s.label, None) for s in specs}
    for k, spec in interleaved_order(len(built), specs):
        point = built[k]
        log = opts.out_dir / f"{spec.label}@{point[0].rate_rps:g}.log"
        with running_server(spec, log) as proc:
            sweep = sweeps[spec.label]
            if measure and k == 0:
                sweep.calibration = calibrate_started(spec, point[0].max_model_len, vocab, seed,
                                                      opts)
            sweep.results += run_workloads(spec, proc, [point], opts)
    return [sweeps[s.label] for s in specs]


def sweep_spawned(
    spec: ServerSpec,
    built: _Built,
    vocab: tuple[int, frozenset[int]],
    opts: CompareOptions,
    measure: bool = True,
    seed: int = 0,
) -> ModeSweep:
    """Start ``spec``, calibrate it (if ``measure``), run every rate, stop it; its log goes
    to ``opts.out_dir/<label>.log``."""
    with running_server(spec, opts.out_dir / f"{spec.label}.log") as proc:
        cal = (calibrate_started(spec, built[0][0].max_model_len, vocab, seed, opts)
               if measure else None)
        return ModeSweep(spec.label, cal, run_workloads(spec, proc, built, opts))


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The ``bench sweep`` options of its own (the workload's are ``options.add_workload_args``)."""
    where = p.add_mutually_exclusive_group(required=True)
    where.add_argument("--url", help="sweep this running server")
    where.add_argument(
        "--modes",
        help=f"start each in turn and sweep it: {', '.join(TETRI_MODES)}, {VLLM_LABEL} or a "
        "preset, each optionally MODE:key=value+key=value (settings of that server alone)",
    )
    where.add_argument(
        "--spawn", action="store_true", help="same as --modes " + ",".join(TETRI_MODES)
    )
    p.add_argument("--json", type=Path, help="result file (default --out/sweep.json)")
    add_server_arguments(p, when="--url: ")
    p.add_argument("--set", action="append", default=[], help="key=value for every tetri server")
    p.add_argument(
        "--interleave",
        action="store_true",
        help="--modes: every mode at a rate before the next rate, each point on a server of its "
        "own, the modes' order reversed every other rate (a drifting machine weighs on all alike)",
    )
    p.add_argument("--vllm-bin", help="vllm executable, for vllm-cpu in --modes")
    p.add_argument("--vllm-workers", type=int, default=1)
    p.add_argument("--ready-timeout-s", type=float, default=300.0)
    p.add_argument(
        "--slo-reference",
        help="mode whose calibration sets every mode's SLO (default coupled if swept, else first)",
    )
    p.add_argument(
        "--calibration", help="use this calibration (an earlier sweep's JSON) instead of measuring"
    )
