"""The decode attention inside an engine step against the same call alone, on one core.

    .venv/bin/python tools/attention_in_step.py [--batch 32] [--ctx 128] [--rounds 3] [--cpu N]

Drives decode steps of the ``bench`` model at batch B over C-token contexts (the
``bench_engine`` driver, CPU time, one thread, pinned) and prints per round, in ms:

- the step's median (the contexts grow a token a step: the mean context of the call below is
  printed);
- the attention op's median per layer inside those steps;
- layer 0's call of one step again alone on the engine's pool: hot (right after itself) and
  cold (after reading a 256 MB written buffer, so its KV comes from DRAM);
- the same call cold on a compact copy of its KV (each sequence's extent next to the last,
  the layout ``tools/ab_kernels.py --attention`` uses).

Session 55 wrote it to tell the harness from the op: ``ab_kernels``' "cold" had run from L3.
"""

from __future__ import annotations

import argparse
import functools
import math
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tools"))

from ab_kernels import eviction_buffer  # noqa: E402

from tetri_server.bench.cpu import Timer  # noqa: E402
from tetri_server.bench.engine_driver import EngineDriver, pin  # noqa: E402
from tetri_server.engine.attention import ragged_attention  # noqa: E402


def ms(times: list[float]) -> float:
    return 1e3 * statistics.median(times)


def timed(fn: Callable[[], object], evict: torch.Tensor | None = None) -> float:
    """CPU seconds of one call; with ``evict``, read that buffer first (the call's data then
    comes from DRAM)."""
    if evict is not None:
        evict.sum()
    t0 = time.process_time()
    fn()
    return time.process_time() - t0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--ctx", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--cpu", type=int, default=None, help="core to pin (default: least busy)")
    args = ap.parse_args()
    cpu = pin(args.cpu)
    drv = EngineDriver(Timer("cpu"), ROOT / "models" / "llama-bench", args.batch,
                       max(args.ctx, 1024), 64)
    calls: list[float] = []
    captured: list[tuple] = []

    def timed_attention(q, pool_k, pool_v, meta, scale=None, window=0):  # type: ignore[no-untyped-def]
        if not captured:
            captured.append((q.clone(), pool_k, pool_v, meta, scale, window))
        t0 = time.process_time()
        out = ragged_attention(q, pool_k, pool_v, meta, scale, window)
        calls.append(time.process_time() - t0)
        return out

    big = eviction_buffer()
    rows: dict[str, list[float]] = {}
    steps = 20
    with drv.kernels(attention=timed_attention), \
            drv.decoding(args.batch, args.ctx, (steps + 1) * args.rounds + 5) as run:
        for _ in range(5):
            run()
        for _ in range(args.rounds):
            calls.clear()
            rows.setdefault("step", []).append(
                ms([drv.timer.timed(run, "step") for _ in range(steps)]))
            rows.setdefault("attention per layer, in the step", []).append(ms(calls))
            captured.clear()
            run()
            q, pool_k, pool_v, meta, scale, window = captured[0]
            kv_bytes = (2 * sum(meta.ctx_lens) * pool_k.shape[0] * pool_k.shape[-1]
                        * pool_k.element_size())
            rows.setdefault("mean context of layer 0's call", []).append(
                sum(meta.ctx_lens) / len(meta.ctx_lens))

            scale_ = scale if scale is not None else 1.0 / math.sqrt(q.shape[-1])
            out = torch.empty(q.shape)
            on_pool = functools.partial(torch.ops.tetri.ragged_attention, q, pool_k, pool_v,
                                        out, *meta.seq_tensors, scale_, window)
            on_pool()
            rows.setdefault("alone, hot, engine pool", []).append(
                ms([timed(on_pool) for _ in range(20)]))
            rows.setdefault("alone, cold, engine pool", []).append(
                ms([timed(on_pool, big) for _ in range(10)]))
            rows.setdefault("  its read rate, GB/s", []).append(
                kv_bytes / rows["alone, cold, engine pool"][-1] / 1e6)
            ext = list(zip(meta.kv_starts, meta.ctx_lens, strict=True))
            ck = torch.cat([pool_k[:, s:s + c] for s, c in ext], 1)
            cv = torch.cat([pool_v[:, s:s + c] for s, c in ext], 1)
            if pool_k.stride(0) < pool_k.stride(1):  # stored like the pool: token-major (auto)
                ck, cv = (x.transpose(0, 1).contiguous().transpose(0, 1) for x in (ck, cv))
            starts = torch.tensor([0, *meta.ctx_lens[:-1]]).cumsum(0)
            compact = functools.partial(torch.ops.tetri.ragged_attention, q, ck, cv, out,
                                        *meta.seq_tensors[:3], starts, scale_, window)
            rows.setdefault("alone, cold, compact copy", []).append(
                ms([timed(compact, big) for _ in range(10)]))
            compact_out = out.clone()
            on_pool()
            if not torch.equal(compact_out, out):
                print("note: the compact copy's output differs from the pool's", file=sys.stderr)
    print(f"core {cpu}, batch {args.batch}, context {args.ctx} at the start (each step adds a "
          "token); ms per round unless named")
    for name, vals in rows.items():
        print(f"  {name:34s} " + " ".join(f"{v:7.3f}" for v in vals))
    return 0


if __name__ == "__main__":
    sys.exit(main())
