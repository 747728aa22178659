"""``predictor eval`` and ``predictor bench``: score a predictor on any Arena-format
prompt/response files; time it per prompt.

    python -m tetri_server.predictor eval --prompts P.jsonl[.gz] --responses R.jsonl[.gz] ...
    OMP_NUM_THREADS=1 python -m tetri_server.predictor bench --batch 1 16
    python -m tetri_server.predictor tails [--artifact NAME ...]

Prints a table, then as its last line one JSON object (``n``, ``accuracy_100``,
``accuracy_200``, ``accuracy_400``, ``kendall_tau``, …). The accuracy at each granularity comes
from the artifact of that granularity in the same family (``NAME_g100`` … ``NAME_g400`` beside
the configured one); a granularity without an artifact reports ``null``. ``kendall_tau`` is
that of the configured predictor's bucket against the true length.
"""

from __future__ import annotations

import argparse
import json
import random
import re
import sys
import time
from pathlib import Path
from typing import Any

from tetri_server.predictor import KINDS, load_predictor
from tetri_server.predictor import artifact as artifact_io
from tetri_server.predictor.data import DEFAULT_DATA_DIR, load_arena
from tetri_server.predictor.evaluate import ceiling, json_safe, score
from tetri_server.predictor.labels import read_prompts
from tetri_server.predictor.tokens import PACKAGE_ROOT, TokenCounter

GRANULARITIES = (100, 200, 400)


def add_eval_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--prompts", required=True, help="prompts JSONL(.gz): prompt_id, prompt")
    p.add_argument(
        "--responses",
        required=True,
        nargs="+",
        help="responses JSONL(.gz): prompt_id, model, response",
    )
    p.add_argument("--kind", default="classifier", choices=KINDS)
    p.add_argument("--artifact", default=None, help="artifact name or path (default: shipped)")
    p.add_argument(
        "--tokenizer",
        default=None,
        help="tokenizer to count response lengths (default: the artifact's)",
    )
    p.add_argument(
        "--max-tokens",
        type=int,
        default=None,
        help="clip lengths here (default: the artifact's max_tokens)",
    )


def family(meta_path: Path) -> dict[int, Path]:
    """Artifacts of the same family at each granularity, keyed by granularity."""
    m = re.fullmatch(r"(.*)_g\d+", meta_path.stem)
    if m is None:
        return {}
    found = {g: meta_path.with_name(f"{m.group(1)}_g{g}.json") for g in GRANULARITIES}
    return {g: p for g, p in found.items() if p.is_file()}


def counter_for(meta: dict[str, Any], tokenizer: str | None) -> tuple[TokenCounter, str | None]:
    """The counting tokenizer and a warning if it differs from the artifact's."""
    recorded = meta.get("tokenizer", {})
    if tokenizer is None:
        name = str(recorded.get("name", ""))
        if name.startswith("tetri_server/"):
            tokenizer = str(PACKAGE_ROOT.parent / name)
        elif name:
            tokenizer = name
    try:
        counter = TokenCounter(tokenizer)
    except (OSError, ValueError) as exc:  # e.g. labels counted by a served model
        raise SystemExit(f"cannot load the tokenizer the artifact's lengths were counted with "
                         f"({recorded.get('name') or tokenizer!r}): give --tokenizer "
                         f"({type(exc).__name__}: {exc})") from None
    sha = recorded.get("sha256")
    warn = None
    if sha and sha != counter.sha256:
        warn = (
            f"lengths counted with {counter.name} ({counter.sha256[:12]}), but the artifact "
            f"was trained on lengths from {recorded.get('name')} ({str(sha)[:12]})"
        )
    return counter, warn


def run_eval(args: argparse.Namespace) -> dict[str, Any]:
    meta_path = artifact_io.resolve(args.artifact)
    meta = artifact_io.read_meta(meta_path)
    counter, warn = counter_for(meta, args.tokenizer)
    max_tokens = args.max_tokens if args.max_tokens is not None else int(meta["max_tokens"])
    samples = load_arena(args.prompts, args.responses, counter, max_tokens=max_tokens)
    if not samples:
        raise SystemExit(f"no responses in {' '.join(map(str, args.responses))}")
    configured = load_predictor(args.kind, meta_path)
    paths = family(meta_path) or {configured.granularity: meta_path}
    rows = {g: score(load_predictor(args.kind, p), samples) for g, p in sorted(paths.items())}
    main_row = rows.get(configured.granularity) or score(configured, samples)
    result: dict[str, Any] = {
        "kind": args.kind,
        "artifact": meta_path.stem,
        "tokenizer": counter.name,
        "max_tokens": max_tokens,
        "n": len(samples),
        "prompts": main_row["prompts"],
        **{f"accuracy_{g}": rows[g]["accuracy"] if g in rows else None for g in GRANULARITIES},
        "kendall_tau": main_row["kendall_tau"],
        "kendall_tau_expected": main_row.get("kendall_tau_expected"),
        "ceiling_two_sample": ceiling(samples, configured.granularity, configured.num_buckets)[
            "two_sample_agreement"
        ],
    }
    print(
        f"predictor {args.kind} ({meta_path.stem}) on {len(samples)} responses to "
        f"{main_row['prompts']} prompts; lengths in {counter.name} tokens, clipped at "
        f"{max_tokens}"
    )
    if warn:
        print(f"warning: {warn}")
    print(f"{'granularity':>11} {'buckets':>7} {'accuracy':>8} {'±1 bucket':>9} {'tau':>6}")
    for g, r in rows.items():
        print(
            f"{g:>11} {r['num_buckets']:>7} {r['accuracy']:>8.3f} "
            f"{r['within_one_bucket']:>9.3f} {r['kendall_tau']:>6.3f}"
        )
    return result


