"""Training the bucket classifier: a softmax head over hashed n-gram features (numpy only).

Rows are *prompts*, not responses: a prompt answered by several models (or sampled several
times) gets the empirical distribution of its responses' buckets as a soft target, weighted by
its number of responses — the same loss as one row per response, at a fraction of the cost.
The L2 strength is picked by k-fold cross-validation on the training prompts only, so the
held-out split is touched once, by ``evaluate``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from tetri_server.predictor.data import Sample
from tetri_server.predictor.features import FeatureSpec, SparseRows, featurize
from tetri_server.predictor.metrics import bucket_of, num_buckets_for

DENSE_LIMIT = 64 * 1024 * 1024  # elements (256 MB of float32) up to which training densifies


@dataclass(frozen=True)
class TrainConfig:
    """Knobs of one training run; all of them are recorded in the artifact."""

    granularity: int = 200
    max_tokens: int = 1024  # lengths are clipped here (the generation cap of the data)
    test_frac: float = 0.2  # share of prompts held out
    seed: int = 0  # fixes the prompt split and the CV folds
    l2_grid: tuple[float, ...] = (1e-5, 3e-5, 1e-4, 3e-4, 1e-3)
    folds: int = 5
    iters: int = 150  # full-batch Adam steps
    lr: float = 0.05
    spec: FeatureSpec = field(default_factory=FeatureSpec)

    @property
    def num_buckets(self) -> int:
        return num_buckets_for(self.granularity, self.max_tokens)


@dataclass(frozen=True)
class Head:
    """Softmax head: logits = features @ weight + bias."""

    weight: np.ndarray  # [spec.width, num_buckets] float32
    bias: np.ndarray  # [num_buckets] float32

    def proba(self, x: SparseRows) -> np.ndarray:
        return softmax(x.matmul(self.weight) + self.bias)


@dataclass(frozen=True)
class PromptTable:
    """Training rows: unique prompts with soft bucket targets and response counts."""

    prompt_ids: list[str]
    prompts: list[str]
    targets: np.ndarray  # [n, num_buckets], rows sum to 1
    weights: np.ndarray  # [n] responses per prompt


def softmax(z: np.ndarray) -> np.ndarray:
    z = z - z.max(axis=1, keepdims=True)
    e = np.exp(z)
    return e / e.sum(axis=1, keepdims=True)


def prompt_key(text: str) -> str:
    """What makes two prompts the same prompt: their text, whitespace runs collapsed. The
    data set files some texts under several ids (34 texts under 86 ids in the Arena data),
    so a split or a fold by id put the same prompt on both sides."""
    return " ".join(text.split())


def held_out_ids(prompts: Mapping[str, str], test_frac: float, seed: int) -> set[str]:
    """The held-out prompt ids of ``prompts`` (id -> text): a seeded permutation of the sorted
    distinct prompt texts (``prompt_key``) picks the held-out texts, and every id of one is
    held out."""
    keys = sorted({prompt_key(t) for t in prompts.values()})
    order = np.random.default_rng(seed).permutation(len(keys))
    held = {keys[i] for i in order[: int(round(len(keys) * test_frac))]}
    return {pid for pid, text in prompts.items() if prompt_key(text) in held}


def split_by_prompt(
    samples: Sequence[Sample], test_frac: float, seed: int
) -> tuple[list[Sample], list[Sample]]:
    """Split so that no prompt text is in both parts; the same prompts and seed give the same
    split."""
    test = held_out_ids({s.prompt_id: s.prompt for s in samples}, test_frac, seed)
    return [s for s in samples if s.prompt_id not in test], [
        s for s in samples if s.prompt_id in test
    ]


def unique_prompts(samples: Sequence[Sample]) -> tuple[list[str], np.ndarray]:
    """The distinct prompts (``prompt_key``) in first-seen order, and each sample's row among
    them: one row per text, so that a cross-validation fold holds all of a text's samples."""
    index: dict[str, int] = {}
    texts: list[str] = []
    for s in samples:
        key = prompt_key(s.prompt)
        if key not in index:
            index[key] = len(texts)
            texts.append(s.prompt)
    return texts, np.array([index[prompt_key(s.prompt)] for s in samples], dtype=np.int64)


