"""How fast one core reads the decode attention's KV in the pool's layout, with no attention
math: the bound any kernel over that layout can reach.

    .venv/bin/python tools/kv_read_pattern.py [--batch 32] [--ctx 128,1024] [--heads 8]
        [--head-dim 64] [--cpu N]

One layer's K and V of ``batch`` sequences, their extents spread over a pool of at least 44,000
tokens a head (none overlapping), summed row by row (a small C++ loop built at first use for
this CPU), each call after reading a written 256 MB buffer (so from DRAM), CPU time, median of
10:

- head-major, the engine's layout to session 55 (``[kv_heads, pool_tokens, head_dim]``): one
  item per (sequence, kv head), its K rows then its V rows in blocks of 64 alternating (as the
  decode attention walks them), with and without a software prefetch of the next block; all K
  rows then all V rows; and one item per sequence, a block of 64 rows of every head's K, then
  of every head's V;
- token-major (``[pool_tokens, kv_heads, head_dim]``, the engine's for such models since
  session 56, ``kv.layout``): one item per sequence, every head's rows of a token next to each
  other;
- ``torch.sum`` over the same number of bytes in one contiguous tensor.

Session 55 wrote it: at context 128 the decode attention read the KV at the rate of this loop
over the head-major layout, well under ``torch.sum``'s.
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import random
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

from tetri_server.bench.engine_driver import pin  # noqa: E402
from tetri_server.hostinfo import cpuinfo  # noqa: E402

SOURCE = r"""
#include <torch/extension.h>
#include <algorithm>
typedef float v16 __attribute__((vector_size(64)));  // the compiler splits it on AVX2

// Sums of the rows read; the total is returned so that no read is optimized away.
struct Reader {
  v16 a0 = {}, a1 = {}, a2 = {}, a3 = {};
  const float* p;         // the pool
  const int64_t *ko, *vo;  // items' K and V offsets (floats) into it
  int64_t d, s;  // floats a row, floats between rows
  Reader(const torch::Tensor& pool, const torch::Tensor& k_off, const torch::Tensor& v_off,
         int64_t d_, int64_t s_)
      : p(pool.data_ptr<float>()), ko(k_off.data_ptr<int64_t>()), vo(v_off.data_ptr<int64_t>()),
        d(d_), s(s_) {}
  const float* k(int64_t item) const { return p + ko[item]; }
  const float* v(int64_t item) const { return p + vo[item]; }
  // rows [lo, hi) of an item of n rows at `base`; with `prefetch`, each row also asks for the
  // row 64 ahead (a block ahead), inside the item
  void rows(const float* base, int64_t lo, int64_t hi, int64_t n, bool prefetch) {
    for (int64_t j = lo; j < hi; ++j) {
      const float* r = base + j * s;
      if (prefetch && j + 64 < n) {
        for (int64_t o = 0; o < d; o += 16) __builtin_prefetch(r + 64 * s + o, 0, 2);
      }
      for (int64_t i = 0; i + 64 <= d; i += 64) {
        v16 x0, x1, x2, x3;
        __builtin_memcpy(&x0, r + i, 64);
        __builtin_memcpy(&x1, r + i + 16, 64);
        __builtin_memcpy(&x2, r + i + 32, 64);
        __builtin_memcpy(&x3, r + i + 48, 64);
        a0 += x0; a1 += x1; a2 += x2; a3 += x3;
      }
    }
  }
  double total() const {
    v16 t = a0 + a1 + a2 + a3;
    double sum = 0;
    for (int i = 0; i < 16; ++i) sum += t[i];
    return sum;
  }
};

// items: K and V offsets (floats) into `pool`; each item n rows of d floats, rows s apart.
// interleave: blocks of 64 rows, K then V, as the decode attention; else all K, then all V.
double read_items(torch::Tensor pool, torch::Tensor k_off, torch::Tensor v_off, int64_t n,
                  int64_t d, int64_t s, bool prefetch, bool interleave) {
  Reader rd(pool, k_off, v_off, d, s);
  for (int64_t it = 0; it < k_off.numel(); ++it) {
    const int64_t block = interleave ? 64 : n;
    for (int64_t b = 0; b < n; b += block) {
      rd.rows(rd.k(it), b, std::min(n, b + block), n, prefetch);
      rd.rows(rd.v(it), b, std::min(n, b + block), n, prefetch);
    }
  }
  return rd.total();
}

