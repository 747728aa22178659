"""Output lengths refined while a request decodes: the remaining length conditioned on the
tokens already generated, from the length distribution of the request's predicted bucket.

The paper sizes a decode by the lower end of its predicted bucket and says nothing once the
request outgrows it. A request that has generated ``g`` tokens and not stopped has ``L > g``, so
its expected total is ``E[min(L, max_tokens) | L > g, bucket]``: it starts near the bucket's
mean (not its lower end) and follows the tail of the distribution as the request runs — for a
heavy tail the expected remaining length grows with ``g``, which a bucket's lower end never
says. ``DecodeAdmission`` reserves by it (reserve-static / reserve-dynamic footprints) and,
under memory pressure, preempts the request expected to run longest.

The histograms come from real lengths (``predictor/tails.py`` builds them with the predictor
artifact); this module only does arithmetic on them. Immutable after construction.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from itertools import accumulate
from typing import Any


class LengthTail:
    """Per-bucket histograms of output lengths in bins of ``bin_tokens`` tokens.

    ``counts[b][j]``: responses of bucket ``b`` whose length is in ``[j*bin_tokens,
    (j+1)*bin_tokens)``; ``sums[b][j]``: the sum of their lengths (tokens). A bucket past the
    last one given uses the last (an open top bucket). ``clip``: the generation cap of the data
    (the artifact's ``max_tokens``): a response of that length was cut there, so its true
    length is only known to be at least ``clip`` (censored); ``None``: no response was cut.
    """

    def __init__(
        self,
        bin_tokens: int,
        counts: Sequence[Sequence[int]],
        sums: Sequence[Sequence[int]],
        clip: int | None = None,
    ) -> None:
        if bin_tokens < 1 or not counts or len(counts) != len(sums):
            raise ValueError("need bin_tokens >= 1 and one counts and sums row per bucket")
        if clip is not None and clip < 1:
            raise ValueError(f"clip must be >= 1, got {clip}")
        for c, s in zip(counts, sums, strict=True):
            if len(c) != len(s) or min(c, default=0) < 0 or min(s, default=0) < 0:
                raise ValueError("counts and sums rows must have equal, non-negative entries")
        self.bin_tokens = bin_tokens
        self.clip = clip
        self.counts = tuple(tuple(int(x) for x in row) for row in counts)
        self.sums = tuple(tuple(int(x) for x in row) for row in sums)
        # suffix sums: _count_ge[b][j] responses in bins >= j, _sum_ge[b][j] their total length
        self._count_ge = tuple(_suffix(row) for row in self.counts)
        self._sum_ge = tuple(_suffix(row) for row in self.sums)

    @property
    def num_buckets(self) -> int:
        return len(self.counts)

    @staticmethod
    def from_lengths(
        lengths: Mapping[int, Sequence[int]], num_buckets: int, bin_tokens: int
    ) -> LengthTail:
        """Histograms of ``lengths[bucket]`` (tokens); buckets without lengths stay empty."""
        top = max((n for ls in lengths.values() for n in ls), default=0)
        num_bins = top // bin_tokens + 1
        counts = [[0] * num_bins for _ in range(num_buckets)]
        sums = [[0] * num_bins for _ in range(num_buckets)]
        for b, ls in lengths.items():
            for n in ls:
                counts[b][n // bin_tokens] += 1
                sums[b][n // bin_tokens] += n
        return LengthTail(bin_tokens, counts, sums)

    def to_json(self) -> dict[str, Any]:
        return {
            "bin_tokens": self.bin_tokens,
            "counts": [list(c) for c in self.counts],
            "sums": [list(s) for s in self.sums],
        }

    @staticmethod
    def from_json(d: Mapping[str, Any], clip: int | None = None) -> LengthTail:
        return LengthTail(int(d["bin_tokens"]), d["counts"], d["sums"], clip)

    def expected_output(self, bucket: int, num_generated: int, max_tokens: int) -> int | None:
        """``ceil(E[min(L, max_tokens) | L > num_generated, bucket])`` in tokens, at least
        ``num_generated + 1`` and at most ``max_tokens``; ``None`` when no response of the
        bucket is that long (the caller falls back to the bucket estimate).

        Resolution is one bin: the bin holding ``num_generated`` counts whole, and lengths in
        the bin holding ``max_tokens`` count as ``max_tokens`` (an over-estimate < one bin).
        Censored responses (``clip``) ran at least to the clip, how much further the data
        cannot say: from the clip's bin on each counts as ``2 x clip`` (at most
        ``max_tokens``), and a request that has generated ``g >= clip`` tokens is expected to
        run to ``g + clip`` (at most ``max_tokens``): a mean remaining length of one clip past
        the cut. (Counting them as ``max_tokens`` made a short request whose ``max_tokens`` is
        the rest of a long context reserve thousands of tokens.)
        """
        row = min(max(bucket, 0), self.num_buckets - 1)
        count_ge, sum_ge = self._count_ge[row], self._sum_ge[row]
        num_bins = len(count_ge) - 1
        cap = max_tokens if self.clip is None else min(max_tokens, self.clip)
        k = min(min(num_generated, cap) // self.bin_tokens, num_bins)
        if count_ge[k] == 0:
            return None
        if num_generated >= cap:  # only censored responses are this long
            return max_tokens if self.clip is None else min(max_tokens,
                                                            num_generated + self.clip)
        past = (max_tokens if self.clip is None or max_tokens <= self.clip
                else min(max_tokens, 2 * self.clip))  # what a length at or past the cap counts
        c = min(max(cap // self.bin_tokens, k), num_bins)  # bins >= c count as ``past``
        total = sum_ge[k] - sum_ge[c] + past * count_ge[c]
        est = -(-total // count_ge[k])
        return max(min(est, max_tokens), min(num_generated + 1, max_tokens))


def _suffix(row: Sequence[int]) -> tuple[int, ...]:
    """``out[j] = sum(row[j:])``, with ``out[len(row)] = 0``."""
    return tuple(list(accumulate(reversed(row), initial=0))[::-1])