def run_bench(args: argparse.Namespace) -> dict[str, Any]:
    """Milliseconds per prompt of ``predict`` at each batch size, on the calling thread.

    Run it with ``OMP_NUM_THREADS=1`` (the classifier is numpy; BLAS barely matters here).
    """
    prompts = [text for _, text in read_prompts(args.prompts)]
    rng = random.Random(args.seed)
    predictor = load_predictor("classifier", args.artifact)
    predictor.predict(prompts[:16])  # warm caches
    result: dict[str, Any] = {
        "artifact": args.artifact or artifact_io.DEFAULT_ARTIFACT,
        "prompts_chars_p50": sorted(map(len, prompts))[len(prompts) // 2],
    }
    for batch in args.batch:
        times = []
        for _ in range(args.repeats):
            sample = rng.sample(prompts, batch)
            start = time.perf_counter()
            predictor.predict(sample)
            times.append((time.perf_counter() - start) * 1e3 / batch)
        times.sort()
        p50, p90, mean = (
            times[len(times) // 2],
            times[int(len(times) * 0.9)],
            sum(times) / len(times),
        )
        result[f"ms_per_prompt_b{batch}"] = {"mean": mean, "p50": p50, "p90": p90}
        print(
            f"batch {batch:>3}: {mean:.3f} ms/prompt mean, {p50:.3f} p50, {p90:.3f} p90 "
            f"({args.repeats} batches of random Arena prompts)"
        )
    return result


def run_tails(args: argparse.Namespace) -> dict[str, Any]:
    """Recompute ``length_tails`` (predictor/tails.py) of each artifact from the Arena files it
    was trained on, with its own tokenizer, length cap and held-out split."""
    from tetri_server.predictor import tails
    from tetri_server.predictor.data import default_arena_files

    prompts_file, response_files = default_arena_files(args.data_dir)
    result: dict[str, Any] = {}
    for name in args.artifact or artifact_io.shipped_artifacts():
        path = artifact_io.resolve(name)
        meta = artifact_io.read_meta(path)
        counter, warn = counter_for(meta, None)
        if warn:
            raise SystemExit(f"{path}: {warn}")
        samples = load_arena(prompts_file, response_files, counter, int(meta["max_tokens"]))
        training = meta["training"]
        entry = tails.compute(samples, load_predictor("classifier", path),
                              float(training["test_frac"]), int(training["seed"]))
        tails.write(path, entry)
        result[path.stem] = {"responses": len(samples), "heldout": entry["heldout_responses"]}
        print(f"{path}: length_tails from {len(samples)} responses "
              f"({entry['heldout_responses']} held out)")
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tetri-server predictor")
    sub = parser.add_subparsers(dest="command", required=True)
    add_eval_arguments(sub.add_parser("eval", help="score the predictor on Arena-format data"))
    b = sub.add_parser("bench", help="time predict() per prompt at batch sizes")
    b.add_argument("--prompts", default=str(DEFAULT_DATA_DIR / "arena_prompts.jsonl.gz"))
    b.add_argument("--artifact", default=None)
    b.add_argument("--batch", type=int, nargs="+", default=[1, 16])
    b.add_argument("--repeats", type=int, default=200)
    b.add_argument("--seed", type=int, default=0)
    t = sub.add_parser("tails", help="write the length distributions of the refined estimate")
    t.add_argument("--artifact", action="append", help="artifact name or path (default: all "
                   "shipped); repeat for several")
    t.add_argument("--data-dir", default=str(DEFAULT_DATA_DIR))
    args = parser.parse_args(argv)
    commands = {"eval": run_eval, "bench": run_bench, "tails": run_tails}
    result = commands[args.command](args)
    print(json.dumps(json_safe(result), allow_nan=False), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
