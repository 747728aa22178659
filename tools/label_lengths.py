"""Label a prompt set with the served model's own output lengths, then retrain the predictor.

    python tools/label_lengths.py --url http://127.0.0.1:8000 --model MODEL \\
        --prompts ../shared/data/arena_prompts.jsonl.gz --out labels/MODEL.csv \\
        --retrain --name MODEL --out-dir predictors/MODEL

Sends each prompt as a user message to ``POST /v1/chat/completions`` of any OpenAI-compatible
server (tetri-server, vLLM, SGLang; ``--endpoint completions``: as raw text to
``/v1/completions``, for traffic that is not chat) with ``max_tokens`` as the cap and the
sampling settings your traffic uses, and
writes ``prompt_id,prompt,output_tokens`` (from ``usage.completion_tokens``) to a CSV. With
``--retrain`` it then runs ``tools/train_predictor.py --labels CSV``; point
``predictor.artifact`` in config.toml at the ``NAME_g200`` it writes.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tetri_server.predictor.data import DEFAULT_DATA_DIR, write_label_csv  # noqa: E402
from tetri_server.predictor.labels import (  # noqa: E402
    LabelRequest,
    label,
    openai_completer,
    read_prompts,
)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--url", required=True, help="server root, e.g. http://127.0.0.1:8000")
    p.add_argument("--model", required=True, help="model name the server serves")
    p.add_argument(
        "--prompts",
        default=str(DEFAULT_DATA_DIR / "arena_prompts.jsonl.gz"),
        help="prompts JSONL(.gz) with prompt_id and prompt",
    )
    p.add_argument("--limit", type=int, default=None, help="label only the first N prompts")
    p.add_argument("--max-tokens", type=int, default=1024, help="generation cap per prompt")
    p.add_argument("--temperature", type=float, default=0.7)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--concurrency", type=int, default=8, help="requests in flight")
    p.add_argument("--endpoint", choices=["chat", "completions"], default="chat",
                   help="chat: each prompt as one user message, through the chat template "
                        "(default); completions: the raw prompt")
    p.add_argument("--out", required=True, help="CSV to write (prompt_id,prompt,output_tokens)")
    p.add_argument("--retrain", action="store_true", help="then train on the CSV")
    p.add_argument("--name", default=None, help="artifact name prefix (default: CSV stem)")
    p.add_argument("--out-dir", default=None, help="artifact folder (default: beside the CSV)")
    p.add_argument("--granularity", type=int, nargs="+", default=[100, 200, 400])
    return p.parse_args(argv)


def retrain_args(args: argparse.Namespace) -> list[str]:
    """The train_predictor.py command line for the CSV just written."""
    out = Path(args.out)
    return [
        "--labels",
        str(out),
        "--name",
        args.name or out.stem,
        "--out-dir",
        args.out_dir or str(out.parent),
        "--max-tokens",
        str(args.max_tokens),
        "--granularity",
        *(str(g) for g in args.granularity),
    ]


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    prompts = read_prompts(args.prompts, args.limit)
    req = LabelRequest(args.url, args.model, args.max_tokens, args.temperature, args.top_p,
                       endpoint=args.endpoint)
    start = time.perf_counter()
    rows = list(label(prompts, openai_completer(req), args.concurrency))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    write_label_csv(args.out, rows)
    refused = len(prompts) - len(rows)
    if prompts and not rows:  # a 400 for every prompt: the settings, not the prompts
        print(f"the server refused all {refused} prompts (400); check --model and "
              f"--max-tokens against its context", file=sys.stderr)
        return 1
    print(
        f"labelled {len(rows)} prompts in {time.perf_counter() - start:.0f} s -> {args.out}"
        + (f"; {refused} refused by the server (400: e.g. longer than its context, less "
           f"--max-tokens) and left out" if refused else ""),
        flush=True,
    )
    if not args.retrain:
        return 0
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import train_predictor

    return int(train_predictor.main(retrain_args(args)))


if __name__ == "__main__":
    sys.exit(main())
