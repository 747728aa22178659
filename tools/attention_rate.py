"""The decode attention op alone against a plain read of the same KV: how far
``tetri::ragged_attention`` is from streaming its KV at the rate ``torch.sum`` reads it, and
what the kernel costs with the KV in cache.

    .venv/bin/python tools/attention_rate.py [--cpu 1] [--rounds 5]

One thread, pinned. Batch 32, 8 heads x 64 (the bench model's), fp32:
- from DRAM: eight pools (one per layer) of 1024 tokens a sequence, each sequence its own KV
  (1.07 GB in all), one op call per pool, against ``torch.sum`` over the same pools;
- in cache: every sequence on the same 64-1024 tokens of one pool.
Prints ns per (key, head) and GB/s (K and V rows read), best of ``--rounds``. To time a changed
kernel, run it with ``PYTHONPATH`` on a copy of the repository whose
``tetri_server/engine/ops/ragged_attention.cpp`` has the change (and its own
``TETRI_CACHE_DIR``). For kernel work, not a test.
"""

from __future__ import annotations

import argparse
import functools
import os
import time

import torch

from tetri_server.engine.ops import load_cpu_ops

BATCH, HEADS, DIM, LAYERS = 32, 8, 64, 8
ROW_BYTES = 2 * DIM * 4  # a key row and a value row, fp32


def best_s(fn, rounds: int) -> float:  # noqa: ANN001 - a callable of no arguments
    best = float("inf")
    for _ in range(rounds):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def run_op(op, q: torch.Tensor, out: torch.Tensor,  # noqa: ANN001 - the op
           pools: list[tuple[torch.Tensor, torch.Tensor]], meta: tuple[torch.Tensor, ...]) -> None:
    for pk, pv in pools:
        op(q, pk, pv, out, *meta, DIM ** -0.5, 0)


def read_pools(pools: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    for pk, pv in pools:
        pk.sum()
        pv.sum()


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cpu", type=int, default=1)
    p.add_argument("--rounds", type=int, default=5)
    args = p.parse_args(argv)
    os.sched_setaffinity(0, {args.cpu})
    torch.set_num_threads(1)
    if not load_cpu_ops():
        raise SystemExit("the C++ ops could not be built here")
    op = torch.ops.tetri.ragged_attention.default
    q = torch.randn(BATCH, HEADS, DIM)
    out = torch.empty_like(q)
    starts, ones = torch.arange(BATCH), torch.ones(BATCH, dtype=torch.long)
    print(f"ISA {torch.backends.cpu.get_cpu_capability()}, cpu {args.cpu}, 1 thread, "
          f"best of {args.rounds}")

    ctx = 1024
    pools = [(torch.randn(HEADS, BATCH * ctx, DIM), torch.randn(HEADS, BATCH * ctx, DIM))
             for _ in range(LAYERS)]
    meta = (starts, ones, torch.full((BATCH,), ctx), starts * ctx)
    keys = LAYERS * HEADS * BATCH * ctx
    attend = functools.partial(run_op, op, q, out, pools, meta)
    read = functools.partial(read_pools, pools)
    for name, fn in (("attention", attend), ("torch.sum", read)):
        s = best_s(fn, args.rounds)
        print(f"from DRAM, {name}: {s * 1e3:.1f} ms, {s / keys * 1e9:.1f} ns a (key, head), "
              f"{keys * ROW_BYTES / s / 1e9:.1f} GB/s")
    del pools, attend, read

    for ctx in (64, 128, 1024):
        shared = [(torch.randn(HEADS, ctx, DIM), torch.randn(HEADS, ctx, DIM))]
        meta = (starts, ones, torch.full((BATCH,), ctx), torch.zeros(BATCH, dtype=torch.long))
        attend = functools.partial(run_op, op, q, out, shared, meta)
        attend()  # warm
        s = best_s(attend, 4 * args.rounds)
        print(f"in cache, ctx {ctx}: {s / (HEADS * BATCH * ctx) * 1e9:.1f} ns a (key, head)")

if __name__ == "__main__":
    main()
