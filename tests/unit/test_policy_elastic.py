"""Elastic P/D, the prefill side (``policy.LocalDecode``) on hand-made views, and the book's
DECODING stage."""

from __future__ import annotations

import dataclasses
import random

import pytest

from tetri_server.config.scheduling import PrefillConfig
from tetri_server.messages import DecodeInstanceView, DecodeView
from tetri_server.policy import (
    DecodeRoom,
    LocalDecode,
    LocalPrefill,
    LocalSteps,
    PrefillBook,
    PrefillQueue,
    PromptShare,
    RoundRobinDispatcher,
    Stage,
    StepTimes,
    TetriDispatcher,
    kept_gap_s,
    local_decode_of,
)


def view(*loads: int) -> DecodeView:
    return DecodeView(1, [DecodeInstanceView(w, 500, 1000, n // 2, n - n // 2, 0)
                          for w, n in enumerate(loads)])


def test_keeps_only_while_decode_is_the_busier_side():
    local = LocalDecode(max_batch=8)
    assert local.keep(0, 0, 256, view(5))
    assert local.keep(4, 0, 256, view(5, 9))  # fewer here than on the least loaded decode
    assert not local.keep(5, 0, 256, view(5, 9))  # as many here: hand it off
    assert not local.keep(0, 0, 256, view(0))  # an idle decode worker takes it


def test_never_keeps_when_prompts_wait_or_the_local_batch_is_full():
    local = LocalDecode(max_batch=2)
    assert not local.keep(0, 257, 256, view(30))  # more than a chunk of prompts waits
    assert local.keep(0, 256, 256, view(30))
    assert not local.keep(2, 0, 256, view(30))


def test_keeps_only_requests_that_can_decode_more_than_min_tokens():
    local = LocalDecode(max_batch=8, min_tokens=128)
    assert not local.worth_keeping(128, None)  # max_tokens caps it at 128
    assert not local.worth_keeping(1000, 100)  # its predicted bucket ends at 100
    assert local.worth_keeping(129, None) and local.worth_keeping(1000, 200)
    assert LocalDecode(max_batch=8).worth_keeping(1, 1)  # min_tokens 0: any request


def prefilling(*queued: int) -> DecodeView:
    """Decode workers holding 5 requests each, with these prompt tokens routed to them."""
    return DecodeView(1, [DecodeInstanceView(w, 500, 1000, 2, 3, 0, q)
                          for w, q in enumerate(queued)])


def test_keeps_while_every_decode_worker_prefills_prompts():
    # a hand-off now would wait behind whole prompts riding in the decode worker's steps
    local = LocalDecode(max_batch=8, min_tokens=128, max_prompt_share=0.3)
    assert not local.worth_keeping(20, 32)
    # a short request: kept only then, within the prompt share (choose waives it for one
    # whose max_tokens caps it)
    assert local.keep(5, 0, 256, prefilling(989), prompt_share=0.3, short=True)
    assert not local.keep(5, 0, 256, prefilling(989), prompt_share=0.9, short=True)
    assert local.keep(0, 0, 256, prefilling(989, 40), short=True)
    assert not local.keep(0, 0, 256, prefilling(989, 0), short=True)  # one free of prompts
    assert not local.keep(0, 0, 256, view(30), short=True)
    assert not local.keep(0, 0, 256, None, short=True)
    # a long one: whatever the decode workers hold, within the prompt share
    assert local.keep(5, 0, 256, prefilling(989))  # as many here as there
    assert not local.keep(5, 0, 256, prefilling(989, 0))
    assert not local.keep(0, 0, 256, prefilling(989), prompt_share=0.9)
    # its own rules still hold: prompts waiting here, or the local batch full
    assert not local.keep(0, 257, 256, prefilling(989), short=True)
    assert not local.keep(8, 0, 256, prefilling(989), short=True)


def test_choose_keeps_in_order_passing_over_short_ones_and_stopping_at_a_long_refusal():
    local = LocalDecode(max_batch=2, min_tokens=128, max_prompt_share=0.3)
    held = [(1, 20, 32), (2, 500, None), (3, 500, 512), (4, 500, None)]
    assert local.choose(held, 0, 0, 256, view(5)) == [2, 3]  # short 1 passed over; batch 2
    assert local.choose(held, 1, 0, 256, view(5)) == [2]
    assert local.choose(held, 0, 0, 256, view(0)) == []  # an idle decode worker: hand off
    assert local.choose(held, 0, 0, 256, prefilling(700)) == [1, 2]  # short ones too
    assert local.choose([(1, 20, 32), (2, 500, None)], 0, 0, 256, view(5),
                        prompt_share=0.9) == []  # share refuses the long one; 1 is short
    # while the decode side prefills, whatever the share only when max_tokens caps the request
    capped, predicted = [(1, 20, 32)], [(1, 500, 32)]  # the second: short by its bucket alone
    assert local.choose(capped, 0, 0, 256, prefilling(700), prompt_share=0.9) == [1]
    assert local.choose(predicted, 0, 0, 256, prefilling(700), prompt_share=0.9) == []
    assert local.choose(predicted, 0, 0, 256, prefilling(700), prompt_share=0.2) == [1]


def test_keeps_only_while_prompt_steps_leave_the_worker_mostly_idle():
    local = LocalDecode(max_batch=8, max_prompt_share=0.1)
    assert local.keep(0, 0, 256, view(5), prompt_share=0.1)
    assert not local.keep(0, 0, 256, view(5), prompt_share=0.11)
    assert LocalDecode(max_batch=8).keep(0, 0, 256, view(5), prompt_share=1.0)  # default: off


def stepping(*steps_s: float, held: int = 9) -> DecodeView:
    """Decode workers holding ``held`` requests each, their recent steps ``steps_s`` long (the
    fastest 10 ms)."""
    return DecodeView(1, [DecodeInstanceView(w, 500, 1000, 0, held, 0, 0, s, 0.010)
                          for w, s in enumerate(steps_s)])


def test_with_balance_keeps_only_where_the_tokens_come_faster():
    local = LocalDecode(max_batch=8, balance=True)
    assert local.keep(0, 0, 256, stepping(0.030), gap_s=0.020)
    assert not local.keep(0, 0, 256, stepping(0.020), gap_s=0.020)  # as fast there: hand off
    assert not local.keep(0, 0, 256, stepping(0.030, 0.015), gap_s=0.020)  # one is faster
    assert not local.keep(0, 0, 256, stepping(0.0), gap_s=0.020)  # an idle one
    assert not local.keep(3, 0, 256, stepping(0.030, held=3), gap_s=0.020)  # as many here
    assert LocalDecode(max_batch=8).keep(0, 0, 256, stepping(0.010), gap_s=0.020)  # default off
    # a decode worker prefilling prompts still counts as blocked, whatever its steps
    blocked = DecodeView(1, [DecodeInstanceView(0, 500, 1000, 0, 9, 0, 300, 0.005, 0.005)])
    assert local.keep(0, 0, 256, blocked, gap_s=0.020)


def test_with_loaded_x_keeps_only_while_every_decode_worker_is_past_its_fastest():
    """``prefill.local_decode_loaded_x``: a decode side whose steps are near its fastest (10 ms
    here) has nothing to gain from a kept request."""
    local = LocalDecode(max_batch=8, balance=True, loaded_x=1.5)
    assert local.keep(0, 0, 256, stepping(0.030), gap_s=0.012)
    assert not local.keep(0, 0, 256, stepping(0.014), gap_s=0.012)  # 1.4x its fastest
    assert local.keep(0, 0, 256, stepping(0.015), gap_s=0.012)  # 1.5x
    assert not local.keep(0, 0, 256, stepping(0.030, 0.014), gap_s=0.012)  # one near it
    no_step = DecodeView(1, [DecodeInstanceView(0, 500, 1000, 0, 9, 0, 0, 0.030, 0.0)])
    assert not local.keep(0, 0, 256, no_step, gap_s=0.012)  # its fastest unknown
    assert LocalDecode(max_batch=8, balance=True).keep(0, 0, 256, stepping(0.014), gap_s=0.012)
    assert local.keep(0, 0, 256, None)  # no decode worker known: kept, as before
    assert local_decode_of(dataclasses.replace(PrefillConfig(), local_decode_loaded_x=2.0)
                           ).loaded_x == 2.0


def test_with_min_held_keeps_only_while_every_decode_worker_holds_that_many():
    local = LocalDecode(max_batch=8, min_held=6)
    assert local.keep(0, 0, 256, view(6)) and local.keep(0, 0, 256, view(9, 7))
    assert not local.keep(0, 0, 256, view(5)) and not local.keep(0, 0, 256, view(9, 5))
    assert not local.keep(6, 0, 256, view(6))  # as many here already
    assert LocalDecode(max_batch=8).keep(0, 0, 256, view(2))  # off: any load
    assert local.keep(0, 0, 256, None)  # no decode worker known: kept, as before
    assert local_decode_of(dataclasses.replace(PrefillConfig(), local_decode_min_held=4)
                           ).min_held == 4


def test_with_balance_backlog_the_gap_decides_past_a_chunk_of_waiting_prompts():
    """``prefill.local_decode_balance_backlog``: more than a chunk of prompt tokens waiting
    refuses every request unless the key is on and the balance rule finds the gap here below
    every decode worker's step; a short request, a decode side that is as fast, or one where
    every worker is prefilling still hands off; without ``balance`` the key does nothing."""
    on = LocalDecode(max_batch=8, balance=True, balance_backlog=True)
    assert not LocalDecode(max_batch=8, balance=True).keep(0, 300, 256, stepping(0.030),
                                                          gap_s=0.020)
    assert on.keep(0, 300, 256, stepping(0.030), gap_s=0.020)
    assert not on.keep(0, 300, 256, stepping(0.030, 0.015), gap_s=0.020)  # one is faster
    assert not on.keep(0, 300, 256, stepping(0.030), short=True, gap_s=0.020)
    assert not on.keep(8, 300, 256, stepping(0.030), gap_s=0.020)  # no room here
    assert not on.keep(0, 300, 256, None, gap_s=0.020)  # no decode worker known
    blocked = DecodeView(1, [DecodeInstanceView(0, 500, 1000, 0, 9, 0, 300, 0.030, 0.005)])
    assert not on.keep(0, 300, 256, blocked, gap_s=0.020)
    assert not LocalDecode(max_batch=8, balance_backlog=True).keep(0, 300, 256, stepping(0.030),
                                                                   gap_s=0.020)
    # choose: the first long one refused still ends the choice
    assert on.choose([(1, 500, None), (2, 500, None)], 0, 300, 256, stepping(0.030),
                     gap_s=0.020) == [1, 2]
    assert on.choose([(1, 500, None), (2, 500, None)], 0, 300, 256, stepping(0.015),
                     gap_s=0.020) == []


def test_a_kept_requests_gap_weighs_prompt_and_decode_steps_by_their_share_of_time():
    assert kept_gap_s(0.0, 0.080, 0.010) == pytest.approx(0.010)
    # half the time in 80 ms prompt steps, half in 10 ms decode steps: 1/(0.5/80 + 0.5/10) ms
    assert kept_gap_s(0.5, 0.080, 0.010) == pytest.approx(1 / (0.5 / 0.080 + 0.5 / 0.010))
    assert kept_gap_s(1.0, 0.080, 0.010) == pytest.approx(0.080)
    assert kept_gap_s(0.5, 0.080, 0.0) == 0.0  # no decode step known


def test_local_steps_fall_back_to_the_fastest_decode_step_when_nothing_decodes_here():
    steps = LocalSteps()
    assert steps.gap_s(0.0, stepping(0.030)) == pytest.approx(0.010)  # the decode side's fastest
    assert steps.gap_s(0.0, None) == 0.0
    steps.add(0.0, 5.0, prompt=True)  # half of the last 10 s in one 5 s prompt step
    for k in range(10):
        steps.add(5.0 + 0.02 * k, 5.02 + 0.02 * k, prompt=False)
    share = steps.prompt_share.share(10.0)
    assert steps.gap_s(share, stepping(0.030)) == pytest.approx(kept_gap_s(0.5, 5.0, 0.020))
    steps.idle()  # nothing decodes here: the fallback again
    assert steps.gap_s(share, stepping(0.030)) == pytest.approx(kept_gap_s(0.5, 5.0, 0.010))


def test_a_prompt_step_counts_as_a_step_of_the_mixed_tokens():
    """With ``wait_tokens`` (``prefill.local_decode_chunk``), a kept request would wait a step
    of that many tokens behind each prompt, not a whole chunk: a 256-token step of 80 ms counts
    as 20 ms at 64 tokens; a step no larger counts as it was, and so does every step without
    the limit."""
    steps = LocalSteps()
    steps.add(0.0, 0.080, prompt=True, num_tokens=256, wait_tokens=64)
    assert steps.prompt.recent_s == pytest.approx(0.020)
    steps = LocalSteps()
    steps.add(0.0, 0.030, prompt=True, num_tokens=48, wait_tokens=64)
    assert steps.prompt.recent_s == pytest.approx(0.030)
    steps = LocalSteps()
    steps.add(0.0, 0.080, prompt=True, num_tokens=256)
    assert steps.prompt.recent_s == pytest.approx(0.080)
    assert steps.prompt_share.share(0.080) == pytest.approx(0.008)  # time share: as it was


def test_a_prompt_step_counts_as_a_step_of_what_kept_rows_would_take_now():
    """``wait_tokens`` (``LocalDecode.step_tokens`` at the time): while a rule gives steps with
    kept rows the whole chunk, a kept request waits the whole step, so a 256-token step counts
    as it was, not as a step of ``local_decode_chunk``."""
    steps = LocalSteps()
    steps.add(0.0, 0.080, prompt=True, num_tokens=256, wait_tokens=256)
    assert steps.prompt.recent_s == pytest.approx(0.080)
    steps = LocalSteps()
    steps.add(0.0, 0.080, prompt=True, num_tokens=256, wait_tokens=128)
    assert steps.prompt.recent_s == pytest.approx(0.040)


def test_step_times_average_the_recent_steps_and_remember_the_fastest():
    times = StepTimes(weight=0.5)
    assert (times.recent_s, times.fastest_s) == (0.0, 0.0)  # no step yet
    for _ in range(20):
        times.add(0.010)
    assert times.recent_s == pytest.approx(0.010)
    for _ in range(20):
        times.add(0.030)
    assert times.recent_s == pytest.approx(0.030, rel=1e-3)
    assert times.fastest_s == pytest.approx(0.010)
    times.idle()
    assert times.recent_s == 0.0  # nothing steps here
    times.add(0.020)  # a new busy spell starts a new average
    assert times.recent_s == pytest.approx(0.020)
    for _ in range(20):
        times.add(0.005)
    assert times.fastest_s == pytest.approx(0.005, rel=1e-3)


def test_hands_back_only_when_asked_to_and_prompts_queue_beyond_a_chunk():
    local = LocalDecode(max_batch=8, hand_back=True)
    assert not local.hands_back(256, 256)  # the next chunk takes the whole backlog
    assert local.hands_back(257, 256)
    assert not LocalDecode(max_batch=8).hands_back(10_000, 256)  # default: decode to the end
    # where it hands back, it would not keep: the rules agree, so nothing bounces
    assert not local.keep(0, 257, 256, view(30))


def test_prompt_share_counts_the_steps_of_the_last_window():
    share = PromptShare(window_s=10.0)
    assert share.share(0.0) == 0.0
    share.add(0.0, 1.0)
    share.add(5.0, 6.0)
    assert share.share(6.0) == pytest.approx(0.2)
    assert share.share(10.5) == pytest.approx(0.15)  # the first step half out of the window
    assert share.share(16.0) == 0.0  # both out: dropped
    share.add(16.0, 40.0)  # a step longer than the window
    assert share.share(40.0) == 1.0


def test_prompt_share_stays_bounded_when_nobody_asks():
    """A worker records every prompt step; with elastic off nothing ever reads the share, and
    the window must not grow with the run."""
    share = PromptShare(window_s=10.0)
    for i in range(10_000):
        share.add(float(i), i + 0.5)
    assert len(share._steps) <= 11
    assert share.share(9_999.5) == pytest.approx(0.5)


def test_keeps_when_no_decode_worker_is_known():
    assert LocalDecode(max_batch=1).keep(0, 0, 64, None)
    assert LocalDecode(max_batch=1).keep(0, 0, 64, DecodeView(1, []))


def test_a_kept_request_is_never_dispatched_and_leaves_on_remove():
    book: PrefillBook[str] = PrefillBook(PrefillQueue("fcfs"),
                                         RoundRobinDispatcher(block_size=16, granularity=200))
    book.on_view(view(3))
    assert book.view is not None
    for rid in (1, 2):
        book.add(rid, f"r{rid}", 16, 0.0)
        book.predicted(rid, 0)
        book.prefilled(rid)
    assert book.keep(1) == "r1"
    assert book.ids(Stage.DECODING) == [1] and book.has_work()  # a local decode is work
    assert [r for r, _ in book.dispatch()] == ["r2"]
    assert book.pulled(1) is None and book.rejected(1) is None
    assert book.remove(1) == "r1" and book.ids(Stage.DECODING) == []


def test_a_handed_back_request_is_dispatched_like_a_prefilled_one():
    book: PrefillBook[str] = PrefillBook(PrefillQueue("fcfs"),
                                         RoundRobinDispatcher(block_size=16, granularity=200))
    book.add(1, "r1", 16, 0.0)
    book.predicted(1, 0)
    book.prefilled(1)
    book.keep(1)
    assert book.dispatch() == []  # kept: not dispatched
    assert book.hand_back(1, 17) == "r1"
    assert book.ids(Stage.DECODING) == [] and book.ids(Stage.HELD) == [1]
    assert book.dispatch() == []  # no view yet: no room known
    book.on_view(view(3))
    assert [r for r, _ in book.dispatch()] == ["r1"]
    assert book.ids(Stage.HANDED_OFF) == [1] and book.pulled(1) == "r1" and not book
    with pytest.raises(KeyError):
        book.hand_back(1, 17)  # gone: only a kept request can be handed back


def test_a_handed_back_request_is_dispatched_with_the_kv_it_decoded_here():
    """Regression (review of session 61): a kept request handed back was sized by its prompt
    alone, so a decode worker with room for the prompt but not for the tokens decoded beside
    it was chosen, and refused the hand-off (or preempted for it). Its output is at least what
    it made here; a prediction of more still counts whole (it is of the whole output)."""
    for dispatcher in (RoundRobinDispatcher(block_size=16, granularity=200),
                       TetriDispatcher(random.Random(0), block_size=16, granularity=200)):
        book: PrefillBook[str] = PrefillBook(PrefillQueue("fcfs"), dispatcher)
        for rid, bucket in ((1, 0), (2, 2)):  # predicted outputs: none, and 400 tokens
            book.add(rid, f"r{rid}", 16, 0.0, max_tokens=1000)
            book.predicted(rid, bucket)
            book.prefilled(rid)
            book.keep(rid)
        book.hand_back(1, 16 + 1 + 100)  # 100 tokens decoded here after the first
        # room for the prompt and its first token (2 blocks), not for what it holds (8)
        book.on_view(DecodeView(1, [DecodeInstanceView(0, 2, 1000, 0, 0, 0)]))
        assert book.dispatch() == []
        book.on_view(DecodeView(2, [DecodeInstanceView(0, 14, 1000, 0, 0, 0)]))
        [(req, plan)] = book.dispatch()
        # past bucket 0's lower end, the decode worker reserves bucket 1's: 16 + 200 tokens
        # (round-robin counts what it holds: 16 + 101)
        assert req == "r1" and plan.num_blocks == (
            8 if isinstance(dispatcher, RoundRobinDispatcher) else 14)
        book.hand_back(2, 16 + 1 + 300)  # 301 of the 400 predicted made here: 416 tokens
        book.on_view(DecodeView(3, [DecodeInstanceView(0, 26, 1000, 0, 0, 0)]))
        [(req, plan)] = book.dispatch()
        assert req == "r2" and plan.num_blocks == 26  # not 16 + 300 + 400 (45 blocks)


ROOMY = 1000  # free blocks: room for any prompt below
D = DecodeRoom  # (worker id, prompt tokens queued, requests held, free blocks[, step times])


def test_a_prompt_goes_to_a_decode_worker_only_behind_a_backlog():
    local = LocalPrefill()
    assert local.pick(100, 900, 256, [D(1, 0, 0, ROOMY), D(2, 0, 5, ROOMY)]) == 1
    assert local.pick(100, 256, 256, [D(1, 0, 0, ROOMY)]) is None  # starts in the next chunk
    assert local.pick(100, 900, 256, []) is None  # no decode worker serving


def test_the_decode_worker_with_the_smallest_prompt_backlog_and_only_if_sooner_by_a_chunk():
    local = LocalPrefill()
    assert local.pick(100, 600, 256, [D(1, 120, 0, ROOMY), D(2, 40, 9, ROOMY)]) == 2
    assert local.pick(100, 600, 256, [D(1, 40, 3, ROOMY), D(2, 40, 1, ROOMY)]) == 2  # fewer held
    # the prompt finishes after what is queued ahead of it on either side: 600 there against
    # 300 here, with a chunk (256) of margin for the decode rows sharing its steps
    assert local.pick(100, 600, 256, [D(1, 300, 0, ROOMY)]) == 1
    assert local.pick(100, 600, 256, [D(1, 344, 0, ROOMY)]) is None  # 344 + 256 >= 600


def test_with_no_margin_a_prompt_goes_where_fewer_prompt_tokens_wait():
    """``decode.local_prefill_margin = 0``: prompts spread as in a coupled cluster."""
    local = LocalPrefill(margin=0.0)
    assert local.pick(100, 1, 256, [D(1, 0, 0, ROOMY)]) == 1  # any backlog on the prefill side
    assert local.pick(100, 0, 256, [D(1, 0, 0, ROOMY)]) is None  # an idle prefill worker
    assert local.pick(100, 300, 256, [D(1, 300, 0, ROOMY)]) is None  # level: the prefill side
    assert LocalPrefill(margin=0.5).pick(100, 300, 256, [D(1, 100, 0, ROOMY)]) == 1  # 228 < 300


def test_with_a_negative_margin_a_prompt_goes_to_a_decode_worker_only_with_no_prefill_serving():
    """``decode.local_prefill_margin < 0`` (the default since session 41): the decode worker's
    steps carry prompt slices only while no prefill worker serves (None: one restarting)."""
    local = LocalPrefill(margin=-1.0)
    assert local.pick(100, 90_000, 256, [D(1, 0, 0, ROOMY)]) is None
    assert local.pick(100, None, 256, [D(1, 0, 0, ROOMY)]) == 1
    assert local.pick(100, None, 256, [D(1, 0, 0, 3)]) is None  # no room there either


def test_with_a_gap_bound_a_decode_worker_slower_than_it_takes_no_prompt():
    """``decode.local_prefill_max_gap_x``: a decode worker whose recent step is past the bound
    (its prompt slices or its batch already slow its requests) takes no prompt, unless no
    prefill worker serves it."""
    local = LocalPrefill(max_gap_x=3.0)
    fast = D(1, 0, 0, ROOMY, step_s=0.030, fastest_step_s=0.010)  # 3x: at the bound
    slow = D(2, 0, 0, ROOMY, step_s=0.031, fastest_step_s=0.010)
    assert local.pick(100, 900, 256, [fast]) == 1
    assert local.pick(100, 900, 256, [slow]) is None
    assert local.pick(100, 900, 256, [slow, fast._replace(num_queued_tokens=200)]) == 1
    assert local.pick(100, None, 1, [slow]) == 2  # no prefill worker serving: it takes it
    idle = D(3, 0, 0, ROOMY, step_s=0.0, fastest_step_s=0.0)  # no step yet
    assert local.pick(100, 900, 256, [idle]) == 3
    assert LocalPrefill().pick(100, 900, 256, [slow]) == 2  # no bound by default


def test_only_a_decode_worker_with_room_for_the_prompt_takes_it():
    """A decode worker reserves a prompt's blocks whole before its first slice: a long prompt
    sent to a nearly full pool would wait there behind every hand-off."""
    local = LocalPrefill(block_size=16)
    # 1000 queued + 600 = 1600 tokens = 100 blocks: they must fit in half the free blocks
    assert local.pick(600, 5000, 256, [D(1, 1000, 0, 200)]) == 1
    assert local.pick(600, 5000, 256, [D(1, 1000, 0, 199)]) is None
    # the emptier backlog without room loses to the one with room
    assert local.pick(600, 5000, 256, [D(1, 0, 0, 10), D(2, 1000, 0, 400)]) == 2


def test_with_no_prefill_worker_serving_a_decode_worker_with_room_takes_the_prompt():
    local = LocalPrefill()
    assert local.pick(100, None, 1, [D(1, 500, 0, ROOMY), D(2, 0, 3, ROOMY)]) == 2
    assert local.pick(100, None, 1, [D(1, 0, 0, 4)]) is None  # no room: it waits for one
    assert local.pick(100, None, 1, []) is None


def test_a_decode_worker_prefills_at_most_the_prefill_chunk_a_step():
    assert LocalPrefill.slice_tokens(1024, 256) == 256  # the chunk, under the limit
    assert LocalPrefill.slice_tokens(1024, 2048) == 1024  # the limit, under the chunk
    assert LocalPrefill.slice_tokens(1024, 0) == 1024  # no prefill worker serving
    assert LocalPrefill.slice_tokens(1024, 256, follow_chunk=False) == 1024  # "fixed"


def test_prompt_first_runs_a_backlog_within_a_mixed_step_alone() -> None:
    local = LocalDecode(max_batch=4, prompt_first=True)
    assert local.prompt_alone(100, 128)  # the whole backlog in one pure step
    assert local.prompt_alone(128, 128)
    assert not local.prompt_alone(129, 128)  # more: mixed steps, the kept rows in each
    assert not local.prompt_alone(0, 128)  # nothing queued: the kept requests decode
    assert not local.prompt_alone(100, 128, last_alone=True)  # never twice in a row
    assert not LocalDecode(max_batch=4).prompt_alone(100, 128)  # off by default


def test_a_backlog_beyond_the_bound_gets_steps_of_the_whole_chunk() -> None:
    """``prefill.local_decode_full_chunk_backlog``: past it, a step with kept rows takes the
    chunk (prompts at the chunk's rate); at or below it, ``local_decode_chunk``."""
    local = LocalDecode(max_batch=4, full_chunk_backlog=1024)
    assert local.step_tokens(1025, 128, 432) == 432
    assert local.step_tokens(1024, 128, 432) == 128
    assert local.step_tokens(0, 128, 432) == 128
    assert local.step_tokens(5000, 432, 256) == 432  # never below the mixed chunk
    assert LocalDecode(max_batch=4).step_tokens(5000, 128, 432) == 128  # off by default


def test_kept_rows_as_many_as_the_cap_leave_the_prompts_a_quarter_of_it() -> None:
    """Regression (session 66 review): with local_decode_batch rows as many as the step's cap
    (64 beside a calibrated chunk of 64), every mixed step was rows alone, and the prompts on
    that worker waited until a kept request ended (103 s in the simulator)."""
    local = LocalDecode(max_batch=64)
    assert local.step_tokens(20, 64, 64, num_rows=64) == 64 + 16
    assert local.step_tokens(20, 64, 64, num_rows=40) == 64  # room left: the cap
    assert local.step_tokens(20, 2, 64, num_rows=2) == 3  # at least one token
    backlog = LocalDecode(max_batch=64, full_chunk_backlog=10)
    assert backlog.step_tokens(20, 64, 64, num_rows=64) == 80


def test_a_prompt_behind_a_full_batch_of_kept_requests_is_prefilled_soon() -> None:
    """The same in the simulator, which runs the workers' policies: a late prompt on a
    prefill worker holding 64 long kept requests beside a chunk of 64."""
    from tetri_server.sim.cluster import SimConfig, Simulation
    from tetri_server.sim.cost import CostModel
    from tetri_server.sim.instances import SimRequest
    from tetri_server.sim.profiles import load_hardware, load_model

    hw = load_hardware("V100-32GB")
    cost = CostModel(hw, load_model("OPT-13B"), hw.link("ts-roce"))
    cfg = SimConfig(chunk_size=64, local_decode_batch=64, local_decode_chunk=128,
                    local_decode_min_tokens=0, max_model_len=2048, num_kv_blocks=20000,
                    max_batch=32)
    reqs = [SimRequest(i, 8, 1500, i * 0.1, bucket=0) for i in range(200)]
    late = [SimRequest(1000 + i, 20, 2, 30.0 + 0.01 * i, bucket=0) for i in range(3)]
    Simulation(cfg, cost, reqs + late).run()
    assert max(r.first_token_s - r.arrival_s for r in late) < 5.0


def test_while_prompts_are_rare_a_step_with_kept_rows_takes_the_whole_chunk() -> None:
    """``prefill.local_decode_full_chunk_share``: while steps with prompt tokens took less than
    that share of the last 10 s, a step with kept rows takes the chunk; from it on,
    ``local_decode_chunk``."""
    local = LocalDecode(max_batch=4, full_chunk_share=0.25)
    assert local.step_tokens(300, 128, 432, prompt_share=0.0) == 432
    assert local.step_tokens(300, 128, 432, prompt_share=0.24) == 432
    assert local.step_tokens(300, 128, 432, prompt_share=0.25) == 128
    assert local.step_tokens(300, 128, 432, prompt_share=0.9) == 128
    off = LocalDecode(max_batch=4)  # off by default
    assert off.step_tokens(300, 128, 432, prompt_share=0.0) == 128


def test_a_request_of_at_most_finish_tokens_is_kept_whatever_the_load() -> None:
    """``prefill.local_finish_tokens``: a request that ends within that many tokens stays on
    the prefill worker (a hand-off would cost it more than its decode) under a backlog, a busy
    worker and an idle decode worker alike; only the batch must have room."""
    local = LocalDecode(max_batch=2, min_tokens=128, max_prompt_share=0.3, balance=True,
                        finish_tokens=16)
    assert local.finishes_here(16) and local.finishes_here(2)
    assert not local.finishes_here(17)
    assert not LocalDecode(max_batch=2).finishes_here(2)  # off by default
    held = [(1, 16, 32), (2, 500, None), (3, 2, None), (4, 8, None)]
    # a backlog of 5000 prompt tokens, prompt steps 90% of the time, an idle decode worker
    assert local.choose(held, 0, 5000, 256, view(0), prompt_share=0.9) == [1, 3]
    assert local.choose(held, 1, 5000, 256, view(0), prompt_share=0.9) == [1]  # batch full
    assert LocalDecode(max_batch=2, min_tokens=128).choose(
        held, 0, 5000, 256, view(0)) == []  # without it: all handed off


def test_while_a_finishing_request_decodes_the_steps_take_at_most_finish_tokens() -> None:
    local = LocalDecode(max_batch=4, full_chunk_share=0.25, finish_tokens=16)
    assert local.step_tokens(300, 128, 432, finishing=True) == 16
    # 16 prompt tokens beside the rows: 16 finishing rows left a prompt none (session 43)
    assert local.step_tokens(300, 128, 432, finishing=True, num_rows=16) == 32
    assert local.step_tokens(300, 8, 432, finishing=True) == 8  # never above the mixed chunk
    assert local.step_tokens(300, 128, 432, 0.5, num_rows=16) == 128  # other caps: rows in
    assert local.step_tokens(300, 128, 432, prompt_share=0.5) == 128  # none finishing here
    off = LocalDecode(max_batch=4)  # off by default
    assert off.step_tokens(300, 128, 432, finishing=True) == 128


def test_local_decode_of_maps_every_prefill_key_and_none_without_a_batch():
    """``local_decode_of`` builds the prefill side's rules from the ``[prefill]`` keys (the
    simulator's config names them the same way), each into its own setting; a batch of 0 is
    the strict split: no rules."""
    keys = PrefillConfig(local_decode_batch=5, local_decode_min_tokens=7,
                         local_decode_max_prompt_share=0.5, local_decode_hand_back=True,
                         local_decode_balance=False, local_decode_prompt_first=True,
                         local_decode_full_chunk_backlog=300, local_decode_full_chunk_share=0.25,
                         local_finish_tokens=11, local_decode_balance_backlog=True)
    assert local_decode_of(keys) == LocalDecode(
        max_batch=5, min_tokens=7, max_prompt_share=0.5, hand_back=True, balance=False,
        prompt_first=True, full_chunk_backlog=300, full_chunk_share=0.25, finish_tokens=11,
        balance_backlog=True)
    assert local_decode_of(dataclasses.replace(keys, local_decode_batch=0)) is None
