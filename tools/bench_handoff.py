"""KV hand-off bandwidth: a prompt's KV blocks pulled out of a pool that ANOTHER process owns,
through the transport a cluster uses (``cuda_ipc`` on a GPU, ``shm`` on CPU), against a plain
copy of the same number of bytes inside this process on the same device (the memcpy baseline).

    python tools/bench_handoff.py [--transport cuda_ipc --device cuda:0] [--shapes bench,1b]
        [--tokens 512,2048,8192] [--reps 20]

Shapes: ``bench`` is the bench Llama's KV (8 layers, 8 KV heads x 64, fp32: 32 KiB per token),
``1b`` the ~1B Llama of tools/bench_gpu.py (16 layers, 8 KV heads x 128, bf16: 64 KiB per
token). Two block layouts: ``contiguous`` (one run of blocks on both sides: one strided copy)
and ``scattered`` (every other block on both sides: one copy per block, the worst case of a
fragmented pool). Each copy is timed whole (``copy_blocks`` synchronizes the device before it
returns, as the decode worker's ack needs); the median of ``--reps`` is printed with GB/s of
payload and its ratio to the baseline's. ``--transport shm --device cpu`` runs the same code on
CPU (tests/unit/test_bench_handoff.py runs it so, as a smoke test of the tool).
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable

import msgspec
import torch

from tetri_server.kv.transport import PoolGeometry, make_transport
from tetri_server.messages import PoolHandle

SHAPES = {"bench": (8, 8, 64, torch.float32), "1b": (16, 8, 128, torch.bfloat16)}
BLOCK = 16

PRODUCER = textwrap.dedent("""
    import sys, msgspec, torch
    from tetri_server.kv.transport import PoolGeometry, make_transport
    kind, device, name, layers, blocks, heads, dim, dtype = sys.argv[1:9]
    g = PoolGeometry(int(layers), int(blocks), 16, int(heads), int(dim), getattr(torch, dtype))
    t = make_transport(kind, 1, g, torch.device(device), name)
    t.kv.copy_(torch.randn(g.shape, dtype=torch.float32).to(g.dtype))
    if t.kv.is_cuda:
        torch.cuda.synchronize()
    print(msgspec.json.encode(t.export()).decode(), flush=True)
    sys.stdin.readline()  # own the pool until the consumer is done
    t.close()
""")


def median_s(fn: Callable[[], None], reps: int, device: torch.device) -> float:
    fn()  # warm-up (first touch of the peer's pages / mapping)
    out = []
    for _ in range(reps):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        out.append(time.perf_counter() - t0)
    return statistics.median(out)


def bench_shape(name: str, kind: str, device: torch.device, tokens: list[int],
                reps: int) -> list[tuple[str, int, str, float, float, float]]:
    layers, heads, dim, dtype = SHAPES[name]
    num_blocks = 2 * (-(-max(tokens) // BLOCK)) + 2  # scattered needs every other block
    g = PoolGeometry(layers, num_blocks, BLOCK, heads, dim, dtype)
    seg = f"tetri-handoff-{name}-{time.monotonic_ns()}"
    child = subprocess.Popen(
        [sys.executable, "-c", PRODUCER, kind, str(device), seg, str(layers), str(num_blocks),
         str(heads), str(dim), str(dtype).removeprefix("torch.")],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    rows = []
    try:
        handle = msgspec.json.decode(child.stdout.readline(), type=PoolHandle)
        mine = make_transport(kind, 2, g, device, seg + "-mine")
        mine.open(handle)
        per_token = g.num_bytes // (num_blocks * BLOCK)
        for n in tokens:
            nb = -(-n // BLOCK)
            payload = n * per_token
            a = torch.empty(payload, dtype=torch.uint8, device=device)
            b = torch.empty_like(a)
            base = median_s(lambda a=a, b=b: b.copy_(a), reps, device)
            for layout, ids in (("contiguous", list(range(nb))),
                                ("scattered", list(range(0, 2 * nb, 2)))):
                t = median_s(lambda ids=ids, n=n: mine.copy_blocks(1, ids, ids, n), reps,
                             device)
                rows.append((layout, n, f"{payload / 2**20:.0f}", t, payload / t / 1e9,
                             payload / base / 1e9))
        mine.close()
    finally:
        child.stdin.write("done\n")
        child.stdin.flush()
        child.wait(60)
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--transport", default="cuda_ipc", choices=("cuda_ipc", "shm"))
    ap.add_argument("--device", default="cuda:0")
    ap.add_argument("--shapes", default="bench,1b")
    ap.add_argument("--tokens", default="512,2048,8192")
    ap.add_argument("--reps", type=int, default=20)
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    tokens = [int(t) for t in args.tokens.split(",")]
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(f"`tools/bench_handoff.py --transport {args.transport}` on {where}, torch "
          f"{torch.__version__}: median of {args.reps} copies; baseline = an in-process copy of "
          "the same bytes on the same device")
    print()
    print("| KV shape | layout | tokens | MiB | hand-off ms | hand-off GB/s | memcpy GB/s "
          "| hand-off / memcpy |")
    print("|---|---|---:|---:|---:|---:|---:|---:|")
    for name in args.shapes.split(","):
        for layout, n, mib, t, gbs, base_gbs in bench_shape(name, args.transport, device,
                                                           tokens, args.reps):
            print(f"| {name} | {layout} | {n} | {mib} | {1e3 * t:.3f} | {gbs:.1f} "
                  f"| {base_gbs:.1f} | {gbs / base_gbs:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
