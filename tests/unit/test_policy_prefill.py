"""Prefill queue ordering, chunking and the coupled step planners, on hand-made queues."""

from __future__ import annotations

import pytest

from tetri_server.policy import (
    Chunker,
    ChunkPlan,
    PrefillQueue,
    coupled_chunked_plan,
    prefill_first_plan,
)


def make_queue(lengths: list[int], policy: str = "fcfs", sched_batch: int = 16) -> PrefillQueue:
    queue = PrefillQueue(policy, sched_batch)  # type: ignore[arg-type]
    for i, n in enumerate(lengths):
        queue.add(i, n, arrival_s=float(i))
    return queue


def order(queue: PrefillQueue) -> list[int]:
    return [p.req_id for p in queue.order()]


def run_all(queue: PrefillQueue, chunker: Chunker) -> list[tuple[ChunkPlan, list[int]]]:
    """Plan and 'execute' until the queue is empty."""
    out = []
    while (plan := chunker.plan(queue)) is not None:
        out.append((plan, chunker.on_done(queue, plan)))
    return out


def test_fcfs_orders_by_arrival_time_not_insertion() -> None:
    queue = PrefillQueue("fcfs")
    queue.add(7, 10, arrival_s=2.0)
    queue.add(8, 10, arrival_s=1.0)  # re-queued request with an older arrival
    queue.add(9, 10, arrival_s=3.0)
    assert order(queue) == [8, 7, 9]


def test_sjf_reorders_only_within_the_window() -> None:
    queue = make_queue([400, 300, 200, 100, 50, 10], "sjf", sched_batch=4)
    # the two short late arrivals do not jump ahead of the first round
    assert order(queue) == [3, 2, 1, 0, 5, 4]


def test_ljf_sorts_descending_within_window_and_keeps_fcfs_on_ties() -> None:
    queue = make_queue([100, 300, 100, 300, 999], "ljf", sched_batch=4)
    assert order(queue) == [1, 3, 0, 2, 4]


def test_started_request_stays_at_head_until_its_prompt_is_done() -> None:
    queue = make_queue([3000], "sjf")
    chunker = Chunker(512)
    plan = chunker.plan(queue)
    assert plan is not None
    chunker.on_done(queue, plan)
    queue.add(1, 10, arrival_s=5.0)  # much shorter, but prefill is non-preemptive
    plan = chunker.plan(queue)
    assert plan is not None
    assert [(s.req_id, s.start, s.num_tokens) for s in plan.slices] == [(0, 512, 512)]


def test_a_round_is_frozen_once_started_so_later_arrivals_cannot_overtake_it() -> None:
    queue = make_queue([300, 200], "sjf", sched_batch=3)
    chunker = Chunker(128)
    plan = chunker.plan(queue)
    assert plan is not None and plan.req_ids == (1,)
    chunker.on_done(queue, plan)
    queue.add(2, 10, arrival_s=9.0)  # fits the window's free slot, but the round is closed
    assert order(queue) == [1, 0, 2]


def test_long_prompt_becomes_six_chunks_with_only_the_last_padded() -> None:
    queue = make_queue([3000])
    steps = run_all(queue, Chunker(512))
    assert len(steps) == 6
    assert [plan.num_pad for plan, _ in steps] == [0, 0, 0, 0, 0, 6 * 512 - 3000]
    assert [plan.slices[0].start for plan, _ in steps] == [0, 512, 1024, 1536, 2048, 2560]
    assert [plan.slices[0].is_last for plan, _ in steps] == [False] * 5 + [True]
    assert [done for _, done in steps] == [[], [], [], [], [], [0]]
    assert all(plan.num_tokens + plan.num_pad == 512 for plan, _ in steps)


def test_five_short_prompts_pack_into_one_chunk() -> None:
    queue = make_queue([100, 90, 80, 70, 60])
    steps = run_all(queue, Chunker(512))
    assert len(steps) == 1
    plan, done = steps[0]
    assert plan.req_ids == (0, 1, 2, 3, 4)
    assert plan.num_pad == 512 - 400
    assert all(s.is_first and s.is_last for s in plan.slices)
    assert done == [0, 1, 2, 3, 4]


def test_tetris_packing_splits_a_prompt_across_a_chunk_boundary() -> None:
    queue = make_queue([300, 300, 100])
    steps = run_all(queue, Chunker(512))
    shapes = [[(s.req_id, s.start, s.num_tokens) for s in p.slices] for p, _ in steps]
    assert shapes == [[(0, 0, 300), (1, 0, 212)], [(1, 212, 88), (2, 0, 100)]]
    assert [p.num_pad for p, _ in steps] == [0, 512 - 188]
    assert [done for _, done in steps] == [[0], [1, 2]]


