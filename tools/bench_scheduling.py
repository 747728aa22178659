"""Scheduling measurements: the calibrated prefill chunk size with its throughput curve, and the
instance-flip time (decision -> serving in the new role, with and without the drain).

    python tools/bench_scheduling.py [--model builtin:bench] [--threads 1] [--calibrations N]
                                     [--rows N] [--no-flip]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from tetri_server.config import PrefillConfig  # noqa: E402
from tetri_server.llm import make_engine  # noqa: E402
from tetri_server.messages import SamplingParams  # noqa: E402
from tetri_server.modelinfo import resolve_model_path  # noqa: E402
from tetri_server.policy import calibration_rows, pick_chunk_size, throughput_curve  # noqa: E402
from tetri_server.workers.calibrate import (  # noqa: E402
    PICKS,
    ROUNDS,
    SIZES,
    measure,
    served_pick,
)


def calibration(model: str, threads: int, times: int, rows: int) -> None:
    """The calibration as a prefill worker runs it, ``times`` over: the first one's curve and
    every pick (how far the pick moves between calibrations of one build on one machine). With
    ``rows``, each pass holds that many decode rows too (a prefill worker that decodes
    ``prefill.local_decode_batch`` requests itself) and the rates are of the prompt tokens."""
    torch.set_num_threads(threads)
    eng = make_engine(model, "kv.num_blocks=0", "kv.memory_gb=1.0")
    worker = SimpleNamespace(allocator=eng.allocator, block_size=eng.cfg.kv.block_size,
                             kv=eng.kv_manager, runner=eng.runner, model_spec=eng.spec,
                             max_model_len=eng.max_model_len, device=eng.device)
    runs = [measure(worker, SIZES, rows=rows) for _ in range(times)]  # type: ignore[arg-type]
    picks = [pick_chunk_size(samples, riders=rows) for samples in runs]
    samples, knee = runs[0], picks[0]
    curve = throughput_curve(samples, rows)
    best = max(tps for _, tps in curve)
    print(f"\n## Chunk-size calibration ({model}, {threads} thread(s), {rows} decode rows)\n")
    print(f"The first calibration (best of {ROUNDS} interleaved rounds per size):\n")
    print("| tokens per pass | ms | tokens/s | of best |")
    print("|---:|---:|---:|---:|")
    for (n, s), (_, tps) in zip(samples, curve, strict=True):
        print(f"| {n} | {s * 1e3:.1f} | {tps:.0f} | {tps / best:.0%} |")
    print(f"\ncalibrated chunk size: {knee}")
    if times > 1:
        print(f"picks of {times} calibrations: {', '.join(map(str, picks))} "
              f"(max / min {max(picks) / min(picks):.2f})")
        served = [served_pick(picks[i:i + PICKS])
                  for i in range(0, len(picks) - PICKS + 1, PICKS)]
        if served:
            print(f"served after {PICKS} starts (the median of each {PICKS} picks in turn): "
                  f"{', '.join(map(str, served))}")


async def flip_times(model: str) -> None:
    from tetri_server.config import load_config
    from tetri_server.control.cluster import Cluster

    cfg = load_config(None, [
        f"model.path={model}", "cluster.mode=disaggregated", "cluster.prefill_workers=1",
        "cluster.decode_workers=2", "predictor.kind=none", "decode.policy=greedy",
        "prefill.chunk_size=256", "kv.num_blocks=2048", "cluster.threads_per_worker=1"])
    cluster = Cluster(cfg.resolve(cpu_count=len(os.sched_getaffinity(0))))
    await cluster.start()
    try:
        params = SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True)

        async def one() -> None:
            async for _ in cluster.submit(list(range(10, 138)), params):
                pass

        print("\n## Instance flip (worker 2)\n")
        print("| flip | in-flight on the worker | decision -> serving | after drain |")
        print("|---|---:|---:|---:|")
        for role in ("prefill", "decode"):
            idle = await cluster.flip(2, role)
            print(f"| {idle.from_role}->{idle.to_role} idle | 0 | {idle.total_s * 1e3:.1f} ms | "
                  f"{idle.switch_s * 1e3:.1f} ms |")
        jobs = [asyncio.create_task(one()) for _ in range(8)]
        await asyncio.sleep(1.0)
        busy = sum(1 for r in cluster.requests.values() if r.owner == 2)
        loaded = await cluster.flip(2, "prefill")
        print(f"| decode->prefill under load | {busy} | {loaded.total_s * 1e3:.1f} ms | "
              f"{loaded.switch_s * 1e3:.1f} ms |")
        await asyncio.gather(*jobs)
    finally:
        await cluster.stop()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", default="builtin:bench")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--calibrations", type=int, default=1,
                    help="calibrate this many times and print every pick")
    pre = PrefillConfig()
    ap.add_argument("--rows", type=int,
                    default=calibration_rows(pre.local_decode_batch, pre.local_decode_chunk,
                                             pre.local_decode_full_chunk_backlog,
                                             pre.local_decode_full_chunk_share),
                    help="decode rows in every pass (default: those a prefill worker "
                         "calibrates with on the default config, policy.calibration_rows)")
    ap.add_argument("--no-flip", action="store_true", help="only the calibration")
    args = ap.parse_args()
    model = str(resolve_model_path(args.model))
    os.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))[-1]})
    calibration(model, args.threads, args.calibrations, args.rows)
    os.sched_setaffinity(0, set(range(os.cpu_count() or 1)))
    if not args.no_flip:
        asyncio.run(flip_times(model))


if __name__ == "__main__":
    main()
