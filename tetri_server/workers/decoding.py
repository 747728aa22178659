"""What every role does the same way when it carries out a plan on its own sequences: a
``DecodeStepPlan`` (decode, coupled, and a prefill worker that keeps requests) and the blocks of
the prompts a step's slices start (prefill, coupled, and a decode worker that prefills)."""

from __future__ import annotations

from collections.abc import Callable
from collections.abc import Sequence as Seq

from tetri_server.engine.runner import ScheduledSeq
from tetri_server.engine.sequence import Sequence
from tetri_server.kv.manager import KVCacheManager
from tetri_server.policy import ChunkSlice, DecodeStepPlan
from tetri_server.policy.chunker import reserved_slices


def carry_out(plan: DecodeStepPlan, seqs: dict[int, Sequence], kv: KVCacheManager
              ) -> tuple[list[ScheduledSeq], list[int], DecodeStepPlan]:
    """Preempt (drop the KV; recomputed when re-admitted), drop from ``seqs`` what can never
    fit, reserve the batch's blocks (a recompute's whole context). Returns the batch's items
    (each row's tokens as the plan gives them: a recompute may take several steps, and samples
    nothing until its last), the dropped requests (the caller fails them) and the plan carried
    out, which the caller passes to ``on_done``.

    The admission counts free blocks, but a sequence's blocks are one extent: while extents
    are pinned (a prefill worker's un-acked hand-offs, which compaction cannot move), enough
    free blocks may hold no run long enough for a row's growth. Such a row sits this step out
    (the plan carried out leaves it out; its KV and tokens stay) until an ack unpins them.
    With nothing pinned, a row that does not fit means the admission and the allocator
    disagree: an error."""
    for req_id in plan.preempt.req_ids:
        seq = seqs[req_id]
        kv.free(seq)
        seq.num_computed = 0
    for req_id in plan.fail_ids:
        kv.free(seqs.pop(req_id))
    items, waiting = [], []
    for req_id in plan.run_ids:
        seq = seqs[req_id]
        if not kv.reserve(seq, seq.num_tokens):
            if not kv.num_pinned:
                raise RuntimeError(f"admission planned request {req_id} but its blocks do not "
                                   "fit: allocator and policy disagree")
            waiting.append(req_id)
            continue
        if seq.num_uncomputed != plan.lacking(req_id):
            raise RuntimeError(f"admission planned request {req_id} as lacking "
                               f"{plan.lacking(req_id)} tokens of KV, it lacks "
                               f"{seq.num_uncomputed}: allocator and policy disagree")
        items.append(ScheduledSeq(seq, plan.row_tokens(req_id)))
    return items, list(plan.fail_ids), plan.without(waiting)


def reserve_prompts(slices: Seq[ChunkSlice], seq_of: Callable[[int], Sequence],
                    kv: KVCacheManager, items: list[ScheduledSeq]) -> tuple[ChunkSlice, ...]:
    """Blocks for the whole prompt of each request a slice starts (``reserved_slices``: from
    the first that does not fit, no prompt starts, started ones still run). The kept slices'
    items are appended to ``items``; returns the kept slices."""
    def reserve(piece: ChunkSlice) -> bool:
        seq = seq_of(piece.req_id)
        return kv.reserve(seq, seq.num_prompt)

    kept = reserved_slices(slices, reserve)
    items.extend(ScheduledSeq(seq_of(piece.req_id), piece.num_tokens) for piece in kept)
    return kept
