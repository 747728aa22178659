"""Per-request metrics that only the control process can take, from what it sees of a request:
its arrival, its first delta (the first token, when the prefilling worker scheduled its first
chunk, the length bucket it predicted), the hand-off (the KV blocks moved) and its last token.
Called on the control loop by the router and the cluster.

Queue time is arrival -> the worker's ``scheduled_s`` (both ``time.monotonic()``, one clock for
the host), prefill time the rest up to the first token at control (it includes the ring hop).
"""

from __future__ import annotations

from typing import Any

from tetri_server.config import Config
from tetri_server.control.requests import Request
from tetri_server.messages import Handoff, PoolHandle, TokenDelta
from tetri_server.predictor import LengthPredictor, load_predictor

ITEMSIZE = {"float32": 4, "float16": 2, "bfloat16": 2}  # PoolHandle.dtype -> bytes
FINISHED = ("stop", "length")  # finished with a known output length (abort: not)


def block_bytes(pool: PoolHandle) -> int:
    """Bytes of one KV block of ``pool`` (keys and values of every layer)."""
    return (pool.num_layers * 2 * pool.num_kv_heads * pool.block_size * pool.head_dim
            * ITEMSIZE.get(pool.dtype, 4))


class RequestAccounting:
    """Turns request events into ``Metrics`` calls; ``metrics`` may be ``NullMetrics``."""

    def __init__(self, cfg: Config, metrics: Any) -> None:
        self.metrics = metrics
        # the prefill workers' bucketing (granularity, bucket count) without their classifier
        self.buckets: LengthPredictor = load_predictor("none", cfg.predictor.artifact or None)

    def on_handoff(self, req: Request, msg: Handoff, src_pool: PoolHandle | None) -> None:
        """The Handoff of ``req`` is forwarded to its decode worker (again, after a refusal:
        its bytes count once, when pulled)."""
        req.predicted_bucket = msg.predicted_bucket
        req.handoff_bytes = (0 if src_pool is None
                             else len(msg.src_block_ids) * block_bytes(src_pool))

    def on_pulled(self, req: Request) -> None:
        """The decode worker copied the KV of ``req``'s hand-off."""
        if req.handoff_bytes:
            self.metrics.observe_handoff_bytes(req.handoff_bytes)
            req.handoff_bytes = 0

    def on_delta(self, req: Request, delta: TokenDelta, now_s: float) -> None:
        """New tokens of ``req`` reached control at ``now_s`` (``req.output_ids`` has them).
        The first delta's fields count once: a re-run's first delta does not replace them."""
        if delta.token_ids and req.first_token_s is None:
            req.first_token_s = now_s
            req.scheduled_s = delta.scheduled_s
        if req.predicted_bucket < 0 <= delta.predicted_bucket:  # also what never hands off
            req.predicted_bucket = delta.predicted_bucket
        if delta.finish_reason in FINISHED:
            self.on_finished(req, delta.finish_reason, now_s)

    def on_finished(self, req: Request, reason: str, now_s: float) -> None:
        """``req`` finished with ``reason`` (stop or length) at ``now_s``: its last token, or a
        stop string the API matched (it then aborts the request on its workers)."""
        if req.first_token_s is None:
            return
        queue_s = None if req.scheduled_s is None else req.scheduled_s - req.arrival_s
        self.metrics.observe_request_times(queue_prefill_s=req.first_token_s - req.arrival_s,
                                           decode_s=now_s - req.first_token_s, queue_s=queue_s)
        if req.predicted_bucket >= 0:
            actual = self.buckets.bucket_of(len(req.output_ids))
            self.metrics.observe_prediction(req.predicted_bucket, actual, reason)
