"""Hashed n-gram features of a prompt (numpy and the standard library only).

A prompt becomes a sparse vector of ``dim`` hashed buckets (lower-cased character 3–5-grams
of its UTF-8 bytes and word 1–2-grams, ``log1p`` counts, L2-normalised) followed by
``NUM_DENSE`` length features. The hashes are fixed arithmetic (FNV-1a style on bytes, crc32 on
words), never Python's salted ``hash``, so a trained head means the same thing in every
process. Long prompts are cut to their first ``head_chars`` and last ``tail_chars``
characters, which bounds the cost per prompt; the length features see the whole prompt.
"""

from __future__ import annotations

import math
import re
import zlib
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

_WORD = re.compile(r"\w+|[^\w\s]")
_FNV_PRIME = np.uint64(1099511628211)
_MIX = np.uint64(0x9E3779B97F4A7C15)
NUM_DENSE = 4


@dataclass(frozen=True)
class FeatureSpec:
    """How prompts are hashed; stored in every artifact's metadata and checked at load."""

    dim: int = 1 << 14
    char_ngrams: tuple[int, ...] = (3, 4, 5)
    word_ngrams: tuple[int, ...] = (1, 2)
    head_chars: int = 3000
    tail_chars: int = 1000

    @property
    def width(self) -> int:
        return self.dim + NUM_DENSE

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d["char_ngrams"], d["word_ngrams"] = list(self.char_ngrams), list(self.word_ngrams)
        return d

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> FeatureSpec:
        return cls(
            dim=int(d["dim"]),
            char_ngrams=tuple(int(n) for n in d["char_ngrams"]),
            word_ngrams=tuple(int(n) for n in d["word_ngrams"]),
            head_chars=int(d["head_chars"]),
            tail_chars=int(d["tail_chars"]),
        )


@dataclass(frozen=True)
class SparseRows:
    """A batch of feature rows in CSR form: row i is ``indices/values[indptr[i]:indptr[i+1]]``."""

    indptr: np.ndarray  # [n + 1] int64
    indices: np.ndarray  # [nnz] int64, < width
    values: np.ndarray  # [nnz] float32
    width: int

    @property
    def num_rows(self) -> int:
        return len(self.indptr) - 1

    def matmul(self, w: np.ndarray) -> np.ndarray:
        """``X @ w`` for ``w`` of shape [width, k] -> [n, k]. Every row is non-empty."""
        if self.num_rows == 0:
            return np.zeros((0, w.shape[1]), dtype=w.dtype)
        contrib = w[self.indices] * self.values[:, None]  # [nnz, k]
        return np.add.reduceat(contrib, self.indptr[:-1], axis=0)

    def rmatmul(self, g: np.ndarray) -> np.ndarray:
        """``X.T @ g`` for ``g`` of shape [n, k] -> [width, k]."""
        rows = np.repeat(np.arange(self.num_rows), np.diff(self.indptr))
        weighted = g[rows] * self.values[:, None]  # [nnz, k]
        cols = [
            np.bincount(self.indices, weights=weighted[:, c], minlength=self.width)
            for c in range(g.shape[1])
        ]
        return np.stack(cols, axis=1)

    def to_dense(self) -> np.ndarray:
        """The rows as a dense [n, width] float32 array."""
        out = np.zeros((self.num_rows, self.width), dtype=np.float32)
        out[np.repeat(np.arange(self.num_rows), np.diff(self.indptr)), self.indices] = self.values
        return out

    def take(self, rows: Sequence[int] | np.ndarray) -> SparseRows:
        """The sub-batch of the given rows, in that order."""
        parts = [np.arange(self.indptr[r], self.indptr[r + 1]) for r in rows]
        sel = np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)
        lens = np.array([len(p) for p in parts], dtype=np.int64)
        indptr = np.concatenate([[0], np.cumsum(lens)]).astype(np.int64)
        return SparseRows(indptr, self.indices[sel], self.values[sel], self.width)


def _clip_text(text: str, spec: FeatureSpec) -> str:
    if len(text) <= spec.head_chars + spec.tail_chars:
        return text
    return text[: spec.head_chars] + "\n" + text[len(text) - spec.tail_chars :]


def _hash_ids(text: str, spec: FeatureSpec) -> np.ndarray:
    """Hash bucket ids (with repeats) of the n-grams of one lower-cased, clipped prompt."""
    ids: list[np.ndarray] = []
    raw = np.frombuffer(text.encode("utf-8", "replace"), dtype=np.uint8).astype(np.uint64)
    for n in spec.char_ngrams:
        if len(raw) < n:
            continue
        h = np.full(len(raw) - n + 1, n, dtype=np.uint64) * _MIX
        for j in range(n):
            h = (h ^ raw[j : len(raw) - n + 1 + j]) * _FNV_PRIME
        ids.append(h >> np.uint64(17))
    words = np.array([zlib.crc32(w.encode("utf-8")) for w in _WORD.findall(text)], np.uint64)
    for n in spec.word_ngrams:
        if len(words) < n:
            continue
        h = np.full(len(words) - n + 1, 100 + n, dtype=np.uint64) * _MIX
        for j in range(n):
            h = (h ^ words[j : len(words) - n + 1 + j]) * _FNV_PRIME
        ids.append(h >> np.uint64(17))
    if not ids:
        return np.zeros(0, dtype=np.int64)
    return (np.concatenate(ids) % np.uint64(spec.dim)).astype(np.int64)


def _dense(text: str) -> list[float]:
    """Length features, scaled to about [0, 1] for prompts up to ~20k characters."""
    chars = math.log1p(len(text)) / 10.0
    words = math.log1p(len(text.split())) / 8.0
    lines = math.log1p(text.count("\n")) / 6.0
    return [chars, chars * chars, words, lines]


def featurize(prompts: Sequence[str], spec: FeatureSpec) -> SparseRows:
    """Feature rows of a batch of prompts."""
    indptr, indices, values = [0], [], []
    for prompt in prompts:
        ids, counts = np.unique(
            _hash_ids(_clip_text(prompt, spec).lower(), spec), return_counts=True
        )
        vals = np.log1p(counts.astype(np.float64))
        norm = float(np.sqrt(np.sum(vals * vals)))
        if norm > 0:
            vals /= norm
        dense = np.array(_dense(prompt))
        indices.append(np.concatenate([ids, spec.dim + np.arange(NUM_DENSE)]))
        values.append(np.concatenate([vals, dense]))
        indptr.append(indptr[-1] + len(ids) + NUM_DENSE)
    if not prompts:
        return SparseRows(
            np.zeros(1, np.int64), np.zeros(0, np.int64), np.zeros(0, np.float32), spec.width
        )
    return SparseRows(
        np.array(indptr, dtype=np.int64),
        np.concatenate(indices).astype(np.int64),
        np.concatenate(values).astype(np.float32),
        spec.width,
    )
