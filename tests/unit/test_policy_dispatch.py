"""Level-1 dispatch (prefill -> decode worker) on hand-made cluster views."""

from __future__ import annotations

import random

from tetri_server.messages import DecodeInstanceView, DecodeView
from tetri_server.policy import RoundRobinDispatcher, TetriDispatcher, num_blocks_for

BLOCK = 16


def inst(
    wid: int, free: int, heavy: int = 0, light: int = 0, demand: int = 0, total: int = 1000
) -> DecodeInstanceView:
    return DecodeInstanceView(wid, free, total, heavy, light, demand)


def tetri(seed: int = 0) -> TetriDispatcher:
    return TetriDispatcher(random.Random(seed), block_size=BLOCK, granularity=200)


def test_never_picks_a_decode_without_room() -> None:
    rng = random.Random(1)
    for trial in range(300):
        view = [
            inst(w, rng.randrange(0, 60), rng.randrange(5), rng.randrange(5), rng.randrange(20))
            for w in range(rng.randrange(1, 6))
        ]
        num_prompt, bucket = rng.randrange(1, 400), rng.randrange(3)
        # bucket 0: the decode worker raises its estimate to bucket 1's lower end at once
        need = num_blocks_for(num_prompt + max(bucket, 1) * 200, BLOCK)
        dispatcher = tetri(trial)
        dispatcher.on_view(DecodeView(seq=1, decodes=view))
        plan = dispatcher.plan(trial, num_prompt, bucket)
        roomy = {d.worker_id for d in view if d.num_free_blocks - d.predicted_demand_blocks >= need}
        if plan is None:
            assert not roomy
        else:
            assert plan.decode_worker in roomy and plan.num_blocks == need


def test_empty_alpha_holds_until_a_newer_view_has_room() -> None:
    dispatcher = tetri()
    assert dispatcher.plan(1, 100, 0) is None  # no view yet
    dispatcher.on_view(DecodeView(seq=1, decodes=[inst(0, free=2), inst(1, free=50, demand=49)]))
    assert dispatcher.plan(1, 100, 0) is None
    dispatcher.on_view(DecodeView(seq=2, decodes=[inst(0, free=2), inst(1, free=50)]))
    plan = dispatcher.plan(1, 100, 0)
    assert plan is not None and plan.decode_worker == 1


def test_a_view_resent_from_the_same_reports_keeps_counting_own_dispatches() -> None:
    dispatcher = tetri()
    dispatcher.on_view(DecodeView(seq=1, decodes=[inst(0, free=20)], generation=5))
    assert dispatcher.plan(1, 8, 0) is not None  # 8 + 200 tokens: 13 of the 20 free blocks
    dispatcher.on_view(DecodeView(seq=2, decodes=[inst(0, free=20)], generation=5))  # re-sent
    assert dispatcher.plan(2, 8, 0) is None  # 7 left: no room, as before the re-send
    dispatcher.on_view(DecodeView(seq=3, decodes=[inst(0, free=20)], generation=6))  # reports
    assert dispatcher.plan(2, 8, 0) is not None  # a newer report: its count is the truth


def test_another_decode_workers_report_does_not_forget_dispatches_to_this_one() -> None:
    """Regression (review of session 63): the view's generation moved with any decode
    worker's report, and a report of worker 2 wiped the dispatcher's count of what it had just
    sent to worker 1, whose entry was still its old report: request 2 went to worker 1 too,
    150 blocks promised against 100 free, and the hand-off was refused."""
    def view(seq: int, gen: int, seqs: tuple[int, int], free2: int) -> DecodeView:
        return DecodeView(seq, [DecodeInstanceView(1, 100, 1000, 0, 0, 0, report_seq=seqs[0]),
                                DecodeInstanceView(2, free2, 1000, 0, 0, 0,
                                                   report_seq=seqs[1])], gen)

    dispatcher = tetri()
    dispatcher.on_view(view(1, 2, (1, 2), 0))
    first = dispatcher.plan(1, 1000, 1)  # 1000 + 200 tokens: 75 blocks
    assert first is not None and first.decode_worker == 1
    assert dispatcher.plan(2, 1000, 1) is None
    dispatcher.on_view(view(2, 3, (1, 3), 0))  # worker 2 reported; worker 1 did not
    assert dispatcher.plan(2, 1000, 1) is None  # worker 1 still has 25 left of 100
    dispatcher.on_view(view(3, 4, (4, 3), 0))  # worker 1's newer report is the truth
    assert dispatcher.plan(2, 1000, 1) is not None


