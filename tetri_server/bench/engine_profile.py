"""A short run of the engine benchmark's shapes, as samples for ``sim/fit.py``: prefill steps
of C tokens (prompts of 128 packed into the step, as a TetriInfer chunk, and one prompt of C
tokens) and decode steps over B running sequences of ``ctx`` tokens, on one pinned core and one
torch thread, as each worker runs. The times are medians on the ``Timer``'s clock (process CPU
time by default: time slices other tenants take from the core are not counted). Imports torch;
``tetri-server sim fit`` imports this module only when it runs."""

from __future__ import annotations

import statistics
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tetri_server.bench.cpu import Timer
from tetri_server.bench.engine_driver import Baselines, EngineDriver, pin
from tetri_server.sim.fit import StepSample
from tetri_server.sim.profiles import ModelShape


@dataclass(frozen=True)
class Shapes:
    packed: tuple[int, ...] = (16, 32, 64, 128, 256, 512, 1024)  # chunk tokens, prompts of 128
    single: tuple[int, ...] = (256, 512, 1024)  # one prompt of C tokens
    batches: tuple[int, ...] = (1, 4, 16, 32)
    contexts: tuple[int, ...] = (64, 256, 1024)
    prefill_reps: int = 3
    decode_steps: int = 5
    warmup: int = 1


QUICK = Shapes(packed=(16, 64, 256, 512), single=(512,), batches=(1, 8, 32),
               contexts=(64, 512), prefill_reps=2, decode_steps=3)
PACK_LEN = 128


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def packed_lens(total: int, pack_len: int = PACK_LEN) -> list[int]:
    """``total`` tokens as prompts of ``pack_len`` (the last one shorter)."""
    lens = [pack_len] * (total // pack_len)
    return lens + [total % pack_len] if total % pack_len else lens


def model_shape(drv: EngineDriver, name: str) -> ModelShape:
    """The cost model's shape of the engine's model."""
    s = drv.eng.spec
    return ModelShape(name=name, family="opt" if s.family == "opt" else "llama",
                      num_layers=s.num_layers, hidden=s.hidden_size, num_heads=s.num_heads,
                      num_kv_heads=s.num_kv_heads, head_dim=s.head_dim,
                      ffn=s.intermediate_size, vocab=s.vocab_size,
                      dtype_bytes=drv.shape.dtype_bytes,
                      max_model_len=s.max_position_embeddings)


def _median(timer: Timer, run: Callable[[], None], reps: int, warmup: int,
            section: str) -> float:
    for _ in range(warmup):
        run()
    return statistics.median(timer.timed(run, section) for _ in range(reps))


def measure(model_path: Path, shapes: Shapes = Shapes(), clock: str = "cpu",
            cpu: int | None = None, dtype: str = "float32"
            ) -> tuple[list[StepSample], ModelShape, dict[str, Any]]:
    """(samples, the model's shape, run info: core, baselines, CPU shares)."""
    core = pin(cpu)
    timer = Timer(clock)
    base = Baselines(timer)
    base.measure(quick=True)
    extra = shapes.decode_steps + shapes.warmup + 4
    drv = EngineDriver(timer, model_path, max(shapes.batches), max(shapes.contexts), extra, dtype)
    samples: list[StepSample] = []
    for kind, sizes in (("prefill", shapes.packed), ("prefill-1seq", shapes.single)):
        for num in sizes:
            lens = packed_lens(num) if kind == "prefill" else [num]
            with drv.prefill(lens) as run:
                t = _median(timer, run, shapes.prefill_reps, shapes.warmup, "prefill")
            samples.append(StepSample(kind, tuple((n, 0) for n in lens), t))
            _log(f"  {kind} {num} tokens: {1e3 * t:.1f} ms")
    for batch in shapes.batches:
        for ctx in shapes.contexts:
            times = drv.decode_step_times(batch, ctx, shapes.decode_steps, shapes.warmup,
                                          "decode")
            mid = ctx + shapes.warmup + shapes.decode_steps // 2  # context grows a token a step
            samples.append(StepSample("decode", ((1, mid),) * batch, statistics.median(times)))
            _log(f"  decode B={batch} ctx={ctx}: {1e3 * samples[-1].time_s:.1f} ms")
    base.measure(quick=True)
    info = {"core": core, "clock": clock, "dtype": dtype,
            "matmul_peak_gflops": base.peak_gflops, "memcpy_gbps": base.mem_gbps,
            "read_gbps": base.read_gbps,
            "cpu_share": {k: round(v.share, 3) for k, v in timer.shares.items()}}
    return samples, model_shape(drv, Path(model_path).name), info
