"""The prefill worker's one table of requests (``policy.PrefillBook``): stages, dispatch order,
refusals and removal from every stage, on hand-made views."""

from __future__ import annotations

import random

import pytest

from tetri_server.messages import DecodeInstanceView, DecodeView
from tetri_server.policy import (
    PrefillBook,
    PrefillQueue,
    RoundRobinDispatcher,
    Stage,
    TetriDispatcher,
)

BLOCK = 16


def book() -> PrefillBook[str]:
    return PrefillBook(PrefillQueue("fcfs"),
                       RoundRobinDispatcher(block_size=BLOCK, granularity=200))


def view(seq: int, free: int) -> DecodeView:
    return DecodeView(seq, [DecodeInstanceView(7, free, 1000, 0, 0, 0)])


def held(b: PrefillBook[str], *req_ids: int) -> None:
    for rid in req_ids:
        b.add(rid, f"r{rid}", 16, float(rid))
        b.predicted(rid, 0)
        b.prefilled(rid)


def test_a_request_moves_through_the_stages_and_is_counted_once() -> None:
    b = book()
    b.add(1, "r1", 40, 0.0, prompt_text="hi", true_output_len=5)
    assert [e.prompt_text for e in b.new()] == ["hi"] and b.has_work()
    assert b.count(Stage.NEW) == 1 and len(b.queue) == 0
    assert b.num_waiting_prompt_tokens() == 40  # reported from arrival, before its prediction
    b.predicted(1, bucket=2)
    assert b.count(Stage.QUEUED) == 1 and len(b.queue) == 1 and not b.new()
    assert b.num_waiting_prompt_tokens() == 40  # once
    b.prefilled(1)
    assert b.num_waiting_prompt_tokens() == 0
    assert b.count(Stage.HELD) == 1 and not b.has_work() and 1 in b
    assert b.dispatch() == []  # no view yet: nowhere to send it
    b.on_view(view(1, free=100))
    [(req, plan)] = b.dispatch()
    assert req == "r1" and plan.decode_worker == 7
    assert b.count(Stage.HANDED_OFF) == 1 and b.dispatch() == []  # not sent twice
    assert b.pulled(1) == "r1" and len(b) == 0 and 1 not in b


def test_held_requests_are_dispatched_in_order_and_a_refused_one_goes_last() -> None:
    b = book()
    b.on_view(view(1, free=1000))
    held(b, 3, 1, 2)
    assert [r for r, _ in b.dispatch()] == ["r3", "r1", "r2"]
    assert b.rejected(3) == "r3"
    held(b, 4)
    assert b.dispatch() == []  # a refusal means the view is stale: wait for the next one
    assert b.count(Stage.HELD) == 2
    b.on_view(view(2, free=1000))
    assert [r for r, _ in b.dispatch()] == ["r3", "r4"]


def test_refused_plan_is_not_counted_against_the_worker() -> None:
    b = book()
    b.on_view(view(1, free=2))  # room for one request of 2 blocks (16 prompt + 1 predicted)
    held(b, 1, 2)
    assert [r for r, _ in b.dispatch()] == ["r1"]  # r2 does not fit beside r1's count
    b.rejected(1)
    b.on_view(view(1, free=2))  # the same view (not newer) still ends the wait
    assert [r for r, _ in b.dispatch()] == ["r2"]  # r1's 2 blocks were given back; r1 is last


def test_ack_and_refusal_for_requests_not_handed_off_are_ignored() -> None:
    b = book()
    held(b, 1)
    assert b.pulled(1) is None and b.rejected(1) is None and b.pulled(99) is None
    assert b.count(Stage.HELD) == 1


@pytest.mark.parametrize("stage", list(Stage))
def test_remove_from_any_stage_leaves_nothing_behind(stage: Stage) -> None:
    b = book()
    b.on_view(view(1, free=1000))
    b.add(1, "r1", 16, 0.0)
    if stage is not Stage.NEW:
        b.predicted(1, 0)
    if stage in (Stage.HELD, Stage.HANDED_OFF, Stage.DECODING):
        b.prefilled(1)
    if stage is Stage.HANDED_OFF:
        assert b.dispatch()
    if stage is Stage.DECODING:
        b.keep(1)
    assert b.count(stage) == 1
    assert b.remove(1) == "r1"
    assert len(b) == 0 and len(b.queue) == 0 and not b.has_work()
    assert b.remove(1) is None


