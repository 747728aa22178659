"""Scoring a predictor on (prompt, response length) samples, with baselines and the ceiling.

Accuracy is per *response*: a prompt answered by several models counts once per answer, and a
prompt-only predictor can be right for at most the most common bucket among them.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from tetri_server.predictor.base import LengthPredictor
from tetri_server.predictor.classifier import ClassifierPredictor
from tetri_server.predictor.data import Sample
from tetri_server.predictor.metrics import (
    accuracy,
    bucket_of,
    fit_length_regression,
    kendall_tau_b,
    majority_bucket,
    predict_length_regression,
    sampling_ceiling,
)
from tetri_server.predictor.tokens import TokenCounter
from tetri_server.predictor.train import unique_prompts


def json_safe(obj: Any) -> Any:
    """``obj`` with NaN/inf floats as ``None`` (strict JSON has no NaN)."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: json_safe(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [json_safe(v) for v in obj]
    return obj


def score(predictor: LengthPredictor, samples: Sequence[Sample]) -> dict[str, Any]:
    """Accuracy and Kendall tau-b of ``predictor`` on ``samples`` (each prompt predicted once)."""
    texts, rows = unique_prompts(samples)
    lengths = np.array([s.output_tokens for s in samples], dtype=np.int64)
    true = bucket_of(lengths, predictor.granularity, predictor.num_buckets)
    pred = np.array(predictor.predict(texts, _first_lengths(samples, len(texts), rows)))[rows]
    out: dict[str, Any] = {
        "granularity": predictor.granularity,
        "num_buckets": predictor.num_buckets,
        "n": len(samples),
        "prompts": len(texts),
        "accuracy": accuracy(pred, true),
        "within_one_bucket": float(np.mean(np.abs(pred - true) <= 1)) if len(true) else None,
        "kendall_tau": kendall_tau_b(pred, lengths),
    }
    if isinstance(predictor, ClassifierPredictor):
        expected = np.array(predictor.expected_length(texts))[rows]
        out["kendall_tau_expected"] = kendall_tau_b(expected, lengths)
    return out


def _first_lengths(samples: Sequence[Sample], n: int, rows: np.ndarray) -> list[int | None]:
    """One true length per prompt (its first sample's) for the oracle."""
    first: list[int | None] = [None] * n
    for s, r in zip(samples, rows, strict=True):
        if first[r] is None:
            first[r] = s.output_tokens
    return first


def baselines(
    train: Sequence[Sample],
    test: Sequence[Sample],
    granularity: int,
    num_buckets: int,
    counter: TokenCounter,
) -> dict[str, float]:
    """Majority bucket of ``train``, and a log-log regression on prompt length in tokens."""

    def arrays(ss: Sequence[Sample]) -> tuple[np.ndarray, np.ndarray]:
        texts, rows = unique_prompts(ss)
        prompt_tokens = np.array(counter.count(texts), dtype=np.float64)[rows]
        return prompt_tokens, np.array([s.output_tokens for s in ss], dtype=np.int64)

    train_p, train_l = arrays(train)
    test_p, test_l = arrays(test)
    true = bucket_of(test_l, granularity, num_buckets)
    majority = majority_bucket(bucket_of(train_l, granularity, num_buckets), num_buckets)
    coef = fit_length_regression(train_p, train_l)
    reg_len = predict_length_regression(coef, test_p)
    reg = bucket_of(np.round(reg_len).astype(np.int64), granularity, num_buckets)
    return {
        "majority_accuracy": accuracy(np.full(len(true), majority), true),
        "length_regression_accuracy": accuracy(reg, true),
        "length_regression_kendall_tau": kendall_tau_b(reg_len, test_l),
    }


def ceiling(samples: Sequence[Sample], granularity: int, num_buckets: int) -> dict[str, Any]:
    """Sampling-noise ceiling (two samples of one prompt+model) and the prompt-mode bound.

    The prompt-mode bound is the share of responses in their prompt's most common bucket:
    what an oracle that knew each prompt's bucket histogram, but not which model answers,
    would score (optimistic for prompts with few responses).
    """
    rate, pairs = sampling_ceiling(
        [(s.prompt_id, s.model) for s in samples],
        [s.output_tokens for s in samples],
        granularity,
        num_buckets,
    )
    _, rows = unique_prompts(samples)
    buckets = bucket_of([s.output_tokens for s in samples], granularity, num_buckets)
    counts = np.zeros((int(rows.max()) + 1 if len(rows) else 0, num_buckets))
    np.add.at(counts, (rows, buckets), 1.0)
    mode = float(counts.max(axis=1).sum() / counts.sum()) if len(rows) else float("nan")
    return {"two_sample_agreement": rate, "two_sample_pairs": pairs, "prompt_mode_bound": mode}
