"""Per-request decode state and the reservation arithmetic behind ``DecodeAdmission``.

All sizes are in blocks of ``block_size`` tokens; see ``decode.py`` for the block invariant.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from tetri_server.policy.chunker import num_blocks_for
from tetri_server.policy.remaining import LengthTail


@dataclass
class DecodeSeq:
    """Mutable, owned by one ``DecodeAdmission``; never leaves it."""

    req_id: int
    num_prompt_tokens: int
    num_tokens: int  # prompt + generated; the last token's KV is not computed yet
    predicted_bucket: int  # the predictor's bucket; never changes
    max_tokens: int  # output cap from the sampling params
    bucket: int  # bucket of the current estimate: starts at predicted_bucket, raised on overrun
    est_output_tokens: int  # estimated output length: lower end of `bucket` (capped), or refined
    num_held_blocks: int  # 0 after a preemption: recompute on admission
    num_kv_tokens: int  # tokens whose KV is computed: num_tokens - 1, or fewer in a recompute

    @property
    def num_generated(self) -> int:
        return self.num_tokens - self.num_prompt_tokens

    @property
    def num_uncomputed(self) -> int:
        """Tokens the next step must compute before it samples: 1, or more in a recompute."""
        return self.num_tokens - self.num_kv_tokens

    @property
    def num_remaining_tokens(self) -> int:
        """Predicted tokens still to generate."""
        return max(0, self.est_output_tokens - self.num_generated)

    def num_step_blocks(self, block_size: int) -> int:
        """New blocks the next step needs (the whole context after a preemption)."""
        return num_blocks_for(self.num_tokens, block_size) - self.num_held_blocks

    def num_footprint_blocks(self, block_size: int) -> int:
        """Blocks held once the predicted output is complete."""
        num_out = max(self.est_output_tokens, self.num_generated)
        return num_blocks_for(self.num_prompt_tokens + num_out, block_size)

    def num_reserved_blocks(self, block_size: int) -> int:
        """Blocks the request will still take, by its estimate."""
        return max(0, self.num_footprint_blocks(block_size) - self.num_held_blocks)

    def num_blocks_after(self, num_steps: int, block_size: int) -> int:
        """Blocks held after ``num_steps`` more steps, or at its predicted end if sooner."""
        num_steps = min(num_steps, self.num_remaining_tokens)
        return num_blocks_for(self.num_tokens + num_steps, block_size)

    def raise_estimate(self, granularity: int) -> None:
        """Misprediction: once the request has generated its estimate and still runs, move
        the estimate up one bucket at a time (the lower end of the next bucket)."""
        self.bucket, self.est_output_tokens = raised_estimate(
            self.bucket, self.est_output_tokens, self.num_generated, granularity,
            self.max_tokens)

    def refine_estimate(self, tail: LengthTail, granularity: int) -> None:
        """The refined estimate: the expected total output given the tokens generated so far
        (``LengthTail``); past the longest length the bucket has data for, the bucket rule."""
        est = tail.expected_output(self.predicted_bucket, self.num_generated, self.max_tokens)
        if est is None:
            self.raise_estimate(granularity)
        else:
            self.est_output_tokens = est

    def is_heavy(self, granularity: int, heavy_threshold: int) -> bool:
        """Heavy decode: the predicted lower end (at most ``max_tokens``, as the dispatcher
        counts it) or the tokens generated so far exceed the threshold (128 in the paper).
        Raised estimates do not count: they are reservations."""
        return is_heavy(self.predicted_bucket, granularity, self.max_tokens,
                        self.num_generated, heavy_threshold)


def raised_estimate(bucket: int, est: int, num_generated: int, granularity: int,
                    max_tokens: int) -> tuple[int, int]:
    """(bucket, estimate) raised a bucket at a time (its lower end, at most ``max_tokens``)
    while ``num_generated`` reaches the estimate: the decode worker's rule, which the
    dispatcher counts by too."""
    while num_generated >= est and est < max_tokens:
        bucket += 1
        est = min(bucket * granularity, max_tokens)
    return bucket, est


def is_heavy(predicted_bucket: int, granularity: int, max_tokens: int, num_generated: int,
             heavy_threshold: int) -> bool:
    """Heavy decode: the predicted lower end (at most ``max_tokens``) or the tokens generated
    so far above the threshold (128 in the paper)."""
    predicted = min(predicted_bucket * granularity, max_tokens)
    return max(predicted, num_generated) > heavy_threshold


def fits_reserved(
    seq: DecodeSeq,
    batch: Sequence[DecodeSeq],
    num_free_blocks: int,
    block_size: int,
    dynamic: bool,
) -> bool:
    """Whether ``seq``'s predicted footprint fits beside ``batch`` (non-empty).

    Static: free now minus what the batch still reserves by its estimates. Dynamic, if static
    fails: let ``first`` be the batch member with the shortest predicted remaining output. Admit
    if nobody runs out of blocks before ``first`` finishes (everyone, ``seq`` included, grows
    until then) and ``seq``'s whole remaining footprint fits once ``first`` frees its blocks.
    """
    need = seq.num_reserved_blocks(block_size)
    reserved = sum(s.num_reserved_blocks(block_size) for s in batch)
    if need <= num_free_blocks - reserved:
        return True
    if not dynamic:
        return False
    first = min(batch, key=lambda s: s.num_remaining_tokens)  # min() keeps the oldest on ties
    num_steps = first.num_remaining_tokens
    growth = {
        id(s): s.num_blocks_after(num_steps, block_size) - s.num_held_blocks for s in (*batch, seq)
    }
    if sum(growth.values()) > num_free_blocks:
        return False
    growth_others = sum(growth[id(s)] for s in batch if s is not first)
    return need <= num_free_blocks - growth_others + first.num_held_blocks
