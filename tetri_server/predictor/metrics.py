"""Bucket labels and the scores the predictor is judged by (numpy only).

Bucket ``i`` of granularity ``g`` covers output lengths ``[i*g, (i+1)*g)``; the last bucket
also takes everything longer (``label = min(len // g, K-1)``, docs/tetriinfer.md §4).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence

import numpy as np


def num_buckets_for(granularity: int, max_tokens: int) -> int:
    """Buckets needed so that a length clipped at ``max_tokens`` has its own bucket."""
    if granularity <= 0 or max_tokens <= 0:
        raise ValueError("granularity and max_tokens must be positive")
    return max_tokens // granularity + 1


def bucket_of(
    lengths: Sequence[int] | np.ndarray, granularity: int, num_buckets: int
) -> np.ndarray:
    """Bucket ids of output lengths in tokens."""
    arr = np.asarray(lengths, dtype=np.int64)
    return np.minimum(np.maximum(arr, 0) // granularity, num_buckets - 1)


def accuracy(pred: Sequence[int] | np.ndarray, true: Sequence[int] | np.ndarray) -> float:
    p, t = np.asarray(pred), np.asarray(true)
    return float(np.mean(p == t)) if len(t) else float("nan")


def kendall_tau_b(x: Sequence[float] | np.ndarray, y: Sequence[float] | np.ndarray) -> float:
    """Kendall's tau-b (ties in either variable corrected), O(n^2) in blocks of rows."""
    a, b = np.asarray(x, dtype=np.float64), np.asarray(y, dtype=np.float64)
    n = len(a)
    if n < 2:
        return float("nan")
    concordant = discordant = ties_a = ties_b = 0.0
    for start in range(0, n, 512):
        da = np.sign(a[start : start + 512, None] - a[None, :])
        db = np.sign(b[start : start + 512, None] - b[None, :])
        prod = da * db
        concordant += float(np.sum(prod > 0))
        discordant += float(np.sum(prod < 0))
        ties_a += float(np.sum((da == 0) & (db != 0)))
        ties_b += float(np.sum((db == 0) & (da != 0)))
    # every unordered pair was counted twice (i,j and j,i); the factor cancels in the ratio
    denom = np.sqrt((concordant + discordant + ties_a) * (concordant + discordant + ties_b))
    return float((concordant - discordant) / denom) if denom > 0 else float("nan")


def majority_bucket(train_buckets: np.ndarray, num_buckets: int) -> int:
    """The most frequent training bucket (the majority baseline predicts it for every prompt)."""
    return int(np.argmax(np.bincount(train_buckets, minlength=num_buckets)))


def fit_length_regression(prompt_tokens: np.ndarray, out_tokens: np.ndarray) -> np.ndarray:
    """Least squares of log1p(output length) on [1, log1p(prompt length)]; returns coefs."""
    design = np.stack([np.ones(len(prompt_tokens)), np.log1p(prompt_tokens)], axis=1)
    coef, *_ = np.linalg.lstsq(design, np.log1p(out_tokens.astype(np.float64)), rcond=None)
    return coef


def predict_length_regression(coef: np.ndarray, prompt_tokens: np.ndarray) -> np.ndarray:
    return np.expm1(coef[0] + coef[1] * np.log1p(prompt_tokens))


def sampling_ceiling(
    keys: Sequence[tuple[str, str]], lengths: Sequence[int], granularity: int, num_buckets: int
) -> tuple[float, int]:
    """Bucket agreement between two samples of the same (prompt, model); returns (rate, pairs).

    Even a perfect predictor of one model's length cannot beat how often the model agrees with
    itself when asked twice, so this bounds the accuracy a prompt-only predictor can reach.
    """
    groups: dict[tuple[str, str], list[int]] = defaultdict(list)
    for k, n in zip(keys, lengths, strict=True):
        groups[k].append(n)
    pairs = [v[:2] for v in groups.values() if len(v) >= 2]
    if not pairs:
        return float("nan"), 0
    arr = bucket_of(np.array(pairs), granularity, num_buckets)
    return float(np.mean(arr[:, 0] == arr[:, 1])), len(pairs)
