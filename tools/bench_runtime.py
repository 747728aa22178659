"""Runtime benchmark: channel round trip, KV hand-off against memcpy, decode interference by mode.

    .venv/bin/python tools/bench_runtime.py [--quick] [--sections channel,kv,interference]
                                            [--modes disaggregated,coupled,coupled-chunked]

The dev machine has 2 cores shared with other jobs, so every absolute number is noisy: each
section measures its baseline in the same run and reports ratios, and prints how much CPU other
processes took meanwhile. Markdown on stdout, progress on stderr. About 2.5 minutes (--quick:
about 1.5; most of it is cluster start-up, slower when the machine is busy).

1. Channel: runs ``tools/bench_channel.py`` (parent <-> child over ``tetri_server.channel``,
   eventfd wake-ups, no spinning) and reports its round-trip p50/p99 and one-way messages/s.
2. KV hand-off: the KV of a 512- and a 2048-token prompt of the ``bench`` model (llama, 8 layers,
   8 KV heads x 64, fp32: 32 KiB per token) in a producer pool owned by ANOTHER process (shm
   transport, as in tests/unit/test_transport.py), pulled into this process's pool by
   ``ShmTransport.copy_blocks`` (one extent, one strided copy), 1 torch thread. Baseline:
   ``np.copyto`` of the same number of bytes into a pre-touched destination (1 thread). Variants
   are timed interleaved round robin, median of ``--kv-reps``: numpy ``copyto`` on the pools'
   ``.numpy()`` views, per-layer and per-(layer, K/V, head) copies. "cold" is the first copy out
   of a freshly mapped peer pool (page-table faults on the peer's pages, once per page per
   mapping); "populated" maps the peer pool with MAP_POPULATE first and reports that cost too.
3. Interference (TetriInfer's core claim): a cluster of the bench model on 2 workers, one core
   each, in each mode (disaggregated = 1 prefill + 1 decode worker; coupled and coupled-chunked
   = 2 workers; prefill.chunk_size = prefill.token_budget = 256). Warm-up, then 8 long decode
   requests (ignore_eos), a quiet window (no arrivals: the "alone" ITL of the same cluster), then
   a loaded window during which a 1024-token prompt arrives every 1-2 s (one seeded schedule,
   the same for every mode). ITL = gaps between TokenDelta arrivals in this (control) process,
   for the 8 decode streams only; a stall that starts in the loaded window counts whole (the
   run waits, bounded, for every stream's next token after the window). Also: TTFT of the
   arriving prompts, decode tokens/s of the 8 streams, each worker's CPU share and the CPU other
   processes used during the window. The same ITL and TTFT are also given on each worker's own
   CPU clock (``CpuClock``): an estimate of what a core of its own would give, for a machine
   where other jobs take most of the CPU.

``--dump FILE`` writes the raw token arrival times and CPU-clock samples of every mode (JSON).
CPU accounting comes from ``tetri_server.bench.cpu``.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import math
import mmap
import os
import platform
import random
import re
import statistics
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import msgspec
import numpy as np
import torch

from tetri_server.bench.cpu import CpuClock, CpuWindow, others_cores
from tetri_server.channel import SHM_DIR, new_run_id, unlink_segment
from tetri_server.control.requests import Stream
from tetri_server.kv.transport import KVTransport, PoolGeometry, make_transport
from tetri_server.messages import PoolHandle, SamplingParams

ROOT = Path(__file__).resolve().parents[1]

MODES = ("disaggregated", "coupled", "coupled-chunked")
MEMCPY = "memcpy: np.copyto, contiguous (baseline)"
TRANSPORT = "ShmTransport.copy_blocks (what the decode worker runs)"


def log(msg: str) -> None:
    print(f"[bench_runtime {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def pct(values: list[float], q: float) -> float:
    """Nearest-rank percentile (q in [0, 1]); nan for no values."""
    if not values:
        return float("nan")
    s = sorted(values)
    return s[min(len(s) - 1, max(0, math.ceil(q * len(s)) - 1))]


def loadavg() -> str:
    with open("/proc/loadavg") as f:
        return " ".join(f.read().split()[:3])


# ---------------------------------------------------------------------------- CPU accounting


# ---------------------------------------------------------------------------- 1. channel

RTT_RE = re.compile(r"p50 ([\d.]+) us, p99 ([\d.]+) us")
MPS_RE = re.compile(r"one-way: ([\d,]+) msgs/s")


@dataclass
class ChannelRun:
    p50_us: float
    p99_us: float
    msgs_per_s: float


def bench_channel(iters: int, msgs: int, runs: int) -> list[ChannelRun]:
    out: list[ChannelRun] = []
    for i in range(runs):
        log(f"channel run {i + 1}/{runs}: tools/bench_channel.py --iters {iters} --msgs {msgs}")
        res = subprocess.run(
            [sys.executable, str(ROOT / "tools" / "bench_channel.py"), "--iters", str(iters),
             "--msgs", str(msgs)], capture_output=True, text=True, timeout=300, check=True)
        rtt, mps = RTT_RE.search(res.stdout), MPS_RE.search(res.stdout)
        if rtt is None or mps is None:
            raise RuntimeError(f"unexpected bench_channel output:\n{res.stdout}")
        out.append(ChannelRun(float(rtt.group(1)), float(rtt.group(2)),
                              float(mps.group(1).replace(",", ""))))
    return out


def report_channel(runs: list[ChannelRun]) -> None:
    print("## 1. Channel (tools/bench_channel.py, ~200-byte StepOutput, unpinned)\n")
    print("| run | round trip p50 | p99 | one-way msgs/s |")
    print("|---|---|---|---|")
    for i, r in enumerate(runs, 1):
        print(f"| {i} | {r.p50_us:.1f} µs | {r.p99_us:.1f} µs | {r.msgs_per_s:,.0f} |")
    best = min(r.p50_us for r in runs)
    verdict = "met" if best <= 50 else "MISSED"
    print(f"\nTarget p50 ≤ 50 µs: {verdict} (best p50 {best:.1f} µs).\n")


# ---------------------------------------------------------------------------- 2. KV hand-off

PRODUCER = textwrap.dedent("""
    import sys, msgspec, torch
    from tetri_server.kv.transport import KVTransport, PoolGeometry, make_transport
    torch.set_num_threads(1)
    layers, blocks, bs, heads, dim, name = sys.argv[1:7]
    g = PoolGeometry(int(layers), int(blocks), int(bs), int(heads), int(dim), torch.float32)
    t = make_transport("shm", 0, g, torch.device("cpu"), name)
    t.kv.copy_(torch.randn(g.shape, generator=torch.Generator().manual_seed(0)))
    print(msgspec.json.encode(t.export()).decode(), flush=True)
    sys.stdin.readline()  # own the pool until the consumer is done
    t.close()
