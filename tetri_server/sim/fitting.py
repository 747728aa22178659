"""``tetri-server sim fit``: measure this machine's engine for a model and write a profile.

    tetri-server sim fit --model models/llama-bench --out tetri_server/sim/profiles/this-cpu.json

The measurement (``bench/engine_profile.py``, torch) is imported only when the command runs,
so ``sim/`` stays torch-free. Links, memory and ``pads_compute`` come from ``--base`` (default:
the current ``this-cpu`` profile); the five step-time parameters are fitted (``sim/fit.py``).
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
from pathlib import Path

from tetri_server.bench.report import git_commit
from tetri_server.sim.fit import PARAMS, fit_hardware, profile_json
from tetri_server.sim.profiles import load_hardware


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="tetri-server sim fit", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="checkpoint folder (or builtin:NAME)")
    p.add_argument("--out", required=True, type=Path, metavar="PROFILE.json")
    p.add_argument("--base", default="this-cpu",
                   help="profile whose links, memory and pads_compute are kept")
    p.add_argument("--clock", choices=("cpu", "wall"), default="cpu",
                   help="cpu: process CPU time (others' slices not counted); wall")
    p.add_argument("--cpu", type=int, help="core to pin to (default: the least busy)")
    p.add_argument("--quick", action="store_true", help="fewer shapes (~15 s)")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from tetri_server.bench.engine_profile import QUICK, Shapes, measure
    from tetri_server.modelinfo import resolve_model_path

    path = Path(resolve_model_path(args.model))
    base = load_hardware(args.base)
    print(f"measuring {path} ({'quick' if args.quick else 'full'} shapes, {args.clock} clock)",
          file=sys.stderr)
    samples, shape, info = measure(path, QUICK if args.quick else Shapes(), args.clock, args.cpu)
    fit = fit_hardware(samples, shape, base, peak_flops=1e9 * max(info["matmul_peak_gflops"]),
                       mem_bw_Bps=1e9 * max(info["memcpy_gbps"]))
    when = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    commit = git_commit(Path(__file__).parent)
    notes = (f"Fitted by `tetri-server sim fit --model {args.model}` on {when} at commit "
             f"{commit} ({args.clock} clock, one core, one torch thread, "
             f"{len(samples)} steps of {shape.name}); links and memory from {args.base}.")
    out = profile_json(fit, samples, notes, {"model_shape": shape.__dict__, "run": info})
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=1) + "\n")
    for name in PARAMS:
        print(f"{name:16} {fit.params[name]:.4g}")
    worst = max(fit.rel_errors, key=abs)
    print(f"fit: rms log error {fit.rms_log_error:.3f}, worst sample {100 * worst:+.0f}%")
    for s, e in zip(samples, fit.rel_errors, strict=True):
        print(f"  {s.kind:12} {len(s.items):3} seqs {sum(n for n, _ in s.items):5} new "
              f"{s.items[0][1]:5} prefix  {1e3 * s.time_s:8.2f} ms  {100 * e:+5.0f}%")
    print(f"wrote {args.out}", file=sys.stderr)
    return 0
