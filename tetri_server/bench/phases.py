"""Where an engine step's time goes, measured through the engine's own hooks: the runner's
phases (``ModelRunner.phases``: build metadata, model forward, sample) and, inside the forward,
each primitive of the model's ``Kernels`` (wrapped with a timer for the duration). Nothing is
patched; leaving the block restores the model's kernels and the runner's clock."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tetri_server.engine.runner import ModelRunner

KERNEL_PHASES = {"linear": "linear (matmuls)", "attention": "attention (one op per layer)",
                 "write_kv": "write_kv (KV rows into the pool)", "rms_norm": "RMSNorm",
                 "add_rms_norm": "residual add + RMSNorm", "rope": "RoPE",
                 "glu": "gate|up linear + SiLU(gate) * up"}
REST_OF_FORWARD = "rest of forward: embedding, last residual add, per-layer Python"
INSIDE_FORWARD = (*KERNEL_PHASES.values(), REST_OF_FORWARD)


@contextmanager
def engine_phases(runner: ModelRunner, now: Callable[[], float]) -> Iterator[dict[str, float]]:
    """Seconds per phase (on the clock ``now``) of every ``runner.execute`` inside the block,
    added up. On exit the dict also holds ``REST_OF_FORWARD``: the forward minus its kernels."""
    acc: dict[str, float] = {}
    model = runner.model
    saved = model.kernels, runner.phases, runner.clock

    def timed(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        phase = KERNEL_PHASES[name]

        def call(*args: Any, **kwargs: Any) -> Any:
            t0 = now()
            try:
                return fn(*args, **kwargs)
            finally:
                acc[phase] = acc.get(phase, 0.0) + now() - t0

        return call

    model.kernels = saved[0].wrapped(timed)
    runner.phases, runner.clock = acc, now
    try:
        yield acc
        inside = sum(acc.get(p, 0.0) for p in KERNEL_PHASES.values())
        acc[REST_OF_FORWARD] = acc.get("model forward", 0.0) - inside
    finally:
        model.kernels, (runner.phases, runner.clock) = saved[0], saved[1:]
