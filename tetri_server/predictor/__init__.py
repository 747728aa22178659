"""Output-length predictors: prompt -> output-length bucket (TetriInfer §3.3.2).

``load_predictor(kind, artifact)`` builds one at start-up; a missing or corrupt artifact raises
``PredictorError`` there, never at the first request. Kinds:

- ``classifier`` (default): hashed n-gram features + a softmax head trained on real prompts and
  response lengths (``tools/train_predictor.py``); the head ships in ``predictor/artifacts``.
- ``oracle``: the bucket of the true output length passed with each request (experiments).
- ``none``: every request in bucket 0.

``oracle`` and ``none`` take their granularity and bucket count from the artifact (default:
the shipped one), so all three kinds bucket lengths the same way.
"""

from __future__ import annotations

from pathlib import Path

from tetri_server.predictor.base import (
    LengthPredictor,
    NonePredictor,
    OraclePredictor,
    PredictorError,
)

KINDS = ("classifier", "oracle", "none")

__all__ = [
    "KINDS",
    "LengthPredictor",
    "NonePredictor",
    "OraclePredictor",
    "PredictorError",
    "load_predictor",
]


def load_predictor(kind: str = "classifier", artifact: str | Path | None = None) -> LengthPredictor:
    """Build the predictor of ``kind``; ``artifact`` is a shipped name or a NAME(.json) path."""
    from tetri_server.predictor import artifact as artifact_io

    if kind == "classifier":
        from tetri_server.predictor.classifier import ClassifierPredictor

        return ClassifierPredictor(artifact)
    if kind in ("oracle", "none"):
        meta = artifact_io.read_meta(artifact_io.resolve(artifact))
        cls = OraclePredictor if kind == "oracle" else NonePredictor
        return cls(int(meta["granularity"]), int(meta["num_buckets"]))
    raise ValueError(f"unknown predictor kind {kind!r}; expected one of {', '.join(KINDS)}")