// head-major, one item per sequence: its `heads` (sequence, head) offsets in a row of k_off /
// v_off; per block of 64 rows, that block of every head's K, then of every head's V.
double read_sequences(torch::Tensor pool, torch::Tensor k_off, torch::Tensor v_off,
                      int64_t heads, int64_t n, int64_t d, int64_t s) {
  Reader rd(pool, k_off, v_off, d, s);
  for (int64_t it = 0; it < k_off.numel(); it += heads) {
    for (int64_t b = 0; b < n; b += 64) {
      for (int64_t h = 0; h < heads; ++h) rd.rows(rd.k(it + h), b, std::min(n, b + 64), n, false);
      for (int64_t h = 0; h < heads; ++h) rd.rows(rd.v(it + h), b, std::min(n, b + 64), n, false);
    }
  }
  return rd.total();
}
"""


def build() -> object:
    """The loops, built for this CPU (``-march=native``). The cache name hashes the source and
    the CPU's model and ISA flags from ``/proc/cpuinfo``: these VMs all call themselves "AMD
    EPYC", so the model name alone would load an AVX-512 build on an AVX2 machine."""
    from torch.utils.cpp_extension import load_inline

    cpu = "|".join(cpuinfo(f) for f in ("model name", "cpu family", "model", "flags"))
    tag = hashlib.sha1(f"{cpu}|{torch.backends.cpu.get_cpu_capability()}|{SOURCE}".encode())
    return load_inline(f"tetri_kv_read_pattern_{tag.hexdigest()[:12]}", cpp_sources=SOURCE,
                       functions=["read_items", "read_sequences"],
                       extra_cflags=["-O3", "-march=native"])


def cold_ms(fn: Callable[[], object], evict: torch.Tensor, reps: int = 10) -> float:
    times = []
    for _ in range(reps):
        evict.sum()
        t0 = time.process_time()
        fn()
        times.append(time.process_time() - t0)
    return 1e3 * statistics.median(times)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--ctx", default="128,1024", help="context lengths, a comma list")
    ap.add_argument("--heads", type=int, default=8, help="KV heads")
    ap.add_argument("--head-dim", type=int, default=64, help="a multiple of 64")
    ap.add_argument("--cpu", type=int, default=None, help="core to pin (default: least busy)")
    args = ap.parse_args()
    if args.head_dim % 64:
        ap.error("--head-dim must be a multiple of 64")
    cpu = pin(args.cpu)
    lib = build()
    read = lib.read_items  # type: ignore[attr-defined]
    evict = eviction_buffer()
    b, h, d = args.batch, args.heads, args.head_dim
    print(f"core {cpu}, {torch.backends.cpu.get_cpu_capability()}, batch {b}, {h} KV heads of "
          f"{d}; one layer's K and V from DRAM, ms and GB/s")
    print("| context | MB | layout and walk | ms | GB/s |\n|---:|---:|---|---:|---:|")
    for ctx in (int(c) for c in args.ctx.split(",")):
        # extents spread over the pool as the engine's (its 44,000 tokens a head at batch 32),
        # never overlapping: each sequence's slot is at least its context long
        slot = max(1380, ctx)
        tokens = max(44_000, b * slot)
        starts = [k * slot for k in random.Random(0).sample(range(b), b)]
        nbytes = 2 * b * h * ctx * d * 4
        head_major = torch.randn(2, h, tokens, d)
        ko = torch.tensor([hh * tokens * d + st * d for st in starts for hh in range(h)])
        vo = ko + h * tokens * d
        walks = (("K/V blocks of 64 alternating", False, True),
                 ("K/V blocks of 64 alternating, prefetch a block ahead", True, True),
                 ("all K, then all V", False, False))
        cases: list[tuple[str, Callable[[], object]]] = [
            (f"head-major, {name}", functools.partial(read, head_major, ko, vo, ctx, d, d, pf, il))
            for name, pf, il in walks]
        cases.append(("head-major, a sequence's heads block by block (all K, then all V)",
                      functools.partial(lib.read_sequences, head_major,  # type: ignore[attr-defined]
                                        ko, vo, h, ctx, d, d)))
        token_major = torch.randn(2, tokens, h, d)
        tko = torch.tensor([st * h * d for st in starts])
        tvo = tko + tokens * h * d
        cases.append(("token-major, a sequence's rows of every head in one stream",
                      functools.partial(read, token_major, tko, tvo, ctx * h, d, d, False, True)))
        flat = torch.ones(nbytes // 4)
        cases.append(("torch.sum, one contiguous tensor", flat.sum))
        for name, fn in cases:
            fn()
            ms = cold_ms(fn, evict)
            print(f"| {ctx} | {nbytes / 1e6:.1f} | {name} | {ms:.3f} | {nbytes / ms / 1e6:.1f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