def test_abort_mid_prompt_drops_the_request_and_its_in_flight_slice() -> None:
    queue = make_queue([1000, 50])
    chunker = Chunker(512)
    plan = chunker.plan(queue)
    assert plan is not None
    assert queue.remove(0)
    assert chunker.on_done(queue, plan) == []  # the aborted slice is ignored
    assert order(queue) == [1]
    assert not queue.remove(0)


def test_free_blocks_gate_new_requests_without_overtaking() -> None:
    queue = make_queue([1024, 16])  # 64 blocks, then 1 block (block_size 16)
    chunker = Chunker(512, block_size=16)
    assert chunker.plan(queue, num_free_blocks=10) is None  # the short one may not overtake
    plan = chunker.plan(queue, num_free_blocks=64)
    assert plan is not None and plan.req_ids == (0,)
    chunker.on_done(queue, plan)
    plan = chunker.plan(queue, num_free_blocks=0)  # a started request holds its blocks already
    assert plan is not None and plan.req_ids == (0,) and plan.num_pad == 0


def test_max_seqs_limits_packing() -> None:
    plan = Chunker(512, max_seqs=2).plan(make_queue([10, 10, 10]))
    assert plan is not None and plan.req_ids == (0, 1) and plan.num_pad == 492


def test_num_queued_tokens_counts_remaining_prompt_tokens() -> None:
    queue = make_queue([1000, 50])
    chunker = Chunker(512)
    plan = chunker.plan(queue)
    assert plan is not None
    chunker.on_done(queue, plan)
    assert queue.num_queued_tokens == 1000 - 512 + 50
    assert len(queue) == 2 and 0 in queue


def test_invalid_arguments_are_refused() -> None:
    with pytest.raises(ValueError):
        PrefillQueue("lifo")  # type: ignore[arg-type]
    queue = make_queue([10])
    with pytest.raises(ValueError):
        queue.add(0, 10, 0.0)
    with pytest.raises(ValueError):
        queue.add(1, 0, 0.0)


def test_coupled_chunked_plan_fills_the_budget_left_by_decodes() -> None:
    queue = make_queue([1000, 20])
    step = coupled_chunked_plan(queue, [7, 8, 9], 512)
    assert step.decode_req_ids == (7, 8, 9)
    assert [(s.req_id, s.num_tokens) for s in step.slices] == [(0, 509)]
    assert step.num_tokens == 512
    busy = coupled_chunked_plan(queue, list(range(600)), 512)
    assert busy.slices == () and len(busy.decode_req_ids) == 600


def test_prefill_first_plan_pauses_decodes_and_never_splits() -> None:
    queue = make_queue([1000, 20, 30])
    step = prefill_first_plan(queue, [7, 8], 512)
    # the head runs whole even beyond the budget; nothing else fits after it
    assert step.decode_req_ids == () and [s.num_tokens for s in step.slices] == [1000]
    queue.advance(step.slices)
    step = prefill_first_plan(queue, [7, 8], 512)
    assert [s.req_id for s in step.slices] == [1, 2]
    queue.advance(step.slices)
    assert prefill_first_plan(queue, [7, 8], 512).decode_req_ids == (7, 8)


def shapes(plan: ChunkPlan | None) -> list[tuple[int, int, int]]:
    assert plan is not None
    return [(s.req_id, s.start, s.num_tokens) for s in plan.slices]


def started_long_then(shorts: list[int], chunk: int = 512, **kw) -> tuple[PrefillQueue, Chunker]:
    """A 3000-token prompt whose first chunk ran, then ``shorts`` waiting behind it."""
    queue = make_queue([3000])
    chunker = Chunker(chunk, **kw)
    chunker.on_done(queue, chunker.plan(queue))  # type: ignore[arg-type]
    for i, n in enumerate(shorts, start=1):
        queue.add(i, n, arrival_s=float(i))
    return queue, chunker


