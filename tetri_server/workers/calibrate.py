"""Chunk-size calibration (``prefill.chunk_size = 0``): measure prefill throughput over token
counts 32..4096 at start-up (the best of three interleaved rounds) and pick the knee
(``policy.knee``). The picks are cached per (model, device, dtype, threads, processor, engine
build, calibration rule), and a new engine (other kernels, another torch), another processor or
another rule measures again: a knee measured for one engine must not stick to the next (it did:
a cached 2048 outlived a change that moved the knee to 256). Nor must one calibration on a
loaded machine: the first ``PICKS`` starts each calibrate once more, and a start serves the
median of the picks so far (the lower one of two); later starts skip the measurement (six
calibrations on a shared Zen 5 core picked 256, 608, 416, 256, 384 and 1424: the curve is
within a few percent of its plateau from 256 tokens on, so noise moves the crossing far). With
one thread the passes are timed in the thread's CPU time, so time slices another process takes
from the core do not bend the curve."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import platform
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from tetri_server.engine.ops import build_spec
from tetri_server.engine.runner import ScheduledSeq, StepPlan
from tetri_server.engine.sequence import Sequence
from tetri_server.hostinfo import cpuinfo
from tetri_server.messages import SamplingParams
from tetri_server.policy import (
    CALIBRATION_SIZES,
    RIDER_CONTEXT,
    knee,
    pick_chunk_size,
    throughput_curve,
)

if TYPE_CHECKING:
    from tetri_server.workers.base import Worker

log = logging.getLogger("tetri.calibrate")
SIZES = CALIBRATION_SIZES
ROUNDS = 3
PICKS = 3  # calibrations, one per start, whose median pick later starts serve


def cache_file() -> Path:
    root = Path(os.environ.get("TETRI_CACHE_DIR", Path.home() / ".cache" / "tetri_server"))
    return root / "chunk_size.json"


def processor() -> str:
    """The CPU's model name (``/proc/cpuinfo``), else the platform's."""
    return cpuinfo("model name") or platform.processor() or platform.machine()


def engine_build() -> str:
    """What the engine's speed depends on besides the model: the engine's Python sources,
    and the C++ ops' build (its folder name: CPU capability, torch version, sources + flags
    digest)."""
    root = Path(__file__).resolve().parent.parent / "engine"
    digest = hashlib.sha256()
    for src in sorted(root.rglob("*.py")):
        digest.update(src.read_bytes())
    _, _, folder = build_spec()
    return f"engine-{digest.hexdigest()[:12]}|{folder.name}"


def calibration_rule() -> str:
    """How the knee is measured and picked (this module and ``policy/knee.py``): a cached pick
    made by another rule is measured again (the rule once moved from the measured sizes'
    best-of-2 to an interpolated crossing of three interleaved rounds)."""
    digest = hashlib.sha256()
    for src in (Path(__file__), Path(knee.__file__)):
        digest.update(src.resolve().read_bytes())
    return f"rule-{digest.hexdigest()[:8]}"


def cache_key(worker: Worker, rows: int = 0) -> str:
    folder = Path(worker.cfg.model.path).resolve()  # one entry however the path was typed
    model = str(folder)
    stamp = ""
    if (folder / "config.json").is_file():
        stamp = hashlib.sha256((folder / "config.json").read_bytes()).hexdigest()[:16]
    dtype = next(worker.model.parameters()).dtype
    return (f"{model}|{stamp}|{worker.device}|{dtype}|threads={torch.get_num_threads()}"
            f"|{processor()}|{engine_build()}|{calibration_rule()}"
            + (f"|rows={rows}" if rows else "")
            # every attention row through the one-row kernel: another prefill rate
            + ("|batch_invariant" if worker.cfg.model.batch_invariant else ""))


def pass_clock(device: str) -> Callable[[], float]:
    """The clock a calibration pass is timed on: the thread's CPU time for a one-thread CPU
    worker, wall time otherwise (a GPU pass, or several threads)."""
    if device == "cpu" and torch.get_num_threads() == 1:
        return time.thread_time
    return time.perf_counter


def measure(worker: Worker, sizes: tuple[int, ...] = SIZES, rounds: int = ROUNDS,
            rows: int = 0) -> list[tuple[int, float]]:
    """(tokens, seconds) of one packed prefill pass per size, the best of ``rounds``. The
    rounds are interleaved (each round passes once over every size), so a slow spell of the
    machine slows one pass of several sizes rather than every pass of one size. With ``rows``,
    each pass of ``n`` tokens is the step a prefill worker that decodes ``rows`` requests itself
    runs: ``n - rows`` prompt tokens and ``rows`` one-token decode rows over ``RIDER_CONTEXT``
    tokens each (sizes not above ``rows`` are skipped)."""
    gen = torch.Generator().manual_seed(0)
    per_seq = max(1, min(worker.max_model_len - 1, 1024))
    context = max(1, min(RIDER_CONTEXT, worker.max_model_len - 1)) if rows else 0
    room = worker.allocator.num_blocks * worker.block_size // 2
    row_room = rows * -(-(context + 1) // worker.block_size) * worker.block_size
    fits = [n for n in sizes if rows < n and n - rows + row_room <= room]
    best = dict.fromkeys(fits, float("inf"))
    clock = pass_clock(str(worker.device))

    def sequence(num_tokens: int, num_computed: int) -> Sequence | None:
        ids = torch.randint(5, worker.model_spec.vocab_size, (num_tokens,), generator=gen)
        seq = Sequence(-1, ids.tolist(), num_tokens, SamplingParams(temperature=0.0),
                       num_computed=num_computed)
        return seq if worker.kv.reserve(seq, num_tokens) else None

    for _ in range(rounds):
        for n in fits:
            items: list[ScheduledSeq] = []
            for _ in range(rows):
                # a decode row: one new token over a context whose KV is left as it is (only
                # the row's cost counts here)
                row = sequence(context + 1, context)
                if row is not None:
                    items.append(ScheduledSeq(row, 1))
            left = n - rows
            while left > 0:
                k = min(left, per_seq)
                seq = sequence(k, 0)
                if seq is None:
                    break
                items.append(ScheduledSeq(seq, k))
                left -= k
            t0 = clock()
            worker.runner.execute(StepPlan(items))
            best[n] = min(best[n], max(clock() - t0, 1e-9))
            for item in items:
                worker.kv.free(item.seq)
    return list(best.items())


def served_pick(picks: list[int]) -> int:
    """The chunk a start serves from the picks cached so far: their median, the lower one of
    two (``PICKS`` calibrations, one per start, outvote one made on a loaded machine)."""
    return statistics.median_low(picks)


def resolve_chunk_size(worker: Worker, configured: int, rows: int = 0, *,
                       at_start: bool = True) -> int:
    """The configured chunk size, or (0) the knee of the prompt rate measured in passes that
    hold ``rows`` decode rows too (``prefill.local_decode_batch``: the requests a prefill
    worker decodes itself ride in its chunks and take part of each; ``policy.knee``): the
    median of the cached picks, calibrating once more while fewer than ``PICKS`` are cached.

    Not ``at_start`` (a worker flipping to prefill), any cached pick serves: there the worker
    is serving already and sends nothing while it measures, and a measurement of several
    seconds got it killed as stalled (``monitor.stall_timeout_s``) on every flip until three
    starts had cached their picks. It measures only with none cached."""
    if configured > 0:
        return configured
    key, path = cache_key(worker, rows), cache_file()
    cached: dict[str, list[int]] = {}
    if path.is_file():
        cached = {k: v if isinstance(v, list) else [v]  # one pick, as builds before 28 wrote
                  for k, v in json.loads(path.read_text()).items()}
    picks = cached.get(key, [])
    if len(picks) >= PICKS or (picks and not at_start):
        size = served_pick(picks)
        log.info("chunk size %d (median of the cached calibrations %s for %s)", size, picks,
                 key)
        return size
    samples = measure(worker, rows=rows)
    if not samples:
        raise RuntimeError(
            f"prefill.chunk_size = 0: no calibration pass of {SIZES} tokens fits half of this "
            f"worker's KV pool ({worker.allocator.num_blocks} blocks of {worker.block_size})"
            + (f" beside {rows} decode rows" if rows else "")
            + "; set prefill.chunk_size or a larger pool")
    picks = cached[key] = [*picks, pick_chunk_size(samples, riders=rows)]
    size = served_pick(picks)
    log.warning("calibrated prefill chunk size %d from %s%s; serving %d, the median of %s "
                "(calibration %d of %d, one per start)", picks[-1],
                ", ".join(f"{n}:{tps:.0f} tok/s" for n, tps in throughput_curve(samples, rows)),
                f" (prompt tokens/s in steps with {rows} decode rows)" if rows else "",
                size, picks, len(picks), PICKS)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps(cached, indent=1))
    tmp.replace(path)
    return size