def test_wrong_transitions_raise() -> None:
    b = book()
    b.add(1, "r1", 16, 0.0)
    with pytest.raises(ValueError, match="already"):
        b.add(1, "again", 16, 0.0)
    with pytest.raises(ValueError, match="new, not queued"):
        b.prefilled(1)


def test_random_walk_keeps_stage_counts_consistent() -> None:
    """Random transitions against a model of each request's stage."""
    rng = random.Random(11)
    b = book()
    model: dict[int, Stage] = {}
    seq = 0
    for step in range(3000):
        op = rng.randrange(7)
        rid = rng.choice(sorted(model)) if model else None
        if op == 0:
            b.add(step, f"r{step}", rng.randrange(1, 100), float(step))
            model[step] = Stage.NEW
        elif rid is None:
            continue
        elif op == 1 and model[rid] is Stage.NEW:
            b.predicted(rid, rng.randrange(3))
            model[rid] = Stage.QUEUED
        elif op == 2 and model[rid] is Stage.QUEUED:
            b.prefilled(rid)
            model[rid] = Stage.HELD
        elif op == 3:
            seq += 1
            b.on_view(view(seq, free=rng.randrange(0, 400)))
            for req, _ in b.dispatch():
                sent = int(req[1:])
                assert model[sent] is Stage.HELD
                model[sent] = Stage.HANDED_OFF
        elif op == 4:
            assert (b.pulled(rid) is not None) == (model[rid] is Stage.HANDED_OFF)
            if model[rid] is Stage.HANDED_OFF:
                del model[rid]
        elif op == 5:
            assert (b.rejected(rid) is not None) == (model[rid] is Stage.HANDED_OFF)
            if model[rid] is Stage.HANDED_OFF:
                model[rid] = Stage.HELD
        elif op == 6:
            assert b.remove(rid) is not None
            del model[rid]
        assert len(b) == len(model)
        for stage in Stage:
            assert b.count(stage) == sum(s is stage for s in model.values())
        assert len(b.queue) == b.count(Stage.QUEUED)


def test_a_request_the_dispatcher_keeps_refusing_is_not_passed_forever() -> None:
    """Regression (starvation): smaller requests held after a large one took every block the
    decode worker freed, view after view, and the large one waited until its request timed
    out. After MAX_PASSED_VIEWS views of being passed, the ones behind it wait too."""
    from tetri_server.policy.prefill_book import MAX_PASSED_VIEWS

    b = book()
    b.on_view(view(1, free=20))
    b.add(0, "big", 1000, 0.0)
    b.predicted(0, 5)  # 1000 + 1000 tokens: 125 blocks, never in a view of 20 free
    b.prefilled(0)
    passed = 0
    for v in range(2, MAX_PASSED_VIEWS + 2):
        held(b, 1000 + v)  # a small one held after it, every view
        passed += len(b.dispatch())
        b.on_view(view(v, free=20))
    assert passed == MAX_PASSED_VIEWS  # each small one went, past the big one
    held(b, 1)
    assert b.dispatch() == []  # now it goes first
    b.on_view(view(MAX_PASSED_VIEWS + 2, free=200))  # the decode worker drained
    assert [r for r, _ in b.dispatch()] == ["big", "r1"]


def test_the_dispatcher_is_given_the_requests_max_tokens() -> None:
    """Regression: a request capped at 10 tokens but predicted 400+ was held until a decode
    worker had room for 400."""
    b: PrefillBook[str] = PrefillBook(PrefillQueue("fcfs"), TetriDispatcher(
        random.Random(0), block_size=BLOCK, granularity=200))
    b.add(1, "r1", 16, 0.0, max_tokens=10)
    b.predicted(1, bucket=2)
    b.prefilled(1)
    b.on_view(view(1, free=4))  # 64 tokens of room
    assert [plan.decode_worker for _, plan in b.dispatch()] == [7]