def test_round_robin_counts_what_it_checks_and_tetri_the_queued_prompts_too() -> None:
    """Review of session 63: the raised estimate of bucket 0 made round-robin, which checks
    room for the prompt alone, hold short requests a decode worker would take (7 of 20 sent);
    and the power-of-two dispatcher sent hand-offs into the blocks of a prompt routed to the
    decode worker, which refused them (each refusal stalls the sender until the next view)."""
    rr = RoundRobinDispatcher(block_size=BLOCK, granularity=200)
    rr.on_view(DecodeView(seq=1, decodes=[inst(0, free=100)]))
    assert sum(rr.plan(i, 50, 0) is not None for i in range(20)) == 20
    dispatcher = tetri()
    queued = DecodeInstanceView(0, 60, 100, 0, 0, 0, num_queued_prompt_tokens=400)
    dispatcher.on_view(DecodeView(seq=1, decodes=[queued]))
    assert dispatcher.plan(1, 400, 1) is None  # 38 blocks; 60 free less the prompt's 25
    assert dispatcher.plan(2, 100, 1) is not None  # 19 blocks fit beside it


def test_a_short_request_counts_what_the_decode_worker_will_reserve_for_it() -> None:
    """Regression (review of session 63): bucket 0 was counted as its prompt and one token
    until the next view, where the decode worker reserves bucket 1's lower end (200 tokens)
    at once: a burst of short requests was dispatched past the room, then refused."""
    dispatcher = tetri()
    dispatcher.on_view(DecodeView(seq=1, decodes=[inst(0, free=30)]))
    first = dispatcher.plan(1, 100, 0)
    assert first is not None and first.num_blocks == num_blocks_for(300, BLOCK) == 19
    assert dispatcher.plan(2, 100, 0) is None  # 11 left
    assert dispatcher.predicted_output(0, 64) == 64 and dispatcher.predicted_output(2, None) == 400
    assert dispatcher.predicted_output(0, None, min_output=250) == 400  # raised twice


def test_picks_the_lower_heavy_share_of_the_two() -> None:
    dispatcher = tetri()
    dispatcher.on_view(DecodeView(seq=1, decodes=[inst(0, 500, heavy=4), inst(1, 500, light=4)]))
    heavy = dispatcher.plan(1, 100, bucket=2)  # lower end 400 tokens > 128: heavy
    assert heavy is not None and heavy.heavy and heavy.decode_worker == 1
    light = dispatcher.plan(2, 100, bucket=0)
    assert light is not None and not light.heavy and light.decode_worker == 1


def test_own_dispatches_count_against_a_stale_view() -> None:
    dispatcher = tetri()
    dispatcher.on_view(DecodeView(seq=5, decodes=[inst(0, free=70), inst(1, free=70)]))
    picks = [dispatcher.plan(i, 100, bucket=2) for i in range(4)]  # 32 blocks, heavy each
    # heavy requests alternate instead of piling onto the worker that looked best
    assert [p.decode_worker for p in picks if p] == [0, 1, 0, 1]
    assert dispatcher.plan(9, 100, bucket=2) is None  # 2 x 32 of the 70 free blocks each are gone
    assert not dispatcher.on_view(DecodeView(seq=4, decodes=[inst(0, 100), inst(1, 100)]))
    assert dispatcher.plan(9, 100, bucket=2) is None  # an older view changes nothing
    assert dispatcher.on_view(DecodeView(seq=6, decodes=[inst(0, 100), inst(1, 100)]))
    assert dispatcher.plan(9, 100, bucket=2) is not None


def test_rejected_handoff_gives_the_room_back() -> None:
    dispatcher = tetri()
    dispatcher.on_view(DecodeView(seq=1, decodes=[inst(0, free=40)]))
    plan = dispatcher.plan(1, 400, bucket=1)  # 600 tokens: 38 blocks
    assert plan is not None
    assert dispatcher.plan(2, 400, bucket=1) is None
    dispatcher.on_rejected(plan)
    assert dispatcher.plan(2, 400, bucket=1) is not None