def prompt_table(samples: Sequence[Sample], granularity: int, num_buckets: int) -> PromptTable:
    texts, rows = unique_prompts(samples)
    counts = np.zeros((len(texts), num_buckets))
    buckets = bucket_of([s.output_tokens for s in samples], granularity, num_buckets)
    np.add.at(counts, (rows, buckets), 1.0)
    weights = counts.sum(axis=1)
    first_id: dict[str, str] = {}  # first-seen id of each text, in the texts' order
    for s in samples:
        first_id.setdefault(prompt_key(s.prompt), s.prompt_id)
    ids = list(first_id.values())
    return PromptTable(ids, texts, counts / weights[:, None], weights)


def fit_head(
    x: SparseRows, targets: np.ndarray, weights: np.ndarray, l2: float, iters: int, lr: float
) -> Head:
    """Minimise weighted soft-target cross-entropy + l2/2·|W|² with full-batch Adam.

    Small problems are densified (a BLAS matmul is ~5x faster than the sparse gather here).
    """
    dense = x.to_dense() if x.num_rows * x.width <= DENSE_LIMIT else None
    k = targets.shape[1]
    share = weights / weights.sum()
    prior = share @ targets
    params = [np.zeros((x.width, k)), np.log(prior + 1e-6)]
    moments = [(np.zeros_like(p), np.zeros_like(p)) for p in params]
    for step in range(1, iters + 1):
        weight = params[0].astype(np.float32)
        logits = dense @ weight if dense is not None else x.matmul(weight)
        grad_logits = (softmax(logits + params[1]) - targets) * share[:, None]
        grad_w = (
            dense.T @ grad_logits.astype(np.float32)
            if dense is not None
            else x.rmatmul(grad_logits)
        )
        grads = [grad_w + l2 * params[0], grad_logits.sum(axis=0)]
        for p, g, (m, v) in zip(params, grads, moments, strict=True):
            m *= 0.9
            m += 0.1 * g
            v *= 0.999
            v += 0.001 * g * g
            p -= lr * (m / (1 - 0.9**step)) / (np.sqrt(v / (1 - 0.999**step)) + 1e-8)
    return Head(params[0].astype(np.float32), params[1].astype(np.float32))


def cross_validate(x: SparseRows, table: PromptTable, cfg: TrainConfig) -> dict[float, float]:
    """Mean held-out response-weighted accuracy of each L2 strength over k prompt folds."""
    n = len(table.prompts)
    num_folds = min(cfg.folds, n)  # tiny label sets: leave-one-out at worst
    folds = np.array_split(np.random.default_rng(cfg.seed + 1).permutation(n), num_folds)
    scores: dict[float, float] = {}
    for l2 in cfg.l2_grid:
        hits = total = 0.0
        for fold in folds:
            train = np.setdiff1d(np.arange(n), fold)
            head = fit_head(
                x.take(train), table.targets[train], table.weights[train], l2, cfg.iters, cfg.lr
            )
            pred = head.proba(x.take(fold)).argmax(axis=1)
            # share of the fold's responses whose bucket is the predicted one
            hits += float(np.sum(table.targets[fold, pred] * table.weights[fold]))
            total += float(np.sum(table.weights[fold]))
        scores[l2] = hits / total if total else 0.0
    return scores


def train_head(samples: Sequence[Sample], cfg: TrainConfig) -> tuple[Head, dict[float, float]]:
    """Pick L2 by cross-validation on ``samples``, then fit on all of them."""
    table = prompt_table(samples, cfg.granularity, cfg.num_buckets)
    x = featurize(table.prompts, cfg.spec)
    cv = len(cfg.l2_grid) > 1 and len(table.prompts) >= 2
    scores = cross_validate(x, table, cfg) if cv else {cfg.l2_grid[0]: 0.0}
    best = max(scores, key=lambda l2: (scores[l2], l2))
    head = fit_head(x, table.targets, table.weights, best, cfg.iters, cfg.lr)
    return head, scores