def test_with_an_overtake_share_short_prompts_go_ahead_of_a_started_long_one() -> None:
    """Shortest remaining work first at step granularity: prompts that fit whole in half the
    chunk ride in the next chunk; the started prompt fills the rest, and stays the head."""
    queue, chunker = started_long_then([100, 300, 120], overtake_share=0.5)
    plan = chunker.plan(queue)
    # 100 fits the 256 tokens, 300 does not, 120 fits what is left; the head takes the rest
    assert shapes(plan) == [(0, 512, 292), (1, 0, 100), (3, 0, 120)]
    assert plan is not None and plan.num_pad == 0
    assert chunker.on_done(queue, plan) == [1, 3]
    assert order(queue) == [0, 2]
    assert shapes(chunker.plan(queue)) == [(0, 804, 512)]  # 300 > 256: it waits its turn


def test_without_an_overtake_share_prefill_stays_non_preemptive() -> None:
    queue, chunker = started_long_then([100])
    assert shapes(chunker.plan(queue)) == [(0, 512, 512)]


def test_overtaking_keeps_the_started_prompts_share_and_finishes_every_prompt() -> None:
    """A stream of short prompts, one per chunk, cannot hold the long one to less than the
    unshared part of each chunk; every prompt is prefilled exactly once, in order of its
    tokens."""
    queue, chunker = started_long_then([], overtake_share=0.25)
    progress, done = [512], []
    for step in range(1, 40):
        if step <= 12:
            queue.add(step, 100, arrival_s=float(step))
        if not len(queue):
            break
        plan = chunker.plan(queue)
        assert plan is not None
        head = [s for s in plan.slices if s.req_id == 0]
        if head:
            assert head[0].start == progress[-1]
            assert head[0].num_tokens == min(412, 3000 - progress[-1])
            progress.append(head[0].end)
        done += chunker.on_done(queue, plan)
    assert progress[-1] == 3000 and sorted(done) == list(range(13))
    assert done[:7] == [1, 2, 3, 4, 5, 6, 0]  # each short one in the chunk after it came


def test_an_overtaker_that_lacks_blocks_is_skipped_and_the_started_head_still_runs() -> None:
    queue, chunker = started_long_then([400, 64], overtake_share=0.9, block_size=16)
    # no free blocks: nothing new starts, the started head runs alone
    assert shapes(chunker.plan(queue, num_free_blocks=0)) == [(0, 512, 512)]
    # 4 blocks: the 400-token prompt (25 blocks) is skipped, the 64-token one (4) overtakes
    assert shapes(chunker.plan(queue, num_free_blocks=4)) == [(0, 512, 448), (2, 0, 64)]


def test_no_overtaking_while_the_head_has_not_started() -> None:
    """Overtaking an unstarted head could hold its blocks off for ever; the head's own pass
    starts it, and the next one lets short prompts by."""
    queue = make_queue([3000, 50])
    chunker = Chunker(512, overtake_share=0.5, block_size=16)
    assert shapes(chunker.plan(queue, num_free_blocks=200)) == [(0, 0, 512)]


def test_the_overtakers_leave_a_sequence_slot_for_the_head() -> None:
    queue, chunker = started_long_then([10, 10, 10], overtake_share=0.5, max_seqs=3)
    assert shapes(chunker.plan(queue)) == [(0, 512, 492), (1, 0, 10), (2, 0, 10)]


def test_mixed_steps_share_their_prompt_tokens_the_same_way() -> None:
    queue, _ = started_long_then([40, 40])
    plan = coupled_chunked_plan(queue, [7, 8], 130, overtake_share=0.5)
    assert plan.decode_req_ids == (7, 8)
    assert [(s.req_id, s.start, s.num_tokens) for s in plan.slices] == [(0, 512, 88), (1, 0, 40)]


@pytest.mark.parametrize("share", [-0.1, 1.0])
def test_an_overtake_share_outside_0_to_1_is_refused(share: float) -> None:
    with pytest.raises(ValueError, match="overtake share"):
        Chunker(512, overtake_share=share)


# srpt: the fewest remaining prompt tokens first, preemptive at step granularity


def test_srpt_orders_the_whole_queue_by_remaining_tokens_not_a_window() -> None:
    queue = make_queue([400, 300, 200, 100, 50, 10, 50], "srpt", sched_batch=4)
    assert order(queue) == [5, 4, 6, 3, 2, 1, 0]  # equal lengths in arrival order


