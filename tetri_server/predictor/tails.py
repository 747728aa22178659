"""The length distributions behind the refined decode estimate (``policy.LengthTail``), stored
in the predictor artifact's JSON under ``length_tails``.

Why with the artifact, not computed at start-up: the distribution that matters is that of true
lengths *given the predictor's bucket* — a property of the trained head (its confusion), so it is
computed once beside the head, on the same held-out prompts as its recorded scores, in the same
tokenizer. Start-up then reads a few KB of JSON instead of tokenizing 11k responses, and a server
does not need ``../shared/data``. Two histograms are stored:

- ``by_predicted``: true lengths of the held-out responses, by the classifier's predicted bucket
  (for ``predictor.kind = classifier``);
- ``marginal``: every response's length (``oracle`` splits it by true bucket; ``none`` and the
  coupled roles, which predict nothing, use it whole).

    python -m tetri_server.predictor tails [--artifact NAME ...]   # (re)computes and writes
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tetri_server.policy.remaining import LengthTail
from tetri_server.predictor import artifact as artifact_io
from tetri_server.predictor.base import LengthPredictor, PredictorError
from tetri_server.predictor.data import Sample
from tetri_server.predictor.train import split_by_prompt

BIN_TOKENS = 20  # divides every shipped granularity (100, 200, 400): oracle rows cut exactly
KEY = "length_tails"


def compute(
    samples: Sequence[Sample], predictor: LengthPredictor, test_frac: float, seed: int
) -> dict[str, Any]:
    """The ``length_tails`` entry: ``predictor`` buckets the held-out split of ``samples``."""
    _, test = split_by_prompt(samples, test_frac, seed)
    if not test:
        raise ValueError("no held-out responses to measure the predicted buckets' lengths on")
    prompts = list(dict.fromkeys(s.prompt for s in test))
    bucket_of = dict(zip(prompts, predictor.predict(prompts), strict=True))
    by_predicted: dict[int, list[int]] = {}
    for s in test:
        by_predicted.setdefault(bucket_of[s.prompt], []).append(s.output_tokens)
    k = predictor.num_buckets
    marginal = {0: [s.output_tokens for s in samples]}
    return {
        "bin_tokens": BIN_TOKENS,
        "heldout_responses": len(test),
        "by_predicted": LengthTail.from_lengths(by_predicted, k, BIN_TOKENS).to_json(),
        "marginal": LengthTail.from_lengths(marginal, 1, BIN_TOKENS).to_json(),
    }


def write(meta_path: Path, tails: dict[str, Any]) -> None:
    """Add (or replace) ``length_tails`` in an artifact's JSON, keeping every other field."""
    meta = artifact_io.read_meta(meta_path)
    meta[KEY] = "@tails@"
    # one histogram row per line (indent=2 alone puts every count on a line of its own)
    rows = re.sub(r"\[\s+([\d,\s]+?)\s+\]", lambda m: "[" + " ".join(m.group(1).split()) + "]",
                  json.dumps(tails, indent=2)).replace("\n", "\n  ")
    text = json.dumps(meta, indent=2).replace('"@tails@"', rows)
    meta_path.write_text(text + "\n", encoding="utf-8")


def for_kind(meta: dict[str, Any], kind: str) -> LengthTail:
    """The tail a decode admission uses with predictor ``kind`` (``none``: no buckets)."""
    try:
        tails = meta[KEY]
        clip = int(meta["max_tokens"])  # the data's generation cap: lengths there are censored
        marginal = LengthTail.from_json(tails["marginal"], clip)
        if kind == "classifier":
            return LengthTail.from_json(tails["by_predicted"], clip)
    except (KeyError, TypeError, ValueError) as e:
        raise PredictorError(
            f"artifact has no valid {KEY} ({e!r}); add them with "
            "`python -m tetri_server.predictor tails --artifact NAME`"
        ) from e
    if kind == "none":
        return marginal
    if kind == "oracle":
        return _split_by_bucket(marginal, int(meta["granularity"]), int(meta["num_buckets"]))
    raise ValueError(f"unknown predictor kind {kind!r}")


def load(kind: str, artifact: str | Path | None = None) -> LengthTail:
    """Read the artifact's tails for ``kind``; a missing or bad entry raises at start-up."""
    path = artifact_io.resolve(artifact)
    try:
        return for_kind(artifact_io.read_meta(path), kind)
    except PredictorError as e:
        raise PredictorError(f"{path}: {e}") from e


def _split_by_bucket(marginal: LengthTail, granularity: int, num_buckets: int) -> LengthTail:
    """The marginal histogram cut at the bucket edges: row ``b`` keeps the bins of bucket ``b``
    (the oracle's bucket is the true one). Needs ``granularity`` a multiple of the bin."""
    w = marginal.bin_tokens
    if granularity % w:
        raise PredictorError(f"granularity {granularity} is not a multiple of the bin {w}")
    [counts], [sums] = marginal.counts, marginal.sums
    rows_c, rows_s = [], []
    for b in range(num_buckets):
        lo = b * granularity // w
        hi = len(counts) if b == num_buckets - 1 else (b + 1) * granularity // w
        rows_c.append([c if lo <= j < hi else 0 for j, c in enumerate(counts)])
        rows_s.append([s if lo <= j < hi else 0 for j, s in enumerate(sums)])
    return LengthTail(w, rows_c, rows_s, marginal.clip)
