"""Length predictors for the simulator: the true bucket (oracle), or the true bucket with
probability ``accuracy`` and else a wrong one (the paper's 74.9% at g=200 emulated from the
true length). ``miss="neighbour"``: a miss falls one bucket up or down at random, clamped to
the range (a classifier's usual confusion); ``miss="uniform"``: any other bucket, uniformly (a
predictor whose misses are far off). Seeded: the same requests and seed give the same buckets
in every mode."""

from __future__ import annotations

import random

MISSES = ("neighbour", "uniform")


def num_buckets(granularity: int) -> int:
    """The server's bucket count at ``granularity``: a trained artifact's, whose last (open)
    bucket starts at the training clip (``TrainConfig.max_tokens``, 1024) whatever the context
    length, so a 1100-token output is in the open bucket in both."""
    from tetri_server.predictor.metrics import num_buckets_for
    from tetri_server.predictor.train import TrainConfig

    return num_buckets_for(granularity, TrainConfig.max_tokens)


class EmulatedPredictor:
    def __init__(self, *, granularity: int, num_buckets: int, accuracy: float = 1.0,
                 seed: int = 0, miss: str = "neighbour") -> None:
        if not 0.0 <= accuracy <= 1.0:
            raise ValueError(f"accuracy must be in [0, 1], got {accuracy}")
        if miss not in MISSES:
            raise ValueError(f"miss must be one of {MISSES}, got {miss!r}")
        if granularity < 1 or num_buckets < 1:
            raise ValueError("granularity and num_buckets must be >= 1")
        self.granularity = granularity
        self.num_buckets = num_buckets
        self.accuracy = accuracy
        self.miss = miss
        self._rng = random.Random(seed)

    def true_bucket(self, output_len: int) -> int:
        return min(output_len // self.granularity, self.num_buckets - 1)

    def predict(self, output_len: int) -> int:
        """One request's bucket; draws from the seeded generator once or twice."""
        bucket = self.true_bucket(output_len)
        if self.accuracy >= 1.0 or self._rng.random() < self.accuracy:
            return bucket
        if self.miss == "uniform" and self.num_buckets > 1:
            other = self._rng.randrange(self.num_buckets - 1)
            return other + (other >= bucket)
        if bucket == 0:
            return 1 if self.num_buckets > 1 else 0
        if bucket == self.num_buckets - 1:
            return bucket - 1
        return bucket + self._rng.choice((-1, 1))
