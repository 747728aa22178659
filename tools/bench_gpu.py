"""GPU engine benchmark: the decode step with CUDA graphs on and off against the step's
bandwidth bound (weights + KV bytes / the device's measured read-only stream rate: a step only
reads them), and prefill steps against the matmul peak.

    python tools/bench_gpu.py [--hidden 2048 --layers 16 --dtype bfloat16] [--batch 64]
        [--ctx 512] [--steps 30] [--profile 5] [--prefill 512,2048,1024x4] [--device cuda]
        [--per-head-attention] [--out DIR]

Makes a random-weight Llama of the given shape (hidden 2048 x 16 layers ~ 1B parameters) with
``tetri_server.modelmaker`` and loads it in the engine (coupled, one process).
- Decode: fills ``--batch`` sequences with ``--ctx`` tokens of KV and times ``--steps`` decode
  steps (median, CUDA events) eagerly and on the captured graphs, interleaved, each with the
  small layer ops and the KV write as one Triton kernel each (``ops/triton_layer.py``, what
  serving runs) and as eager PyTorch (``kernels.eager_layer_ops``: several kernels each), an
  A/B in one run.
- ``--profile N``: then profiles N more steps of each kind (torch.profiler) and prints the
  operators that took the most device time (CPU time on cpu): where the step's time above its
  bound goes.
- ``--prefill``: one prefill step per prompt set (``1024x4``: four 1024-token prompts packed in
  one step; median of 10) against the matmul peak measured in the same run (an 8192^3 product
  in the model's dtype), with the Triton layer ops and, interleaved, with the eager ones; with
  ``--profile``, the set of the most tokens is profiled too; empty: none.
- The attention kernel's two layouts: where Triton is installed, the decode rows also hold
  graphs with one program per query head (``triton_attention.PACK_GROUPS`` off; the default
  is one per KV head's group of query heads), interleaved with the rest.
  ``--per-head-attention`` runs every row per query head instead.
Prints markdown tables and the graphs' capture time. ``--device cpu`` runs the same code on
the CPU with no graphs (a smoke test of the tool, not a measurement:
tests/unit/test_cuda_graphs.py runs it so).
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
from tetri_server.engine.kernels import eager_layer_ops
from tetri_server.engine.ops import triton_missing
from tetri_server.modelmaker import make_model

PER_HEAD = "graphs, attention per query head"


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


def read_bandwidth_gbs(device: torch.device, nbytes: int = 1 << 30) -> float:
    """A read-only stream of ``nbytes`` (a sum): bytes read per second, best of 5. A decode
    step only reads weights and KV, so its bound divides by this rate, not by half a copy's
    (HBM reads alone run near a copy's read + write rate: half of it made the bound ~2x long)."""
    if device.type != "cuda":
        return 0.0
    a = torch.ones(nbytes // 4, dtype=torch.float32, device=device)
    best = float("inf")
    for _ in range(5):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        a.sum()
        end.record()
        torch.cuda.synchronize(device)
        best = min(best, start.elapsed_time(end) / 1e3)
    return nbytes / best / 1e9


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


def matmul_peak_tflops(device: torch.device, dtype: torch.dtype, n: int = 8192) -> float:
    """The best of 10 ``n x n x n`` products in ``dtype`` after 3 warm-ups (cuda only)."""
    if device.type != "cuda":
        return 0.0
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    step_times(lambda: a @ b, 3, device)
    return 2 * n**3 / min(step_times(lambda: a @ b, 10, device)) / 1e12


def prompt_sets(spec: str) -> list[list[int]]:
    """``"512,1024x4"`` -> [[512], [1024, 1024, 1024, 1024]]."""
    out = []
    for item in filter(None, spec.split(",")):
        n, _, k = item.partition("x")
        out.append([int(n)] * int(k or 1))
    return out


def profile_table(run, steps: int, device: torch.device, rows: int = 12) -> str:  # noqa: ANN001
    """The operators of ``steps`` calls of ``run`` that took the most self time on the device
    (kernels inside graph replays too), as torch.profiler's table."""
    from torch.profiler import ProfilerActivity, profile

    cuda = device.type == "cuda"
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=acts) as prof:
        for _ in range(steps):
            run()
        if cuda:
            torch.cuda.synchronize(device)
    key = "self_device_time_total" if cuda else "self_cpu_time_total"
    return prof.key_averages().table(sort_by=key, row_limit=rows, max_name_column_width=60)


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
    ap.add_argument("--profile", type=int, default=0,
                    help="then profile this many steps of each kind (0: none)")
    ap.add_argument("--prefill", default="512,2048,1024x4",
                    help="prompt sets to time one prefill step of (N or NxK), comma-separated")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--per-head-attention", action="store_true",
                    help="the Triton kernel's programs per query head, not per KV head group")
    ap.add_argument("--out", default=None, help="model folder (default: a temporary one)")
    args = ap.parse_args(argv)
    if args.steps < 1:
        ap.error("--steps must be at least 1")
    device = torch.device(args.device)
    if args.per_head_attention:
        from tetri_server.engine.ops import triton_attention  # needs Triton

        triton_attention.PACK_GROUPS = False
    folder = Path(args.out or tempfile.mkdtemp(prefix="tetri-gpu-model-"))
    # decode steps past the context: up to five variants below, each a warm-up and args.steps
    extra_steps = 5 * args.steps + 2 * args.profile + 12
    prefills = prompt_sets(args.prefill)
    longest = max((n for lens in prefills for n in lens), default=0)
    t0 = time.perf_counter()
    make_model(folder, "llama", "bench", seed=0, hidden_size=args.hidden,
               num_hidden_layers=args.layers, num_attention_heads=args.heads,
               num_key_value_heads=args.kv_heads, intermediate_size=args.intermediate,
               max_position_embeddings=max(4096, args.ctx + extra_steps, longest + 8))
    made_s = time.perf_counter() - t0
    extra = ["model.cuda_graphs=false"]  # the graphs below are made here, on the same pool
    if device.type == "cuda":
        extra.append("cluster.device=cuda")
    drv = EngineDriver(Timer("wall"), folder, args.batch, args.ctx, extra_steps,
                       dtype=args.dtype, sets=extra)
    eng = drv.eng
    made = decode_graphs(eng.model, eng.kv, eng.allocator, eng.kv_manager.block_size,
                         args.batch, eng.device, capture=device.type == "cuda")
    if made is None:
        raise SystemExit("CUDA graphs cannot run here (see the warning above)")
    graphs: DecodeGraphs = made

    def capture_again() -> DecodeGraphs:
        """The same buckets captured again, on the model's kernels as they are now."""
        again = DecodeGraphs(eng.model, eng.kv, graphs.scratch_slot, args.batch, eng.device,
                             capture=device.type == "cuda")
        again.capture()
        return again

    fused = eng.model.kernels
    unfused = eager_layer_ops(fused)
    eng.model.kernels = unfused
    graphs_unfused = capture_again()
    eng.model.kernels = fused
    # (name, graphs, kernels): the rows of the decode table
    variants = [("eager", None, fused), ("graphs", graphs, fused),
                ("eager, eager layer ops", None, unfused),
                ("graphs, eager layer ops", graphs_unfused, unfused)]
    if not args.per_head_attention and not triton_missing():
        # the attention kernel's other layout, interleaved with the rest: graphs captured
        # with triton_attention.PACK_GROUPS off, which the eager rows leave on
        from tetri_server.engine.ops import triton_attention

        triton_attention.PACK_GROUPS = False
        variants.append((PER_HEAD, capture_again(), fused))
        triton_attention.PACK_GROUPS = True
    params = sum(p.numel() for p in eng.model.parameters())
    weight_bytes = sum(p.numel() * p.element_size() for p in eng.model.parameters())
    bw = copy_bandwidth_gbs(eng.device)
    read_bw = read_bandwidth_gbs(eng.device)
    times: dict[str, list[float]] = {name: [] for name, _, _ in variants}
    with drv.decoding(args.batch, args.ctx, extra_steps - 4) as run:
        for _, g, kern in variants:  # warm-up
            eng.runner.graphs, eng.model.kernels = g, kern
            run()
        for _ in range(2):  # interleaved
            for name, g, kern in variants:
                eng.runner.graphs, eng.model.kernels = g, kern
                times[name] += step_times(run, max(1, args.steps // 2), eng.device)
        tables: dict[str, str] = {}
        for name, g, kern in variants[:2] if args.profile else ():
            eng.runner.graphs, eng.model.kernels = g, kern
            tables[name] = profile_table(run, args.profile, eng.device)
        eng.runner.graphs, eng.model.kernels = None, fused
    # prefill: each set with the Triton layer ops and the eager ones, interleaved; a profile
    # of the set with the most tokens
    prefill_s: list[tuple[float, float]] = []
    most = max(prefills, key=sum, default=None)
    for lens in prefills:
        with drv.prefill(lens) as run:
            spent: dict[str, list[float]] = {"fused": [], "eager": []}
            for _ in range(2):
                for key, kern in (("fused", fused), ("eager", unfused)):
                    eng.model.kernels = kern
                    run()  # warm-up (again: the other kernels ran last)
                    spent[key] += step_times(run, 5, eng.device)
            eng.model.kernels = fused
            prefill_s.append((statistics.median(spent["fused"]),
                              statistics.median(spent["eager"])))
            if args.profile and lens is most:
                tables[f"prefill ({len(lens)} x {lens[0]})"] = profile_table(
                    run, args.profile, eng.device)
    peak = matmul_peak_tflops(eng.device, eng.kv.dtype) if prefills else 0.0
    med = {k: statistics.median(v) for k, v in times.items()}
    # the context grows by one a step: the bound at the timed steps' mean context
    mean_ctx = args.ctx + len(variants) + sum(map(len, times.values())) // 2
    kv_bytes = drv.shape.kv_bytes(args.batch, mean_ctx)
    bound = (weight_bytes + kv_bytes) / (read_bw * 1e9) if read_bw else float("nan")
    name = torch.cuda.get_device_name(eng.device) if eng.device.type == "cuda" else "cpu"
    print(f"`tools/bench_gpu.py` on {name}, torch {torch.__version__}: Llama hidden "
          f"{args.hidden} x {args.layers} layers ({params / 1e9:.2f} B parameters, "
          f"{args.dtype}), decode batch {args.batch}, context {args.ctx} (the timed steps' "
          f"mean {mean_ctx}); attention "
          f"programs per {'query head' if args.per_head_attention else 'KV head group'}; "
          f"model made in "
          f"{made_s:.0f} s; {len(graphs.sizes)} graphs captured in {graphs.capture_s:.1f} s; "
          f"device copy {bw:.0f} GB/s (read + write), read-only stream {read_bw:.0f} GB/s "
          f"(the bound's rate)")
    print()
    print("| decode step | median ms | weight + KV GB | bandwidth bound ms | step / bound |")
    print("|---|---:|---:|---:|---:|")
    for name, _, _ in variants:
        print(f"| {name} | {1e3 * med[name]:.2f} | {(weight_bytes + kv_bytes) / 1e9:.2f} "
              f"| {1e3 * bound:.2f} | {med[name] / bound:.2f}x |")
    print()
    print(f"graphs / eager: {med['graphs'] / med['eager']:.2f}x; layer ops fused / eager: "
          f"{med['graphs'] / med['graphs, eager layer ops']:.2f}x with graphs, "
          f"{med['eager'] / med['eager, eager layer ops']:.2f}x without"
          + (f"; attention per query head / grouped, with graphs: "
             f"{med[PER_HEAD] / med['graphs']:.2f}x" if PER_HEAD in med else ""))
    if prefills:
        print()
        print(f"Prefill, one step; matmul peak {peak:.0f} TFLOP/s ({args.dtype}, 8192^3, "
              "this run):")
        print()
        print("| prompts | tokens | median ms | TFLOP/s | % of the matmul peak "
              "| eager layer ops: ms | fused / eager |")
        print("|---|---:|---:|---:|---:|---:|---:|")
        for lens, (t, t_eager) in zip(prefills, prefill_s, strict=True):
            tflops = drv.shape.prefill_flops(lens) / t / 1e12
            share = f"{100 * tflops / peak:.0f}%" if peak else "n/a"
            print(f"| {len(lens)} x {lens[0]} | {sum(lens)} | {1e3 * t:.2f} | {tflops:.1f} "
                  f"| {share} | {1e3 * t_eager:.2f} | {t / t_eager:.2f}x |")
    for k, table in tables.items():
        print(f"\nProfile of {args.profile} {k} steps (self time, most first):\n\n```\n"
              f"{table}\n```")
    return 0


if __name__ == "__main__":
    sys.exit(main())