""")


def bench_geometry(model: Path, num_blocks: int) -> PoolGeometry:
    from tetri_server.engine.loader import load_hf_config
    from tetri_server.engine.spec import spec_from_hf_config

    s = spec_from_hf_config(load_hf_config(model))
    # head-major, which the per-head copy variants below assume; a server's pool for the bench
    # model is token-major since session 56 (kv.layout auto), where an extent of a layer is one run
    return PoolGeometry(s.num_layers, num_blocks, 16, s.num_kv_heads, s.head_dim, torch.float32,
                        "head-major")


def map_populated(name: str, num_bytes: int) -> torch.Tensor:
    """The peer's pool mapped with MAP_POPULATE (page tables filled by the mmap call)."""
    fd = os.open(os.path.join(SHM_DIR, name), os.O_RDWR)
    try:
        mm = mmap.mmap(fd, num_bytes, flags=mmap.MAP_SHARED | mmap.MAP_POPULATE)
    finally:
        os.close(fd)
    return torch.frombuffer(mm, dtype=torch.uint8, count=num_bytes)


@dataclass
class KVResult:
    num_tokens: int
    num_bytes: int
    gbps: dict[str, float]  # variant -> median GB/s
    best_gbps: dict[str, float]  # variant -> GB/s of the fastest rep
    cold_gbps: float
    populate_ms: float  # MAP_POPULATE of the whole peer pool
    populated_first_gbps: float
    pool_mib: float