def test_prediction_larger_than_any_pool_waits_for_an_idle_worker() -> None:
    dispatcher = tetri()
    dispatcher.on_view(DecodeView(seq=1, decodes=[inst(0, free=90, demand=5, total=100)]))
    assert dispatcher.plan(1, 100, bucket=50) is None  # 10,000 tokens never fit 100 blocks
    dispatcher.on_view(DecodeView(seq=2, decodes=[inst(0, free=100, total=100)]))
    plan = dispatcher.plan(1, 100, bucket=50)
    assert plan is not None and plan.decode_worker == 0


def test_same_seed_same_choices() -> None:
    view = DecodeView(seq=1, decodes=[inst(w, 900, heavy=w % 3, light=2) for w in range(8)])

    def run(seed: int) -> list[int]:
        dispatcher = tetri(seed)
        dispatcher.on_view(view)
        return [p.decode_worker for i in range(20) if (p := dispatcher.plan(i, 50, i % 3))]

    assert run(3) == run(3)
    assert len(set(run(3))) > 1


def test_round_robin_cycles_and_skips_full_workers() -> None:
    dispatcher = RoundRobinDispatcher(block_size=BLOCK)
    dispatcher.on_view(DecodeView(seq=1, decodes=[inst(2, 100), inst(0, 100), inst(1, 0)]))
    picks = [dispatcher.plan(i, 10, 0) for i in range(4)]
    assert [p.decode_worker for p in picks if p] == [0, 2, 0, 2]
    dispatcher.on_view(DecodeView(seq=2, decodes=[inst(0, 0)]))
    assert dispatcher.plan(9, 10, 0) is None


def test_a_prediction_above_max_tokens_counts_only_max_tokens() -> None:
    """Regression: the dispatcher counted the bucket's lower end (400 tokens) for a request
    capped at 10: it waited for room it can never take, and counted as heavy."""
    dispatcher = tetri()
    dispatcher.on_view(DecodeView(seq=1, decodes=[inst(0, free=8)]))  # 128 tokens of room
    assert dispatcher.plan(1, 100, bucket=2) is None  # no cap: 500 tokens do not fit
    plan = dispatcher.plan(1, 100, bucket=2, max_tokens=10)
    assert plan is not None and plan.num_blocks == num_blocks_for(110, BLOCK)
    assert not plan.heavy
    rr = RoundRobinDispatcher(block_size=BLOCK, granularity=200)
    rr.on_view(DecodeView(seq=1, decodes=[inst(0, free=8)]))
    rr_plan = rr.plan(1, 100, bucket=2, max_tokens=10)
    assert rr_plan is not None and rr_plan.num_blocks == num_blocks_for(110, BLOCK)


def test_a_report_that_had_not_read_a_hand_off_keeps_it_counted() -> None:
    """Regression (review of session 63): a decode worker reports after its step, before it
    reads the hand-offs that arrived during it. The dispatcher forgot a dispatch at the first
    newer report, sent the next request into the same room, and the decode worker refused it.
    The report now says which hand-offs it had read (``handoffs_read``, per source)."""
    def view(seq: int, read: dict[int, int], free: int = 100, life: int = 1) -> DecodeView:
        return DecodeView(seq, [DecodeInstanceView(1, free, 1000, 0, 0, 0, report_seq=seq,
                                                   handoffs_read=read, incarnation=life)], seq)

    dispatcher = TetriDispatcher(random.Random(0), block_size=BLOCK, granularity=200, source=7)
    dispatcher.on_view(view(1, {}))
    first = dispatcher.plan(1, 1000, 1)  # 1000 + 200 tokens: 75 blocks
    assert first is not None and (first.seq, first.incarnation) == (1, 1)
    dispatcher.on_view(view(2, {}))  # newer, but built before it read the hand-off
    assert dispatcher.plan(2, 1000, 1) is None  # 25 left
    dispatcher.on_view(view(3, {8: 5}))  # another prefill worker's hand-offs
    assert dispatcher.plan(2, 1000, 1) is None
    dispatcher.on_view(view(4, {7: 1}, free=25))  # read: the report's free blocks count it
    second = dispatcher.plan(2, 100, 1)  # 19 blocks: fits once the first counts only once
    assert second is not None and second.seq == 2
    dispatcher.on_view(view(5, {7: 1}, free=6, life=2))  # it restarted: what it read is gone
    assert dispatcher.plan(3, 10, 0, max_tokens=80) is not None  # 6 blocks: all of them


