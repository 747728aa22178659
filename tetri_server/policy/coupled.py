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
    filling ``token_budget`` (less the tokens a recompute after a preemption takes),
    within the blocks the batch leaves free. Either way a prompt
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
    decode = admission.plan(num_free_blocks)  # a recompute's tokens count against the budget
    slices = coupled_chunked_plan(queue, decode.run_ids,
                                  token_budget - (decode.num_tokens - len(decode.run_ids)),
                                  max_seqs=room + len(decode.run_ids),
                                  num_free_blocks=admission.prompt_room(decode, num_free_blocks),
                                  block_size=block_size).slices
    return decode, slices


def coupled_recompute_chunk(recompute_tokens: int, chunked: bool, token_budget: int) -> int:
    """The coupled admission's ``recompute_chunk``: ``decode.recompute_tokens`` (0: whole), and
    in chunked mode at most the step's token budget."""
    if not chunked:
        return recompute_tokens
    return min(recompute_tokens, token_budget) if recompute_tokens else token_budget
