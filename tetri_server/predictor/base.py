"""The length-predictor contract and the two predictors that need no model: oracle and none."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence


class PredictorError(RuntimeError):
    """A predictor cannot be built (missing or corrupt artifact) or cannot answer a batch."""


class LengthPredictor(ABC):
    """Predicts the output-length bucket of each prompt in a batch.

    Bucket ``i`` covers ``[i*granularity, (i+1)*granularity)`` output tokens; the last bucket
    (``num_buckets - 1``) also takes everything longer. The prefill worker calls ``predict``
    once per sort window; schedulers size a request by ``lower_bound(bucket)`` (the paper uses
    the lower end of the range). Instances are immutable after construction and hold no
    per-request state, so one instance serves a whole process.
    """

    kind: str = ""

    def __init__(self, granularity: int, num_buckets: int) -> None:
        if granularity <= 0 or num_buckets <= 0:
            raise ValueError(
                f"granularity and num_buckets must be positive, got {granularity} and {num_buckets}"
            )
        self.granularity = granularity
        self.num_buckets = num_buckets

    @abstractmethod
    def predict(
        self, prompts: Sequence[str], true_lengths: Sequence[int | None] | None = None
    ) -> list[int]:
        """Bucket ids, one per prompt, in order. ``true_lengths`` is only read by ``oracle``."""

    def bucket_of(self, length: int) -> int:
        """The bucket of an output length in tokens."""
        return min(max(length, 0) // self.granularity, self.num_buckets - 1)

    def lower_bound(self, bucket: int) -> int:
        """Fewest output tokens a request in ``bucket`` is expected to generate."""
        self._check(bucket)
        return bucket * self.granularity

    def upper_bound(self, bucket: int) -> int | None:
        """End (exclusive) of the bucket's range in tokens; ``None`` for the open last bucket."""
        self._check(bucket)
        return None if bucket == self.num_buckets - 1 else (bucket + 1) * self.granularity

    def _check(self, bucket: int) -> None:
        if not 0 <= bucket < self.num_buckets:
            raise ValueError(f"bucket {bucket} out of range [0, {self.num_buckets})")

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(granularity={self.granularity}, num_buckets={self.num_buckets})"
        )


class OraclePredictor(LengthPredictor):
    """Bucket of the true output length passed with each request (experiments only).

    Every prompt must come with its true length: a missing one is an error, never a guess.
    """

    kind = "oracle"

    def predict(
        self, prompts: Sequence[str], true_lengths: Sequence[int | None] | None = None
    ) -> list[int]:
        if not prompts:
            return []
        if true_lengths is None or len(true_lengths) != len(prompts):
            raise PredictorError("oracle predictor needs one true length per prompt")
        buckets = []
        for i, n in enumerate(true_lengths):
            if n is None:
                raise PredictorError(f"oracle predictor: prompt {i} has no true length")
            buckets.append(self.bucket_of(int(n)))
        return buckets


class NonePredictor(LengthPredictor):
    """No prediction: every request is in bucket 0 (lower bound 0 tokens)."""

    kind = "none"

    def predict(
        self, prompts: Sequence[str], true_lengths: Sequence[int | None] | None = None
    ) -> list[int]:
        return [0] * len(prompts)

    def upper_bound(self, bucket: int) -> int | None:
        """None: bucket 0 here is no prediction, so it bounds nothing."""
        self._check(bucket)
        return None
