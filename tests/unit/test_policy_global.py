"""The global scheduler's least-loaded pick."""

from __future__ import annotations

import msgspec

from tetri_server.messages import LoadReport
from tetri_server.policy import LeastLoadedPicker, LocalPrefill


def report(
    wid: int, role: str, queued_tokens: int, waiting: int = 0, running: int = 0,
    free_blocks: int = 100,
) -> LoadReport:
    return LoadReport(wid, role, waiting, running, queued_tokens, free_blocks, 100, 0, 0, 0, 0.0)


def test_picks_the_prefill_worker_with_fewest_queued_prompt_tokens() -> None:
    picker = LeastLoadedPicker()
    for r in [report(0, "prefill", 900), report(1, "prefill", 300), report(2, "decode", 0)]:
        picker.on_report(r)
    assert picker.pick(100) == 1  # the idle decode worker is not a prefill target


def test_ties_go_to_the_lowest_id() -> None:
    picker = LeastLoadedPicker()
    for wid in (3, 1, 2):
        picker.on_report(report(wid, "prefill", 0))
    assert picker.pick(0) == 1


def test_a_burst_between_reports_is_spread_by_counting_own_sends() -> None:
    picker = LeastLoadedPicker()
    picker.on_report(report(0, "prefill", 0))
    picker.on_report(report(1, "prefill", 0))
    picks = [picker.pick(n) for n in (1000, 200, 300, 400)]
    assert picks == [0, 1, 1, 1]  # 1000 on worker 0 outweighs 200 + 300 on worker 1
    picker.on_report(report(0, "prefill", 0))  # worker 0 finished its work
    assert picker.pick(10) == 0


def test_a_prompt_stays_counted_until_a_report_says_its_worker_handled_it() -> None:
    picker = LeastLoadedPicker()
    picker.on_report(report(0, "prefill", 0))
    assert picker.pick(1000) == 0 and picker.stamp(0) == 1  # sent as add_seq 1
    # a report that left before the prompt arrived (or none while a long step runs)
    picker.on_report(msgspec.structs.replace(report(0, "prefill", 0), last_add_seq=0))
    assert picker.queued_tokens(0) == 1000
    picker.on_report(msgspec.structs.replace(report(0, "prefill", 1000), last_add_seq=1))
    assert picker.queued_tokens(0) == 1000  # in the report now, not counted twice
    assert picker.pick(10) == 0 and picker.stamp(0) == 2
    picker.on_report(msgspec.structs.replace(report(0, "prefill", 0), last_add_seq=2))
    assert picker.queued_tokens(0) == 0
    assert picker.pick(10) == 0
    picker.on_report(report(0, "prefill", 0))  # no stamp (a restart): counts everything
    assert picker.queued_tokens(0) == 0


def test_excluded_and_removed_workers_are_not_picked() -> None:
    picker = LeastLoadedPicker()
    picker.on_report(report(0, "prefill", 0))
    picker.on_report(report(1, "prefill", 500))
    assert picker.pick(1, exclude={0}) == 1
    picker.remove_worker(1)
    assert picker.pick(1, exclude={0}) is None
    assert LeastLoadedPicker().pick(1) is None


def test_coupled_mode_balances_requests_over_all_workers() -> None:
    picker = LeastLoadedPicker(coupled=True)
    picker.on_report(report(0, "coupled", 0, waiting=0, running=5))
    picker.on_report(report(1, "coupled", 2000, waiting=1, running=1))
    assert picker.pick(100) == 1  # 2 requests against 5, despite the queued prompt
    assert picker.pick(100) == 1
    assert picker.pick(100) == 1
    assert picker.pick(100) == 0  # 5 against 5: fewer queued tokens wins


def test_elastic_sends_a_prompt_to_a_decode_worker_that_finishes_it_sooner() -> None:
    picker = LeastLoadedPicker(local_prefill=LocalPrefill())
    picker.on_report(report(0, "prefill", 900))  # busy with a long prompt
    picker.on_report(report(1, "decode", 0, running=20))
    chunks = {0: 256}
    assert picker.pick(400, chunk_sizes=chunks) == 1  # would wait behind 900 tokens
    # what was sent counts until the next report: 400 then 700 tokens queued on the decode
    # worker, and 700 + 256 >= 900, so the third prompt takes the prefill worker
    assert picker.pick(300, chunk_sizes=chunks) == 1
    assert picker.pick(200, chunk_sizes=chunks) == 0
    assert picker.queued_tokens(0) == 1100 and picker.queued_tokens(1) == 700
    picker.on_report(report(0, "prefill", 100))
    assert picker.pick(50, chunk_sizes=chunks) == 0  # starts within the next chunk


def test_a_decode_worker_reports_its_step_times_to_the_gap_bound() -> None:
    """``LocalPrefill.max_gap_x`` reads each decode worker's report: past 3x its fastest
    step, the prompt stays with the busy prefill worker."""
    picker = LeastLoadedPicker(local_prefill=LocalPrefill(max_gap_x=3.0))
    picker.on_report(report(0, "prefill", 900))
    slow = msgspec.structs.replace(report(1, "decode", 0), step_s=0.040, fastest_step_s=0.010)
    picker.on_report(slow)
    assert picker.pick(100, chunk_sizes={0: 256}) == 0
    picker.on_report(msgspec.structs.replace(slow, step_s=0.020))
    assert picker.pick(100, chunk_sizes={0: 256}) == 1


def test_an_excluded_or_removed_decode_worker_takes_no_prompt() -> None:
    picker = LeastLoadedPicker(local_prefill=LocalPrefill())
    picker.on_report(report(0, "prefill", 900))
    picker.on_report(report(1, "decode", 0))
    chunks = {0: 256}
    assert picker.pick(100, exclude={1}, chunk_sizes=chunks) == 0  # draining or restarting
    picker.remove_worker(1)  # dead
    assert picker.pick(100, chunk_sizes=chunks) == 0


def test_with_the_prefill_worker_down_elastic_sends_prompts_to_a_decode_worker() -> None:
    """The only prefill worker restarting: instead of waiting for it, a prompt goes to a
    decode worker that has room (it prefills and decodes it itself); without elastic, or with
    no room, the pick stays None (the router parks the request, bounded)."""
    picker = LeastLoadedPicker(local_prefill=LocalPrefill())
    picker.on_report(report(0, "prefill", 0))
    picker.on_report(report(1, "decode", 0, running=3))
    picker.on_report(report(2, "decode", 0, running=1))
    assert picker.pick(100, exclude={0}) == 2  # fewer held requests
    assert picker.pick(100, exclude={0}) == 1  # 100 tokens now queued on worker 2
    picker.on_report(report(1, "decode", 0, free_blocks=2))
    picker.on_report(report(2, "decode", 0, free_blocks=2))
    assert picker.pick(100, exclude={0}) is None  # no room anywhere
    strict = LeastLoadedPicker()
    strict.on_report(report(0, "prefill", 0))
    strict.on_report(report(1, "decode", 0))
    assert strict.pick(100, exclude={0}) is None


def test_without_elastic_decode_workers_never_prefill() -> None:
    picker = LeastLoadedPicker()
    picker.on_report(report(0, "prefill", 5000))
    picker.on_report(report(1, "decode", 0))
    assert picker.pick(100, chunk_sizes={0: 128}) == 0

