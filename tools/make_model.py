"""Make a random-weight Hugging Face checkpoint for tests and benchmarks.

    python tools/make_model.py --family opt --size bench --seed 0 --out models/opt-bench

Prints the folder and its parameter count. Extra config fields go in as JSON, e.g.
`--config '{"rope_scaling": {"rope_type": "linear", "factor": 2.0}}'`.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a plain checkout

from tetri_server.modelmaker import FAMILIES, SIZES, count_parameters, make_model  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--family", choices=FAMILIES, default="llama")
    ap.add_argument("--size", choices=SIZES, default="tiny")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, help="default: models/<family>-<size>-seed<seed>")
    ap.add_argument("--config", type=json.loads, default={}, help="JSON config overrides")
    args = ap.parse_args(argv)

    out = args.out or Path("models") / f"{args.family}-{args.size}-seed{args.seed}"
    start = time.perf_counter()
    path = make_model(out, args.family, args.size, args.seed, **args.config)
    elapsed_s = time.perf_counter() - start
    size_mb = (path / "model.safetensors").stat().st_size / 1e6
    print(path)
    num_params = count_parameters(path)
    print(f"parameters: {num_params:,}  weights: {size_mb:.1f} MB  made in {elapsed_s:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
