"""Train the output-length predictor from (prompt, response length) pairs.

    python tools/train_predictor.py                        # Arena data -> shipped artifacts
    python tools/train_predictor.py --labels my_model.csv --name my_model --out-dir DIR
    python tools/train_predictor.py --prompts P.jsonl.gz --responses R1.jsonl.gz R2.jsonl.gz

Default data: the Chatbot-Arena prompts and the real responses of 26 models in
``../shared/data``; response lengths are counted in tokens of ``--tokenizer`` (default: the
project's tokenizer, ``tetri_server/assets/tokenizer``) and clipped at ``--max-tokens``.
``--labels`` instead reads CSVs written by ``tools/label_lengths.py`` (lengths already in the
served model's tokens). Prompts are split 80/20 (``--test-frac``, ``--seed``) so that no prompt
is on both sides; one artifact ``NAME_gG`` is written per granularity, and its JSON records the
held-out scores.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tetri_server.predictor.artifact import ARTIFACT_DIR  # noqa: E402
from tetri_server.predictor.data import (  # noqa: E402
    DEFAULT_DATA_DIR,
    Sample,
    default_arena_files,
    load_arena,
    load_label_csv,
)
from tetri_server.predictor.pipeline import format_report, train_and_save  # noqa: E402
from tetri_server.predictor.tokens import TokenCounter  # noqa: E402
from tetri_server.predictor.train import TrainConfig  # noqa: E402


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    src = p.add_mutually_exclusive_group()
    src.add_argument("--data", default=str(DEFAULT_DATA_DIR), help="folder of the Arena files")
    src.add_argument("--prompts", help="prompts JSONL(.gz) (with --responses)")
    src.add_argument("--labels", nargs="+", help="labelling CSVs from tools/label_lengths.py")
    p.add_argument("--responses", nargs="+", help="responses JSONL(.gz) (with --prompts)")
    p.add_argument(
        "--tokenizer",
        default=None,
        help="tokenizer.json or its folder to count tokens (default: project's)",
    )
    p.add_argument("--granularity", type=int, nargs="+", default=[100, 200, 400])
    p.add_argument("--max-tokens", type=int, default=1024, help="clip output lengths here")
    p.add_argument("--test-frac", type=float, default=0.2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--iters", type=int, default=TrainConfig.iters)
    p.add_argument(
        "--l2",
        type=float,
        nargs="+",
        default=list(TrainConfig.l2_grid),
        help="L2 strengths to cross-validate (one value: no CV)",
    )
    p.add_argument("--name", default="arena", help="artifact name prefix (NAME_gG)")
    p.add_argument("--out-dir", default=str(ARTIFACT_DIR))
    args = p.parse_args(argv)
    if (args.prompts is None) != (args.responses is None):
        p.error("--prompts and --responses go together")
    return args


def load_samples(
    args: argparse.Namespace, counter: TokenCounter
) -> tuple[list[Sample], dict[str, object], dict[str, object]]:
    """Samples, the description of what counted their lengths, and of the data."""
    if args.labels:
        samples = [s for f in args.labels for s in load_label_csv(f, args.max_tokens)]
        tokenizer: dict[str, object] = {
            "name": "served model (usage.completion_tokens)",
            "sha256": None,
        }
        return (
            samples,
            tokenizer,
            {"source": "labels", "files": [Path(f).name for f in args.labels]},
        )
    if args.prompts:
        prompts, responses = Path(args.prompts), [Path(r) for r in args.responses]
    else:
        prompts, responses = default_arena_files(args.data)
    samples = load_arena(prompts, responses, counter, max_tokens=args.max_tokens)
    files = [prompts.name, *(r.name for r in responses)]
    return (
        samples,
        {"name": counter.name, "sha256": counter.sha256},
        {"source": "arena", "files": files},
    )


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    counter = TokenCounter(args.tokenizer)
    samples, tokenizer, data = load_samples(args, counter)
    print(
        f"{len(samples)} responses to {len({s.prompt_id for s in samples})} prompts; "
        f"lengths from {tokenizer['name']}, clipped at {args.max_tokens}",
        flush=True,
    )
    metas = []
    for g in args.granularity:
        cfg = TrainConfig(
            granularity=g,
            max_tokens=args.max_tokens,
            test_frac=args.test_frac,
            seed=args.seed,
            l2_grid=tuple(args.l2),
            iters=args.iters,
        )
        stem = Path(args.out_dir) / f"{args.name}_g{g}"
        metas.append(train_and_save(samples, cfg, stem, counter, tokenizer, data))
        print(f"wrote {stem}.npz/.json", flush=True)
    print(format_report(metas))
    print(json.dumps({f"accuracy_{m['granularity']}": m["heldout"]["accuracy"] for m in metas}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
