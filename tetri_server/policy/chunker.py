"""Forward-pass planning over a ``PrefillQueue``: TetriInfer's fixed-size chunks and the two
coupled baselines (Sarathi-like chunks riding on decode steps, vLLM-like prefill-first).

Contract, for every planner here: ``plan`` is pure (it reads the queue, never changes it); the
runtime executes the plan, then calls ``queue.advance(plan.slices)`` (``Chunker.on_done`` does)
to record progress. KV blocks: a request's blocks for its whole prompt are allocated by the
runtime when its first slice runs (``ChunkSlice.is_first``); given ``num_free_blocks`` the
planner never starts a request whose prompt does not fit, nor any behind it (no overtaking, so
a long prompt cannot starve behind short ones); started prompts behind it still run. The one
exception is opt-in (``num_overtake_tokens``, ``prefill.overtake_share``): while the head
prompt has started, a bounded part of each step goes to waiting prompts that fit in it whole,
blocks included. Such a prompt completes in the step it starts, so started prompts remain the
queue's head (in every order but srpt, which pauses them; ``policy/prefill.py``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from tetri_server.policy.prefill import ChunkSlice, PrefillQueue


def num_blocks_for(num_tokens: int, block_size: int) -> int:
    """Blocks needed to hold ``num_tokens`` tokens of KV."""
    return -(-num_tokens // block_size)


@dataclass(frozen=True)
class ChunkPlan:
    """One prefill-only forward pass of exactly ``chunk_size`` token slots: the slices packed
    in queue order, then ``num_pad`` padding slots (non-zero only when the queue ran out, or a
    ``max_seqs`` / free-block limit stopped packing). A runtime may skip computing the pad."""

    slices: tuple[ChunkSlice, ...]
    num_pad: int
    chunk_size: int

    @property
    def num_tokens(self) -> int:
        """Real (non-pad) tokens."""
        return self.chunk_size - self.num_pad

    @property
    def req_ids(self) -> tuple[int, ...]:
        return tuple(piece.req_id for piece in self.slices)

    def keep(self, kept: tuple[ChunkSlice, ...]) -> ChunkPlan:
        """This pass with only the ``kept`` slices (the rest become pad)."""
        return ChunkPlan(kept, self.chunk_size - sum(p.num_tokens for p in kept), self.chunk_size)


@dataclass(frozen=True)
class MixedStepPlan:
    """One coupled-mode step: every request in ``decode_req_ids`` decodes one token, and the
    prompt ``slices`` are prefilled, in one forward pass. No padding."""

    decode_req_ids: tuple[int, ...]
    slices: tuple[ChunkSlice, ...]

    @property
    def num_prefill_tokens(self) -> int:
        return sum(piece.num_tokens for piece in self.slices)

    @property
    def num_tokens(self) -> int:
        return len(self.decode_req_ids) + self.num_prefill_tokens


def take_slices(
    queue: PrefillQueue,
    num_budget_tokens: int,
    *,
    split: bool = True,
    max_seqs: int | None = None,
    num_free_blocks: int | None = None,
    block_size: int = 16,
    num_overtake_tokens: int = 0,
    finish_alone: bool = False,
) -> tuple[ChunkSlice, ...]:
    """Fill ``num_budget_tokens`` with prompt slices in queue order. ``split``: long prompts
    are cut at the budget; otherwise only whole remaining prompts are taken, except that the
    head is always taken whole (a prompt longer than the budget must still run).
    ``num_overtake_tokens`` (with ``split``): while the head has started, up to this many
    tokens go first to the waiting prompts that fit in them whole (``overtakers``); they come
    last in the returned slices, so a step cut short keeps the started head.
    ``finish_alone``: when the first prompt taken completes in this step, the step takes only
    prompts that complete in it (no slice of a longer one), so their first tokens wait for
    their own tokens, not for a full chunk."""
    ahead: tuple[ChunkSlice, ...] = ()
    if split and num_overtake_tokens > 0:
        ahead = overtakers(queue, min(num_overtake_tokens, num_budget_tokens),
                           max_seqs=max_seqs, num_free_blocks=num_free_blocks,
                           block_size=block_size)
    taken = {piece.req_id for piece in ahead}
    slices: list[ChunkSlice] = []
    budget = num_budget_tokens - sum(piece.num_tokens for piece in ahead)
    num_free = num_free_blocks
    if num_free is not None:
        num_free -= sum(num_blocks_for(piece.num_tokens, block_size) for piece in ahead)
    if max_seqs is not None:
        max_seqs -= len(ahead)
    no_new_starts = False  # a prompt that did not fit: none behind it starts (no overtaking)
    for prompt in queue.iter_order():
        if budget <= 0 or (max_seqs is not None and len(slices) >= max_seqs):
            break
        if prompt.req_id in taken or (no_new_starts and not prompt.started):
            continue
        n = min(budget, prompt.num_remaining_tokens) if split else prompt.num_remaining_tokens
        if not split and slices and n > budget:
            break
        if finish_alone and slices and slices[0].is_last and n < prompt.num_remaining_tokens:
            continue  # the step finishes prompts: no slice of a longer one rides along
        if num_free is not None and not prompt.started:
            need = num_blocks_for(prompt.num_prompt_tokens, block_size)
            if need > num_free:
                if not queue.preemptive:
                    break  # started prompts are all ahead of this one
                # Started prompts need no new blocks and may come later in the order (srpt
                # pauses them): they still run, or their blocks could never come back.
                no_new_starts = True
                continue
            num_free -= need
        slices.append(
            ChunkSlice(prompt.req_id, prompt.num_done_tokens, n, prompt.num_prompt_tokens)
        )
        budget -= n
    return (*slices, *ahead)


def reserved_slices(slices: Sequence[ChunkSlice],
                    reserve: Callable[[ChunkSlice], bool]) -> tuple[ChunkSlice, ...]:
    """The slices a step runs once the runtime has tried to give blocks to each prompt a slice
    starts (``reserve`` of a first slice: False if its blocks do not fit). The planner counted
    free blocks, but one extent per sequence means free blocks split into runs too short (around
    extents pinned by un-acked hand-offs) can still refuse a prompt. From the first refusal on no
    prompt starts (no overtaking: a long prompt never starves behind short ones), but started
    prompts keep their slices: they need no new blocks, and under srpt a paused one may come
    after the refused prompt. Before, the step stopped at the refusal and those waited too."""
    kept: list[ChunkSlice] = []
    refused = False
    for piece in slices:
        if piece.is_first and (refused or not reserve(piece)):
            refused = True
            continue
        kept.append(piece)
    return tuple(kept)


def check_overtake_share(share: float) -> None:
    """A share of 1 would let waiting prompts starve the started one."""
    if not 0 <= share < 1:
        raise ValueError(f"overtake share must be in [0, 1), got {share}")


def overtakers(
    queue: PrefillQueue,
    num_budget_tokens: int,
    *,
    max_seqs: int | None = None,
    num_free_blocks: int | None = None,
    block_size: int = 16,
) -> tuple[ChunkSlice, ...]:
    """Shortest remaining work first, at step granularity: while the queue's head has started
    (prefill is otherwise non-preemptive), the waiting prompts that fit whole in
    ``num_budget_tokens``, in queue order, skipping any that does not fit (in the tokens left,
    or in ``num_free_blocks``: a started head needs no new blocks, so a skip stalls nothing).
    One sequence slot is left for the head. Empty when the head has not started."""
    prompts = queue.iter_order()
    head = next(prompts, None)
    if head is None or not head.started:
        return ()
    out: list[ChunkSlice] = []
    budget, num_free = num_budget_tokens, num_free_blocks
    for prompt in prompts:
        if budget <= 0 or (max_seqs is not None and len(out) >= max_seqs - 1):
            break
        n = prompt.num_remaining_tokens
        if prompt.started or n > budget:
            continue
        need = num_blocks_for(n, block_size)
        if num_free is not None:
            if need > num_free:
                continue
            num_free -= need
        out.append(ChunkSlice(prompt.req_id, 0, n, n))
        budget -= n
    return tuple(out)


class Chunker:
    """TetriInfer's chunked prefill: every forward pass carries exactly ``chunk_size`` tokens
    (the throughput knee). Long prompts are split across passes, short ones packed together
    (Tetris), only the last pass before the queue runs dry is padded. ``overtake_share``:
    while a started prompt is at the head, up to this share of each pass goes first to
    waiting prompts that fit in it whole (``overtakers``); 0 = non-preemptive prefill.
    ``finish_alone``: a pass whose first prompt completes in it carries only prompts that
    complete in it (the rest is pad, which a runtime skips)."""

    def __init__(self, chunk_size: int, *, block_size: int = 16, max_seqs: int | None = None,
                 overtake_share: float = 0.0, finish_alone: bool = False):
        if chunk_size < 1:
            raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
        check_overtake_share(overtake_share)
        self.chunk_size = chunk_size
        self.block_size = block_size
        self.max_seqs = max_seqs
        self.overtake_share = overtake_share
        self.finish_alone = finish_alone

    def plan(self, queue: PrefillQueue, num_free_blocks: int | None = None) -> ChunkPlan | None:
        """The next forward pass, or None when nothing can run (empty queue, or no blocks for
        the head request)."""
        slices = take_slices(
            queue,
            self.chunk_size,
            max_seqs=self.max_seqs,
            num_free_blocks=num_free_blocks,
            block_size=self.block_size,
            num_overtake_tokens=int(self.overtake_share * self.chunk_size),
            finish_alone=self.finish_alone,
        )
        if not slices:
            return None
        num_real = sum(piece.num_tokens for piece in slices)
        return ChunkPlan(slices, self.chunk_size - num_real, self.chunk_size)

    def on_done(self, queue: PrefillQueue, plan: ChunkPlan) -> list[int]:
        """The pass ran: advance progress. Returns the requests whose prompt is complete (the
        runtime samples their first token and dispatches them)."""
        return queue.advance(plan.slices)


def coupled_chunked_plan(
    queue: PrefillQueue,
    decode_req_ids: Sequence[int],
    num_budget_tokens: int,
    *,
    max_seqs: int | None = None,
    num_free_blocks: int | None = None,
    block_size: int = 16,
    overtake_share: float = 0.0,
) -> MixedStepPlan:
    """Sarathi-like step: all running decodes (one token each) run; prompt slices fill what is
    left of the token budget. Decodes are never dropped for prefill, so a step may exceed the
    budget when there are more decodes than budget. ``max_seqs`` bounds the whole step.
    ``overtake_share``: of the prompt tokens, as ``Chunker``'s (checked there)."""
    num_left = max(0, num_budget_tokens - len(decode_req_ids))
    seq_room = None if max_seqs is None else max(0, max_seqs - len(decode_req_ids))
    slices = take_slices(
        queue,
        num_left,
        max_seqs=seq_room,
        num_free_blocks=num_free_blocks,
        block_size=block_size,
        num_overtake_tokens=int(overtake_share * num_left),
    )
    return MixedStepPlan(tuple(decode_req_ids), slices)


def prefill_first_plan(
    queue: PrefillQueue,
    decode_req_ids: Sequence[int],
    num_budget_tokens: int,
    *,
    max_seqs: int | None = None,
    num_free_blocks: int | None = None,
    block_size: int = 16,
) -> MixedStepPlan:
    """vLLM-like step (no chunking): if any whole prompt can start, the step prefills whole
    prompts up to the budget and decodes pause; otherwise every running request decodes."""
    slices = take_slices(
        queue,
        num_budget_tokens,
        split=False,
        max_seqs=max_seqs,
        num_free_blocks=num_free_blocks,
        block_size=block_size,
    )
    if slices:
        return MixedStepPlan((), slices)
    return MixedStepPlan(tuple(decode_req_ids), ())
