"""Elastic P/D, the prefill side (``policy.LocalDecode``) on hand-made views, and the book's
DECODING stage."""

from __future__ import annotations

from tetri_server.messages import DecodeInstanceView, DecodeView
from tetri_server.policy import (
    LocalDecode,
    PrefillBook,
    PrefillQueue,
    RoundRobinDispatcher,
    Stage,
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
