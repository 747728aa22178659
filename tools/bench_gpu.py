"""GPU decode benchmark: the engine's decode step with CUDA graphs on and off, against the
step's bandwidth bound (weights + KV bytes / measured device-to-device copy bandwidth).

    python tools/bench_gpu.py [--hidden 2048 --layers 16 --dtype bfloat16] [--batch 64]
        [--ctx 512] [--steps 30] [--device cuda] [--out DIR]

Makes a random-weight Llama of the given shape (hidden 2048 x 16 layers ~ 1B parameters) with
``tetri_server.modelmaker``, loads it in the engine (coupled, one process), fills ``--batch``
sequences with ``--ctx`` tokens of KV, and times ``--steps`` decode steps (median, CUDA
events) eagerly and on the captured graphs, interleaved. Prints a markdown table and the
capture time. ``--device cpu`` runs the same code on the CPU with no graphs (a smoke test of
the tool, not a measurement: tests/unit/test_cuda_graphs.py runs it so).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from tetri_server.bench.cpu import Timer
from tetri_server.bench.engine_driver import EngineDriver
from tetri_server.engine.cuda_graphs import DecodeGraphs, decode_graphs
from tetri_server.modelmaker import make_model


def copy_bandwidth_gbs(device: torch.device, nbytes: int = 1 << 30) -> float:
    """Device-to-device copy of ``nbytes``: bytes read + written per second, best of 5."""
    if device.type != "cuda":
        return 0.0
    a = torch.empty(nbytes // 4, dtype=torch.float32, device=device)
    b = torch.empty_like(a)
    best = float("inf")
    for _ in range(5):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        b.copy_(a)
        end.record()
        torch.cuda.synchronize(device)
        best = min(best, start.elapsed_time(end) / 1e3)
    return 2 * nbytes / best / 1e9


def step_times(run, steps: int, device: torch.device) -> list[float]:  # noqa: ANN001
    out = []
    for _ in range(steps):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            run()
            end.record()
            torch.cuda.synchronize(device)
            out.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            run()
            out.append(time.perf_counter() - t0)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--intermediate", type=int, default=5632)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--ctx", type=int, default=512)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--out", default=None, help="model folder (default: a temporary one)")
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    folder = Path(args.out or tempfile.mkdtemp(prefix="tetri-gpu-model-"))
    t0 = time.perf_counter()
    make_model(folder, "llama", "bench", seed=0, hidden_size=args.hidden,
               num_hidden_layers=args.layers, num_attention_heads=args.heads,
               num_key_value_heads=args.kv_heads, intermediate_size=args.intermediate,
               max_position_embeddings=max(4096, args.ctx + args.steps + 8))
    made_s = time.perf_counter() - t0
    extra = ["model.cuda_graphs=false"]  # the graphs below are made here, on the same pool
    if device.type == "cuda":
        extra.append("cluster.device=cuda")
    drv = EngineDriver(Timer("wall"), folder, args.batch, args.ctx, 2 * args.steps + 8,
                       dtype=args.dtype, sets=extra)
    eng = drv.eng
    graphs: DecodeGraphs = decode_graphs(eng.model, eng.kv, eng.allocator,
                                         eng.kv_manager.block_size, args.batch, eng.device,
                                         capture=device.type == "cuda")
    params = sum(p.numel() for p in eng.model.parameters())
    weight_bytes = sum(p.numel() * p.element_size() for p in eng.model.parameters())
    kv_bytes = drv.shape.kv_bytes(args.batch, args.ctx)
    bw = copy_bandwidth_gbs(eng.device)
    times: dict[str, list[float]] = {"eager": [], "graphs": []}
    with drv.decoding(args.batch, args.ctx, 2 * args.steps + 4) as run:
        run()  # warm-up, eager
        for _ in range(2):  # interleaved
            eng.runner.graphs = None
            times["eager"] += step_times(run, args.steps // 2, eng.device)
            eng.runner.graphs = graphs
            times["graphs"] += step_times(run, args.steps // 2, eng.device)
        eng.runner.graphs = None
    med = {k: statistics.median(v) for k, v in times.items()}
    bound = (weight_bytes + kv_bytes) / (bw * 1e9 / 2) if bw else float("nan")
    name = torch.cuda.get_device_name(eng.device) if eng.device.type == "cuda" else "cpu"
    print(f"`tools/bench_gpu.py` on {name}, torch {torch.__version__}: Llama hidden "
          f"{args.hidden} x {args.layers} layers ({params / 1e9:.2f} B parameters, "
          f"{args.dtype}), decode batch {args.batch}, context {args.ctx}; model made in "
          f"{made_s:.0f} s; {len(graphs.sizes)} graphs captured in {graphs.capture_s:.1f} s; "
          f"device copy {bw:.0f} GB/s (read + write)")
    print()
    print("| decode step | median ms | weight + KV GB | bandwidth bound ms | step / bound |")
    print("|---|---:|---:|---:|---:|")
    for k in ("eager", "graphs"):
        print(f"| {k} | {1e3 * med[k]:.2f} | {(weight_bytes + kv_bytes) / 1e9:.2f} "
              f"| {1e3 * bound:.2f} | {med[k] / bound:.2f}x |")
    print()
    print(f"graphs / eager: {med['graphs'] / med['eager']:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