def test_an_aborted_hand_off_is_forgotten_by_the_book() -> None:
    """Control drops the hand-off of a request aborted on the way, so no report will ever say
    it was read: the book undoes its plan when it removes the request."""
    from tetri_server.policy import PrefillBook, PrefillQueue

    dispatcher = TetriDispatcher(random.Random(0), block_size=BLOCK, granularity=200, source=7)
    book: PrefillBook[str] = PrefillBook(PrefillQueue("fcfs"), dispatcher)
    view = DecodeView(1, [DecodeInstanceView(1, 20, 1000, 0, 0, 0, report_seq=1,
                                             handoffs_read={}, incarnation=1)], 1)
    book.on_view(view)
    for rid in (1, 2):
        book.add(rid, f"r{rid}", 8, float(rid))
        book.predicted(rid, 0)
        book.prefilled(rid)
    assert [plan.req_id for _, plan in book.dispatch()] == [1]  # 13 of 20 blocks
    book.remove(1)  # aborted before the decode worker read it
    assert [plan.req_id for _, plan in book.dispatch()] == [2]


def test_a_new_dispatcher_of_the_same_worker_is_not_taken_for_read_by_its_predecessors() -> None:
    """Regression (review of session 64): the decode workers report the last seq they read
    from each prefill worker id; a restarted or flipped prefill worker's new dispatcher counted
    from 1 again, so its first plans looked read at once and a second request went into the
    same room. A new dispatcher starts above every seq of the ones before it."""
    import time

    def view(seq: int, read: dict[int, int]) -> DecodeView:
        return DecodeView(seq, [DecodeInstanceView(1, 100, 1000, 0, 0, 0, report_seq=seq,
                                                   handoffs_read=read, incarnation=1)], seq)

    old = TetriDispatcher(random.Random(0), block_size=BLOCK, granularity=200, source=0,
                          first_seq=time.monotonic_ns() // 1000)
    old.on_view(view(1, {}))
    last = [old.plan(i, 10, 0) for i in range(3)][-1]
    assert last is not None
    new = TetriDispatcher(random.Random(0), block_size=BLOCK, granularity=200, source=0,
                          first_seq=time.monotonic_ns() // 1000)  # as PrefillRole makes it
    new.on_view(view(2, {0: last.seq}))  # what the old one sent has been read
    first = new.plan(10, 1000, 1)  # 75 blocks
    assert first is not None and first.seq > last.seq
    new.on_view(view(3, {0: last.seq}))  # a newer report, not of the new one's hand-off
    assert new.plan(11, 1000, 1) is None


def test_round_robin_leaves_routed_prompts_their_room_and_sends_what_never_fits() -> None:
    """Regression (review of session 64): round-robin sent hand-offs into the blocks of a
    prompt routed to an elastic decode worker, which refused each (stalling the sender until
    the next view); and it held for ever a request whose prompt and first token need more
    blocks than the pool has (the simulator never ended), where the power-of-two dispatcher
    sends it to an empty worker, which fails it."""
    rr = RoundRobinDispatcher(block_size=BLOCK, granularity=200)
    queued = DecodeInstanceView(0, 60, 100, 0, 0, 0, num_queued_prompt_tokens=800)
    rr.on_view(DecodeView(seq=1, decodes=[queued]))
    assert rr.plan(1, 400, 1) is None  # 26 blocks; 60 free less the prompt's 50
    assert rr.plan(2, 100, 1) is not None  # 7 blocks fit beside it
    rr = RoundRobinDispatcher(block_size=BLOCK, granularity=200)
    rr.on_view(DecodeView(seq=1, decodes=[inst(0, free=4, total=4)]))
    assert rr.plan(1, 64, 1) is not None  # 5 blocks with its first token: all 4 of them
