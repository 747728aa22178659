"""Carrying out a ``DecodeStepPlan`` on a worker's own sequences: the part every role that
decodes (decode, coupled, and a prefill worker that keeps requests) does the same way."""

from __future__ import annotations

from tetri_server.engine.runner import ScheduledSeq
from tetri_server.engine.sequence import Sequence
from tetri_server.kv.manager import KVCacheManager
from tetri_server.policy import DecodeStepPlan


def carry_out(plan: DecodeStepPlan, seqs: dict[int, Sequence],
              kv: KVCacheManager) -> tuple[list[ScheduledSeq], list[int]]:
    """Preempt (drop the KV; recomputed when re-admitted), drop from ``seqs`` what can never
    fit, reserve the batch's blocks. Returns the batch's items and the dropped requests (the
    caller fails them)."""
    for req_id in plan.preempt.req_ids:
        seq = seqs[req_id]
        kv.free(seq)
        seq.num_computed = 0
    for req_id in plan.fail_ids:
        kv.free(seqs.pop(req_id))
    recompute = set(plan.admit.recompute_ids)
    items = []
    for req_id in plan.run_ids:
        seq = seqs[req_id]
        if not kv.reserve(seq, seq.num_tokens):
            raise RuntimeError(f"admission planned request {req_id} but its blocks do not fit: "
                               "allocator and policy disagree")
        items.append(ScheduledSeq(seq, seq.num_uncomputed if req_id in recompute else 1))
    return items, list(plan.fail_ids)
