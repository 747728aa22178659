"""A/B of the coupled baselines' scheduling between two checkouts (e.g. before and after a
scheduler change): the in-process LLMEngine on the bench model, one core and one thread, a
fixed seeded workload of 24 requests (prompts 32-400 tokens, outputs 16-96), CPU time of
``generate``, rounds interleaved. Outputs must be identical across checkouts (greedy).

    git worktree add /tmp/before <rev>; git worktree add /tmp/after <rev>
    .venv/bin/python tools/bench_coupled_ab.py /tmp/before /tmp/after --rounds 3
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys

CHILD = r"""
import json, os, random, sys, time
sys.path.insert(0, sys.argv[1])
os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})
import torch
torch.set_num_threads(1)
try:
    from tetri_server.llm import make_engine
except ImportError:  # checkouts before the in-process engine was built from Config
    make_engine = None
from tetri_server.messages import SamplingParams
from tetri_server.modelmaker import builtin_model_path
rng = random.Random(7)
prompts = [[rng.randrange(5, 8000) for _ in range(rng.choice((32, 96, 200, 400)))]
           for _ in range(24)]
params = [SamplingParams(max_tokens=rng.choice((16, 48, 96)), temperature=0.0, ignore_eos=True)
          for _ in prompts]
path = str(builtin_model_path("bench"))
if make_engine is not None:
    mode = "coupled-chunked" if sys.argv[2] == "chunked" else "coupled"
    eng = make_engine(path, f"cluster.mode={mode}", "prefill.token_budget=256",
                      "kv.num_blocks=2000", "decode.max_batch=32")
else:
    try:
        from tetri_server.engine.llm import EngineConfig, LLMEngine
    except ImportError:
        from tetri_server.llm import EngineConfig, LLMEngine
    eng = LLMEngine(EngineConfig(path, mode=sys.argv[2], chunk_size=256, num_blocks=2000,
                                 max_batch=32))
eng.generate(prompts[:2], params[:2])
t0 = time.process_time()
out = eng.generate(prompts, params)
print(json.dumps({"cpu_s": time.process_time() - t0, "out": out}))
"""


def run(repo: str, mode: str) -> dict:
    res = subprocess.run([sys.executable, "-c", CHILD, repo, mode], capture_output=True,
                         text=True, check=True)
    return json.loads(res.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("before")
    ap.add_argument("after")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    print("| mode | before CPU s (median) | after CPU s (median) | after/before | same output |")
    print("|---|---:|---:|---:|---|")
    for mode in ("coupled", "chunked"):
        times: dict[str, list[float]] = {"before": [], "after": []}
        outs: dict[str, list] = {}
        for _ in range(args.rounds):
            for name in ("before", "after"):
                r = run(getattr(args, name), mode)
                times[name].append(r["cpu_s"])
                outs[name] = r["out"]
        b, a = statistics.median(times["before"]), statistics.median(times["after"])
        print(f"| {mode} | {b:.2f} | {a:.2f} | {a / b:.3f} | {outs['before'] == outs['after']} |")


if __name__ == "__main__":
    main()