def timed(fn: Callable[[], object]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def populated_first_copy(handle: PoolHandle, geo: PoolGeometry, dst_kv: torch.Tensor, s0: int,
                         d0: int, n: int) -> tuple[float, float]:
    """(seconds to map the peer pool with MAP_POPULATE, seconds of the first copy after it)."""
    t0 = time.perf_counter()
    src = map_populated(handle.name, geo.num_bytes).view(torch.float32).view(geo.shape)
    populate_s = time.perf_counter() - t0
    return populate_s, timed(lambda: dst_kv[:, :, :, d0:d0 + n].copy_(src[:, :, :, s0:s0 + n]))


def kv_one_size(mine: KVTransport, handle: PoolHandle, geo: PoolGeometry, n: int,
                reps: int) -> KVResult:
    """Pull the extent of an ``n``-token prompt from the peer pool ``handle`` into ``mine``."""
    bs = geo.block_size
    src_block, dst_block = 8, 24  # extents at different offsets on the two sides
    nb = -(-n // bs)
    src_ids = list(range(src_block, src_block + nb))
    dst_ids = list(range(dst_block, dst_block + nb))
    num_bytes = n * geo.num_layers * 2 * geo.num_kv_heads * geo.head_dim * 4
    s0, d0 = src_block * bs, dst_block * bs
    dst_kv = mine.kv
    # cold: a fresh mapping of the peer pool, as a decode worker has right after PeerPools
    cold = []
    for _ in range(5):
        mine.drop(0)
        mine.open(handle)
        cold.append(timed(lambda: mine.copy_blocks(0, src_ids, dst_ids, n)))
    pops = [populated_first_copy(handle, geo, dst_kv, s0, d0, n) for _ in range(3)]
    populate_s, pop_first = (statistics.median(x) for x in zip(*pops, strict=True))
    mine.drop(0)
    mine.open(handle)
    mine.copy_blocks(0, src_ids, dst_ids, n)  # warm the mapping for the variants
    src_kv = mine._peers[0][1]  # type: ignore[attr-defined]  # the transport's own mapping
    src_np, dst_np = src_kv.numpy(), dst_kv.numpy()
    heads = geo.num_layers * 2 * geo.num_kv_heads
    src3, dst3 = src_kv.view(heads, -1, geo.head_dim), dst_kv.view(heads, -1, geo.head_dim)
    src3n, dst3n = src3.numpy(), dst3.numpy()
    a = np.random.default_rng(0).random(num_bytes // 4, dtype=np.float32)
    b = np.zeros_like(a)  # pre-touched
    b_t, a_t = torch.from_numpy(b), torch.from_numpy(a)

    def per_layer() -> None:
        for layer in range(geo.num_layers):
            dst_kv[layer, :, :, d0:d0 + n].copy_(src_kv[layer, :, :, s0:s0 + n])

    def per_head_torch() -> None:
        for h in range(heads):
            dst3[h, d0:d0 + n].copy_(src3[h, s0:s0 + n])

    def per_head_numpy() -> None:
        for h in range(heads):
            np.copyto(dst3n[h, d0:d0 + n], src3n[h, s0:s0 + n])

    variants: dict[str, Callable[[], object]] = {
        MEMCPY: lambda: np.copyto(b, a),
        "torch copy_ (contiguous)": lambda: b_t.copy_(a_t),
        TRANSPORT: lambda: mine.copy_blocks(0, src_ids, dst_ids, n),
        "np.copyto on the pools' .numpy() views": lambda: np.copyto(
            dst_np[:, :, :, d0:d0 + n], src_np[:, :, :, s0:s0 + n]),
        "torch copy_ per layer": per_layer,
        "torch copy_ per (layer, K/V, head)": per_head_torch,
        "np.copyto per (layer, K/V, head)": per_head_numpy,
    }
    times: dict[str, list[float]] = {k: [] for k in variants}
    for fn in variants.values():
        fn()  # warm-up
    for _ in range(reps):
        for k, fn in variants.items():
            times[k].append(timed(fn))
    if not torch.equal(dst_kv[:, :, :, d0:d0 + n], src_kv[:, :, :, s0:s0 + n]):
        raise AssertionError("the hand-off copy is wrong")
    return KVResult(n, num_bytes,
                    {k: num_bytes / statistics.median(v) / 1e9 for k, v in times.items()},
                    {k: num_bytes / min(v) / 1e9 for k, v in times.items()},
                    num_bytes / statistics.median(cold) / 1e9, populate_s * 1e3,
                    num_bytes / pop_first / 1e9, geo.num_bytes / 2**20)


def bench_kv(model: Path, token_counts: list[int], reps: int) -> list[KVResult]:
    geo = bench_geometry(model, num_blocks=2 * max(token_counts) // 16 + 32)
    run_id = new_run_id()
    name = f"{run_id}-benchkv-producer"
    argv = [str(x) for x in (geo.num_layers, geo.num_blocks, geo.block_size, geo.num_kv_heads,
                             geo.head_dim, name)]
    child = subprocess.Popen([sys.executable, "-c", PRODUCER, *argv], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True, cwd=ROOT)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a worker on this machine runs 1 torch thread
    mine = make_transport("shm", 1, geo, torch.device("cpu"), f"{run_id}-benchkv-consumer")
    results: list[KVResult] = []
    try:
        assert child.stdout is not None
        handle = msgspec.json.decode(child.stdout.readline(), type=PoolHandle)
        for n in token_counts:
            results.append(kv_one_size(mine, handle, geo, n, reps))
            log(f"kv {n} tokens: " + ", ".join(f"{k} {v:.2f}" for k, v in
                                                results[-1].gbps.items()))
    finally:
        torch.set_num_threads(threads)
        mine.close()
        if child.stdin is not None:
            child.stdin.write("done\n")
            child.stdin.flush()
        child.wait(30)
        unlink_segment(name)
    return results


def report_kv(results: list[KVResult], reps: int, others: float) -> None:
    print("## 2. KV hand-off (shm transport, producer pool in another process, 1 thread)\n")
    print(f"bench model KV (8 layers x K/V x 8 heads x 64, fp32: 32 KiB per token), one extent. "
          f"{reps} reps per copy, interleaved round robin; each cell: GB/s of the median rep "
          "(% of memcpy's median) / of the fastest rep (% of memcpy's fastest). GB/s = bytes of "
          f"the extent / time. Other processes used {others:.2f} of the 2 cores just before.\n")
    names = list(results[0].gbps)
    cols = " | ".join(f"{r.num_tokens} tokens ({r.num_bytes / 2**20:.0f} MiB)" for r in results)
    print(f"| copy | {cols} |")
    print("|---" * (len(results) + 1) + "|")
    for k in names:
        cells = [f"{r.gbps[k]:.1f} ({r.gbps[k] / r.gbps[MEMCPY]:.0%}) / {r.best_gbps[k]:.1f} "
                 f"({r.best_gbps[k] / r.best_gbps[MEMCPY]:.0%})" for r in results]
        print(f"| {k} | {' | '.join(cells)} |")
    cells = [f"{r.cold_gbps:.1f} ({r.cold_gbps / r.gbps[MEMCPY]:.0%})" for r in results]
    print(f"| copy_blocks, first copy out of a fresh mapping (cold; median of 5) "
          f"| {' | '.join(cells)} |")
    cells = [f"{r.populated_first_gbps:.1f} ({r.populated_first_gbps / r.gbps[MEMCPY]:.0%})"
             for r in results]
    print(f"| first copy out of a mapping made with MAP_POPULATE (median of 3) "
          f"| {' | '.join(cells)} |")
    print()
    print(f"mmap with MAP_POPULATE of the whole {results[0].pool_mib:.0f} MiB peer pool took "
          "(median of 3) "
          + ", ".join(f"{r.populate_ms:.0f} ms" for r in results) + ".")
    med = min(r.gbps[TRANSPORT] / r.gbps[MEMCPY] for r in results)
    best = min(r.best_gbps[TRANSPORT] / r.best_gbps[MEMCPY] for r in results)
    verdict = "met" if max(med, best) >= 0.5 else "MISSED"
    print(f"Target ≥ 50% of memcpy (warm mapping): {verdict} (worst size: {med:.0%} of memcpy "
          f"by medians, {best:.0%} by fastest reps).")
    for r in results:
        fastest = max(names[2:], key=lambda k: r.gbps[k])
        print(f"Fastest hand-off copy at {r.num_tokens} tokens (by median; differences under "
              f"~20% are noise on a shared machine): {fastest}.")
    print()


# ---------------------------------------------------------------------------- 3. interference

@dataclass
class Load:
    """One workload, identical for every mode."""

    num_decodes: int
    decode_prompt_len: int
    prompt_len: int
    prompt_max_tokens: int
    quiet_s: float
    window_s: float
    arrivals: list[float]  # offsets into the loaded window
    decode_prompts: list[list[int]]
    prompts: list[list[int]]
    warmup_prompts: list[list[int]]


def make_load(args: argparse.Namespace, vocab: int) -> Load:
    rng = random.Random(1234)
    arrivals, t = [], 0.25
    while t < args.window_s:
        arrivals.append(t)
        t += rng.uniform(args.gap_min_s, args.gap_max_s)

    def prompt(n: int) -> list[int]:
        return [rng.randrange(10, vocab) for _ in range(n)]

    return Load(args.decodes, args.decode_prompt_len, args.prompt_len, args.prompt_max_tokens,
                args.quiet_s, args.window_s, arrivals,
                [prompt(args.decode_prompt_len) for _ in range(args.decodes)],
                [prompt(args.prompt_len) for _ in arrivals],
                [prompt(args.prompt_len) for _ in range(2)])


@dataclass
class Gaps:
    """ITL gaps (s) of the decode streams, and TTFTs (s) of the arriving prompts, on one clock."""

    quiet: list[float]
    loaded: list[float]
    ttfts: list[float]


@dataclass
class ModeResult:
    mode: str
    wall: Gaps
    cpu: Gaps  # on the producing worker's CPU clock
    quiet_tokens: int
    load_tokens: int
    num_arrivals: int
    num_early_finish: int
    num_open_stalls: int  # decode streams still stalled when the tail wait ran out
    start_s: float
    cpu_quiet: CpuWindow
    cpu_load: CpuWindow
    worker_shares: dict[str, tuple[float, float, float, float]]  # run/wait quiet, run/wait load
    raw: dict[str, object] = field(default_factory=dict)  # for --dump


def window_gaps(times: list[float], t0: float, t1: float, end: float | None = None,
                clock: Callable[[float], float] = float, finished: bool = False) -> list[float]:
    """Gaps between consecutive arrivals ``times`` (wall clock), measured on ``clock``: those
    inside [t0, t1] (``end`` None), or those overlapping (t0, t1) (``end`` given: a stall that
    starts in the window and ends after it counts whole; one still open at ``end`` counts as
    ``end - start``, a lower bound). A ``finished`` stream has no gap after its last token:
    it ended, it did not stall."""
    if end is None:
        inside = [t for t in times if t0 <= t <= t1]
        return [clock(b) - clock(a) for a, b in zip(inside, inside[1:], strict=False)]
    gaps = [clock(b) - clock(a) for a, b in zip(times, times[1:], strict=False)
            if b > t0 and a < t1]
    if times and times[-1] < t1 and not finished:
        gaps.append(clock(end) - clock(times[-1]))
    return gaps


def tokens_in(times: list[list[float]], counts: list[list[int]], t0: float, t1: float) -> int:
    return sum(c for ts, cs in zip(times, counts, strict=True)
               for t, c in zip(ts, cs, strict=True) if t0 <= t < t1)


async def run_mode(mode: str, model: Path, load: Load, args: argparse.Namespace) -> ModeResult:
    from tetri_server.config import load_config
    from tetri_server.control.cluster import Cluster

    max_len = 2048
    decode_max = max_len - load.decode_prompt_len - 8
    blocks = load.num_decodes * (max_len // 16 + 1) + 12 * (-(-(load.prompt_len
                                                               + load.prompt_max_tokens) // 16))
    overrides = [
        f"cluster.mode={mode}", f"model.path={model}", "predictor.kind=none",
        "decode.policy=greedy", "prefill.chunk_size=256", "prefill.token_budget=256",
        f"kv.num_blocks={blocks}", "cluster.prefill_workers=1", "cluster.decode_workers=1",
        "cluster.workers=2", "server.request_timeout_s=300", "server.log_level=warning",
        "cluster.worker_start_timeout_s=300", "server.drain_timeout_s=5",
        "cluster.restart_workers=false",
        # the paper's split: no prefill worker keeps a stream (the per-worker CPU clocks time
        # every stream on the decode worker), no decode worker prefills a prompt
        "cluster.elastic=off", *args.set,
    ]
    cfg = load_config(None, overrides).resolve(cpu_count=len(os.sched_getaffinity(0)))
    cluster = Cluster(cfg)
    t0 = time.perf_counter()
    await cluster.start()
    start_s = time.perf_counter() - t0
    log(f"{mode}: cluster ready in {start_s:.1f} s "
        f"({', '.join(f'w{w}={h.role}' for w, h in cluster.workers.items())})")
    names = {w: f"w{w} {h.role}" for w, h in cluster.workers.items()}
    pids = {names[w]: h.proc.pid for w, h in cluster.workers.items()}
    pids["control"] = os.getpid()
    clock = CpuClock({w: h.proc.pid for w, h in cluster.workers.items()}, args.sample_s)
    decoders = [w for w, h in cluster.workers.items() if h.role == "decode"]
    tasks: list[asyncio.Task[None]] = []
    try:
        warm = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)

        async def drain(prompt: list[int], params: SamplingParams) -> None:
            async for _ in cluster.submit(prompt, params):
                pass

        # warm-up: a long prompt through every worker (first-use allocations, mapped pages)
        await asyncio.wait_for(asyncio.gather(*(drain(p, warm) for p in load.warmup_prompts)),
                               120)
        times: list[list[float]] = [[] for _ in range(load.num_decodes)]  # one per delta
        counts: list[list[int]] = [[] for _ in range(load.num_decodes)]  # tokens per delta
        finished = [False] * load.num_decodes
        first = asyncio.Event()

        async def consume(i: int, stream: Stream) -> None:
            async for d in stream:
                times[i].append(time.perf_counter())
                counts[i].append(len(d.token_ids))
                if all(times):
                    first.set()
                if d.finish_reason is not None:
                    finished[i] = True

        params = SamplingParams(max_tokens=decode_max, temperature=0.0, ignore_eos=True)
        owners = []  # the worker that produces each decode stream's tokens
        for i, p in enumerate(load.decode_prompts):
            stream = cluster.submit(p, params)
            owners.append(decoders[0] if decoders else cluster.requests[stream.req_id].owner)
            tasks.append(asyncio.create_task(consume(i, stream)))
        await asyncio.wait_for(first.wait(), 120)
        await asyncio.sleep(args.settle_s)
        sampler = asyncio.create_task(clock.loop())
        tasks.append(sampler)
        await asyncio.sleep(2 * args.sample_s)
        cpu_quiet = CpuWindow(pids)
        q0 = time.perf_counter()
        cpu_quiet.start()
        await asyncio.sleep(load.quiet_s)
        cpu_quiet.stop()
        w0 = time.perf_counter()
        cpu_load = CpuWindow(pids)
        cpu_load.start()
        sent: dict[int, tuple[float, int]] = {}  # arrival -> (submit time, prefilling worker)
        ttft: dict[int, float] = {}
        prompt_params = SamplingParams(max_tokens=load.prompt_max_tokens, temperature=0.0,
                                       ignore_eos=True)

        async def arrive(k: int, prompt: list[int]) -> None:
            stream = cluster.submit(prompt, prompt_params)
            sent[k] = (time.perf_counter(), cluster.requests[stream.req_id].owner)
            async for _ in stream:
                ttft.setdefault(k, time.perf_counter() - sent[k][0])

        arrival_tasks = []
        for k, (offset, prompt) in enumerate(zip(load.arrivals, load.prompts, strict=True)):
            await asyncio.sleep(max(0.0, w0 + offset - time.perf_counter()))
            arrival_tasks.append(asyncio.create_task(arrive(k, prompt)))
        await asyncio.sleep(max(0.0, w0 + load.window_s - time.perf_counter()))
        w1 = time.perf_counter()
        cpu_load.stop()
        # wait (bounded) for the prompts' first tokens and for every decode stream's first token
        # after the window, so that neither a TTFT nor a stall is cut off at the window's end
        deadline = time.perf_counter() + args.tail_wait_s
        while time.perf_counter() < deadline and (
                len(ttft) < len(arrival_tasks)
                or not all(ts[-1] > w1 or done for ts, done in zip(times, finished,
                                                                   strict=True))):
            await asyncio.sleep(0.05)
        end = time.perf_counter()
        clock.sample()
        sampler.cancel()
        for t in arrival_tasks:
            t.cancel()
        await asyncio.gather(*arrival_tasks, return_exceptions=True)
        wall = Gaps([g for ts in times for g in window_gaps(ts, q0, w0)],
                    [g for ts, done in zip(times, finished, strict=True)
                     for g in window_gaps(ts, w0, w1, end, finished=done)],
                    sorted(ttft.values()))

        def on(w: int) -> Callable[[float], float]:
            return lambda t: clock.cpu(w, t)

        cpu = Gaps(
            [g for ts, w in zip(times, owners, strict=True)
             for g in window_gaps(ts, q0, w0, clock=on(w))],
            [g for ts, w, done in zip(times, owners, finished, strict=True)
             for g in window_gaps(ts, w0, w1, end, clock=on(w), finished=done)],
            sorted(clock.cpu(sent[k][1], sent[k][0] + v) - clock.cpu(sent[k][1], sent[k][0])
                   for k, v in ttft.items()))
        shares = {names[w]: (*clock.shares(w, q0, w0), *clock.shares(w, w0, w1))
                  for w in cluster.workers}
        raw = {"quiet_start": q0, "window": [w0, w1], "end": end, "delta_times": times,
               "delta_tokens": counts, "owners": owners, "ttft": ttft, "sent": sent,
               "arrivals": [w0 + a for a in load.arrivals], "clock_t": clock.t,
               "clock_run": clock.run, "clock_wait": clock.wait}
        return ModeResult(
            mode, wall, cpu, tokens_in(times, counts, q0, w0), tokens_in(times, counts, w0, w1),
            len(load.arrivals), sum(finished),
            sum(ts[-1] < w1 and not done for ts, done in zip(times, finished, strict=True)),
            start_s,
            cpu_quiet, cpu_load, shares, raw)
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        clock.close()
        for req_id in list(cluster.requests):
            cluster.abort(req_id)
        await cluster.stop(drain_timeout_s=0)


def ms(x: float) -> str:
    return f"{x * 1e3:.0f}"


def log_mode(r: ModeResult) -> None:
    log(f"{r.mode}: wall ITL p50 quiet {ms(pct(r.wall.quiet, 0.5))} ms, loaded "
        f"{ms(pct(r.wall.loaded, 0.5))} ms, p99 {ms(pct(r.wall.loaded, 0.99))} ms, "
        f"TTFT p50 {ms(pct(r.wall.ttfts, 0.5))} ms; cpu-clock ITL p50 "
        f"{ms(pct(r.cpu.quiet, 0.5))} → {ms(pct(r.cpu.loaded, 0.5))} ms, p99 "
        f"{ms(pct(r.cpu.loaded, 0.99))} ms")


def itl_table(results: list[ModeResult], pick: Callable[[ModeResult], Gaps], load: Load,
              tokens: bool) -> None:
    base = pick(next((r for r in results if r.mode == "disaggregated"), results[0]))
    base_p99 = pct(base.loaded, 0.99)
    head = ("| mode | ITL p50 quiet | ITL p50 loaded | mean | p90 | p99 | max | loaded/quiet p50 "
            "| p99 vs disaggregated | TTFT p50 | TTFT p99 |")
    if tokens:
        head += " prompts with 1st token | decode tok/s quiet | loaded |"
    print(head)
    print("|---" * (head.count("|") - 1) + "|")
    for r in results:
        g = pick(r)
        qp50, lp50, lp99 = pct(g.quiet, 0.5), pct(g.loaded, 0.5), pct(g.loaded, 0.99)
        mean = statistics.fmean(g.loaded) if g.loaded else float("nan")
        row = (f"| {r.mode} | {ms(qp50)} | {ms(lp50)} | {ms(mean)} | {ms(pct(g.loaded, 0.9))} "
               f"| {ms(lp99)} | {ms(max(g.loaded, default=float('nan')))} "
               f"| ×{lp50 / qp50:.2f} | ×{lp99 / base_p99:.1f} "
               f"| {ms(pct(g.ttfts, 0.5))} | {ms(pct(g.ttfts, 0.99))} |")
        if tokens:
            row += (f" {len(g.ttfts)}/{r.num_arrivals} | {r.quiet_tokens / load.quiet_s:.0f} "
                    f"| {r.load_tokens / load.window_s:.0f} |")
        print(row)
    print()


def report_interference(results: list[ModeResult], load: Load) -> None:
    print("## 3. Interference: ITL of running decodes while long prompts arrive\n")
    gaps = [b - a for a, b in zip(load.arrivals, load.arrivals[1:], strict=False)]
    print(f"Bench model (llama 512 x 8 layers, fp32), 2 workers x 1 core, chunk/budget 256. "
          f"{load.num_decodes} decode requests ({load.decode_prompt_len}-token prompts, "
          f"ignore_eos) run throughout; quiet window {load.quiet_s:.0f} s, then a loaded window "
          f"of {load.window_s:.0f} s with {len(load.arrivals)} prompts of {load.prompt_len} "
          f"tokens (max_tokens {load.prompt_max_tokens}), gaps "
          f"{min(gaps, default=0):.1f}-{max(gaps, default=0):.1f} s. ITL = gaps between "
          "TokenDelta arrivals in the control process, 8 decode streams only; loaded = every "
          "gap overlapping the loaded window (a stall that starts in it counts whole). TTFT: "
          "submit to first token of the arriving prompts. All times in ms.\n")
    print("### Wall clock (as measured)\n")
    itl_table(results, lambda r: r.wall, load, tokens=True)
    print("### On the producing worker's own CPU clock (estimate for a dedicated core)\n")
    print("Each token time is mapped to the CPU time its worker's thread had used by then "
          "(/proc/<pid>/schedstat sampled every few ms), so time the worker spent waiting for "
          "a core taken by other processes drops out; TTFT on the clock of the worker that "
          "prefilled the prompt. Queues that grew because the worker was starved stay in.\n")
    itl_table(results, lambda r: r.cpu, load, tokens=False)
    print("CPU of each worker's thread (on-CPU share / share of the time it waited for a core "
          "while runnable), of the control process, and of all other processes (cores), "
          "quiet → loaded window; and the cluster start-up time:\n")
    print("| mode | workers: on-CPU / waiting, quiet → loaded | control | other processes "
          "| start-up |")
    print("|---|---|---|---|---|")
    for r in results:
        cells = ", ".join(f"{k} {a:.2f}/{b:.2f} → {c:.2f}/{d:.2f}"
                          for k, (a, b, c, d) in r.worker_shares.items())
        print(f"| {r.mode} | {cells} | {r.cpu_quiet.shares['control']:.2f} → "
              f"{r.cpu_load.shares['control']:.2f} | {r.cpu_quiet.others_cores:.2f} → "
              f"{r.cpu_load.others_cores:.2f} | {r.start_s:.1f} s |")
    early = [f"{r.mode}: {r.num_early_finish}" for r in results if r.num_early_finish]
    if early:
        print(f"\nDecode streams that reached max_tokens before the end: {', '.join(early)}.")
    stalled = [f"{r.mode}: {r.num_open_stalls}" for r in results if r.num_open_stalls]
    if stalled:
        print("\nDecode streams still stalled when the tail wait ran out (their last gap is a "
              f"lower bound): {', '.join(stalled)}.")
    print()


# ---------------------------------------------------------------------------- main


def model_path(models_dir: Path) -> Path:
    path = models_dir / "llama-bench"
    if not (path / "config.json").is_file() or not (path / "model.safetensors").is_file():
        from tetri_server.modelmaker import make_model

        log(f"making the llama bench model in {path}")
        make_model(path, "llama", "bench")
    return path


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="about 1.5 minutes")
    ap.add_argument("--sections", default="channel,kv,interference")
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--models-dir", type=Path, default=ROOT / "models")
    ap.add_argument("--channel-runs", type=int, default=None)
    ap.add_argument("--kv-reps", type=int, default=None)
    ap.add_argument("--kv-tokens", default="512,2048")
    ap.add_argument("--decodes", type=int, default=8)
    ap.add_argument("--decode-prompt-len", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, default=1024)
    ap.add_argument("--prompt-max-tokens", type=int, default=16)
    ap.add_argument("--quiet-s", type=float, default=None)
    ap.add_argument("--window-s", type=float, default=None)
    ap.add_argument("--gap-min-s", type=float, default=1.0)
    ap.add_argument("--gap-max-s", type=float, default=2.0)
    ap.add_argument("--settle-s", type=float, default=1.0)
    ap.add_argument("--tail-wait-s", type=float, default=20.0,
                    help="after the window: bound on waiting for first tokens (TTFT, stalls)")
    ap.add_argument("--sample-s", type=float, default=0.004,
                    help="period of the workers' CPU-clock sampling")
    ap.add_argument("--dump", type=Path, default=None,
                    help="write the raw TokenDelta arrival times of each mode here (JSON)")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="extra config override for the clusters")
    args = ap.parse_args(argv)
    quick = args.quick
    args.channel_runs = args.channel_runs or (1 if quick else 2)
    args.kv_reps = args.kv_reps or (11 if quick else 21)
    args.quiet_s = args.quiet_s or (2.0 if quick else 5.0)
    args.window_s = args.window_s or (6.0 if quick else 20.0)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    sections = set(args.sections.split(","))
    t_start = time.perf_counter()
    cmd = " ".join(["tools/bench_runtime.py", *(argv if argv is not None else sys.argv[1:])])
    print(f"# Runtime benchmark — {datetime.datetime.now().isoformat(timespec='minutes')}\n")
    print(f"`.venv/bin/python {cmd}` on {platform.node()}: {os.cpu_count()} cores "
          f"({platform.processor() or platform.machine()}), torch {torch.__version__}, "
          f"load average at start {loadavg()}.\n")
    model = model_path(args.models_dir)
    if "channel" in sections:
        report_channel(bench_channel(2000 if args.quick else 5000,
                                     20_000 if args.quick else 100_000, args.channel_runs))
    if "kv" in sections:
        others = others_cores(1.0)
        report_kv(bench_kv(model, [int(x) for x in args.kv_tokens.split(",")], args.kv_reps),
                  args.kv_reps, others)
    if "interference" in sections:
        vocab = json.loads((model / "config.json").read_text())["vocab_size"]
        load = make_load(args, vocab)
        try:
            import uvloop

            runner: Callable[..., ModeResult] = uvloop.run
        except ImportError:
            runner = asyncio.run
        results = []
        for mode in args.modes.split(","):
            log(f"interference: {mode}")
            results.append(runner(run_mode(mode, model, load, args)))
            log_mode(results[-1])
        report_interference(results, load)
        if args.dump is not None:
            args.dump.write_text(json.dumps({r.mode: r.raw for r in results}))
    print(f"Total {time.perf_counter() - t_start:.0f} s; load average at end {loadavg()}.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