def test_srpt_pauses_a_started_prompt_for_a_shorter_one_and_resumes_it() -> None:
    """A prompt that needs two steps of its own runs before the rest of a started long one
    (the overtake share could not take it: it does not fit whole in a step); the long one
    resumes where it stopped, and is prefilled exactly once."""
    queue = make_queue([3000], "srpt")
    chunker = Chunker(512)
    chunker.on_done(queue, chunker.plan(queue))  # type: ignore[arg-type]
    queue.add(1, 700, arrival_s=5.0)
    assert shapes(chunker.plan(queue)) == [(1, 0, 512)]
    chunker.on_done(queue, chunker.plan(queue))  # type: ignore[arg-type]
    # 188 left of the 700 < 2488 left of the long one: it finishes, the long one fills the rest
    plan = chunker.plan(queue)
    assert shapes(plan) == [(1, 512, 188), (0, 512, 324)]
    assert chunker.on_done(queue, plan) == [1]  # type: ignore[arg-type]
    done = [chunker.on_done(queue, p) for p in iter(lambda: chunker.plan(queue), None)]
    assert sum(done, []) == [0] and len(queue) == 0


def test_srpt_lets_a_passed_over_prompt_go_first_after_starve_tokens() -> None:
    """A stream of short prompts, one a step, would hold a long one back for ever under plain
    srpt; once 1000 tokens of others have been prefilled past it, it goes first."""
    queue = PrefillQueue("srpt", starve_tokens=1000)
    queue.add(0, 2000, arrival_s=0.0)
    chunker = Chunker(300)
    served_before_long = 0
    for step in range(1, 30):
        queue.add(step, 300, arrival_s=float(step))
        plan = chunker.plan(queue)
        assert plan is not None
        if plan.slices[0].req_id == 0:
            break
        served_before_long += plan.num_tokens
        chunker.on_done(queue, plan)
    else:
        raise AssertionError("the long prompt never went first")
    assert 1000 < served_before_long <= 1300
    # from then on it keeps the head until done, shorter arrivals or not
    next_id = 100
    while 0 in queue:
        plan = chunker.plan(queue)
        assert plan is not None and plan.slices[0].req_id == 0
        chunker.on_done(queue, plan)
        queue.add(next_id, 10, arrival_s=99.0)
        next_id += 1


def test_srpt_runs_a_paused_prompt_when_a_shorter_one_lacks_blocks() -> None:
    """Without free blocks the shorter, unstarted prompt cannot start; the started one behind
    it in the order holds its blocks already and must still run (else nothing frees them)."""
    queue = make_queue([1024], "srpt")
    chunker = Chunker(512, block_size=16)
    chunker.on_done(queue, chunker.plan(queue, num_free_blocks=64))  # type: ignore[arg-type]
    queue.add(1, 100, arrival_s=1.0)  # 100 < 512 left: ahead of the started one
    queue.add(2, 50, arrival_s=2.0)  # ahead of both, and needs 4 blocks
    assert order(queue) == [2, 1, 0]
    assert shapes(chunker.plan(queue, num_free_blocks=0)) == [(0, 512, 512)]
    assert shapes(chunker.plan(queue, num_free_blocks=4)) == [(2, 0, 50), (0, 512, 462)]


def test_starve_tokens_below_one_is_refused() -> None:
    with pytest.raises(ValueError, match="starve_tokens"):
        PrefillQueue("srpt", starve_tokens=0)


def test_finish_alone_keeps_a_longer_prompts_slice_out_of_a_step_that_finishes_prompts() -> None:
    """The short prompts complete in a step of 60 tokens, not of 512: the long one's slice
    waits for the next step, which it has to itself."""
    queue = make_queue([3000], "srpt")
    chunker = Chunker(512, finish_alone=True)
    chunker.on_done(queue, chunker.plan(queue))  # type: ignore[arg-type]
    queue.add(1, 20, arrival_s=1.0)
    queue.add(2, 40, arrival_s=2.0)
    plan = chunker.plan(queue)
    assert shapes(plan) == [(1, 0, 20), (2, 0, 40)] and plan.num_pad == 452  # type: ignore[union-attr]
    chunker.on_done(queue, plan)  # type: ignore[arg-type]
    assert shapes(chunker.plan(queue)) == [(0, 512, 512)]
    # without it the step is filled with the long one's tokens
    queue.add(3, 20, arrival_s=3.0)
    assert shapes(Chunker(512).plan(queue)) == [(3, 0, 20), (0, 512, 492)]


def test_finish_alone_changes_nothing_while_the_first_prompt_does_not_complete() -> None:
    queue = make_queue([3000, 20], "fcfs")
    assert shapes(Chunker(512, finish_alone=True).plan(queue)) == [(0, 0, 512)]
    queue = make_queue([300, 400])
    # the first completes: the second's first 212 tokens stay out
    assert shapes(Chunker(512, finish_alone=True).plan(queue)) == [(0, 0, 300)]
