"""The coupled baselines' step: prompts from a ``PrefillQueue`` and a greedy ``DecodeAdmission``
in one plan (the coupled worker and the simulator both plan with ``coupled_step_plan``)."""

from __future__ import annotations

from tetri_server.policy.chunker import coupled_chunked_plan, prefill_first_plan
from tetri_server.policy.decode import DecodeAdmission, DecodeStepPlan
from tetri_server.policy.prefill import ChunkSlice, PrefillQueue


def coupled_step_plan(
    queue: PrefillQueue,
    admission: DecodeAdmission,
    num_free_blocks: int,
    *,
    chunked: bool,
    token_budget: int,
    max_batch: int,
    max_prefill_tokens: int,
    block_size: int = 16,
) -> tuple[DecodeStepPlan | None, tuple[ChunkSlice, ...]]:
    """One step of a coupled worker (the baselines): prompts in ``queue``, prefilled requests in
    a greedy ``admission``. Prefill-first (vLLM-like): whole prompts when any can start, the
    decode batch pauses (None); chunked (Sarathi-like): the admission's batch plus prompt slices
    filling ``token_budget`` (a recompute after a preemption takes its tokens from what the
    rows leave of it first), within the blocks the batch leaves free. Either way a prompt
    starts only in blocks the admission's waiting head does not need (``head_need``: a
    preempted request is not overtaken by new prompts, as in vLLM). Both the coupled worker
    and the simulator plan with this."""
    room = max(0, max_batch - len(admission))
    if not chunked:
        slices = prefill_first_plan(
            queue, (), max_prefill_tokens, max_seqs=room,
            num_free_blocks=max(0, num_free_blocks - admission.head_need()),
            block_size=block_size).slices
        return (None if slices else admission.plan(num_free_blocks)), slices
    # a recompute's tokens take room of the budget: at most what the rows leave, and less the
    # slices' share
    decode = admission.plan(num_free_blocks,
                            recompute_room=token_budget - len(admission.running_ids))
    slices = coupled_chunked_plan(queue, decode.run_ids,
                                  token_budget - decode.num_recompute_tokens,
                                  max_seqs=room + len(decode.run_ids),
                                  num_free_blocks=admission.prompt_room(decode, num_free_blocks),
                                  block_size=block_size).slices
    return decode, slices

