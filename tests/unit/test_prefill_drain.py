"""A prefill worker that drains for a flip (elastic P/D) hands its kept requests back; one the
decode worker refuses decodes here again meanwhile. A real ``PrefillRole`` over the fake
worker of the golden decision trace (real allocator and KV manager, a fake runner)."""

from __future__ import annotations

from tests.unit.test_decision_trace_disagg import FakeWorker
from tetri_server.config import load_config
from tetri_server.messages import (
    AddRequest,
    DecodeInstanceView,
    DecodeView,
    Handoff,
    HandoffRejected,
    SamplingParams,
    StepOutput,
)
from tetri_server.policy.prefill_book import Stage
from tetri_server.workers.prefill import PrefillRole


def tokens_of(sent: list[object], req_id: int) -> int:
    return sum(len(d.token_ids) for m in sent if isinstance(m, StepOutput)
               for d in m.deltas if d.req_id == req_id)


def test_a_handed_back_request_refused_while_draining_decodes_here_meanwhile() -> None:
    """Regression (review of session 61): it stayed held, making no token, until a decode
    view with room came and the decode worker took it; with the decode worker full, the
    stream stalled and the flip waited for it."""
    pw = FakeWorker(0, 64, [])
    pw.cfg = load_config(None, ["prefill.chunk_size=128", "predictor.kind=none",
                                "decode.policy=greedy", "dispatch.policy=power-of-two",
                                "prefill.local_finish_tokens=0"])
    prefill = PrefillRole(pw)  # type: ignore[arg-type]
    assert prefill.local is not None  # elastic P/D: it keeps requests
    prefill.handle(AddRequest(1, list(range(5, 45)), SamplingParams(
        max_tokens=100, temperature=0.0, ignore_eos=True), 0.0))
    while 1 not in prefill.book.ids(Stage.HELD) + prefill.book.ids(Stage.DECODING):
        prefill.step()
    if 1 in prefill.book.ids(Stage.HELD):
        prefill._keep(1, 0.0)
    for _ in range(3):
        prefill.step()
    made = tokens_of(pw.sent, 1)
    assert made >= 3
    pw.sent.clear()
    pw.pending_role = "decode"  # a flip: the worker drains
    prefill.handle(DecodeView(1, [DecodeInstanceView(1, 40, 48, 0, 0, 0)]))
    prefill.step()
    assert any(isinstance(m, Handoff) and m.req_id == 1 for m in pw.sent)
    prefill.handle(HandoffRejected(1, "decode worker has no free blocks"))
    assert prefill.book.ids(Stage.DECODING) == [1] and prefill.has_work()
    pw.sent.clear()
    prefill.step()
    assert tokens_of(pw.sent, 1) == 1


def test_a_fresh_request_refused_while_draining_waits_for_room_and_is_not_kept() -> None:
    """A draining worker keeps no new request (docs/reliability.md): one refused at its first
    hand-off waits, held, for a view with room."""
    pw = FakeWorker(0, 64, [])
    pw.cfg = load_config(None, ["prefill.chunk_size=128", "predictor.kind=none",
                                "decode.policy=greedy", "dispatch.policy=power-of-two",
                                "prefill.local_finish_tokens=0"])
    prefill = PrefillRole(pw)  # type: ignore[arg-type]
    pw.pending_role = "decode"  # draining from the start
    prefill.handle(DecodeView(1, [DecodeInstanceView(1, 40, 48, 0, 0, 0)]))
    prefill.handle(AddRequest(1, list(range(5, 45)), SamplingParams(
        max_tokens=100, temperature=0.0, ignore_eos=True), 0.0))
    while not any(isinstance(m, Handoff) for m in pw.sent):
        prefill.step()
    prefill.handle(HandoffRejected(1, "decode worker has no free blocks"))
    assert prefill.book.ids(Stage.HELD) == [1] and not prefill.has_work()


def test_a_preempted_kept_request_is_not_overtaken_for_good_by_new_prompts() -> None:
    """Regression (review of session 63): a kept request preempted on a full prefill worker
    needs its whole context back (it cannot be handed back without its KV). New prompts took
    each block a pulled hand-off gave back, so under steady arrivals it never ran again (60
    rounds here). Its blocks now stay free for it while hand-offs still give blocks back."""
    from tetri_server.messages import KVPulled

    pw = FakeWorker(0, 24, [])
    pw.cfg = load_config(None, ["prefill.chunk_size=64", "predictor.kind=none",
                                "decode.policy=greedy", "dispatch.policy=power-of-two",
                                "prefill.local_finish_tokens=0"])
    prefill = PrefillRole(pw)  # type: ignore[arg-type]

    def add(req_id: int, num_prompt: int, max_tokens: int) -> None:
        prefill.handle(AddRequest(req_id, list(range(5, 5 + num_prompt)), SamplingParams(
            max_tokens=max_tokens, temperature=0.0, ignore_eos=True), 0.0))

    add(1, 160, 400)
    while 1 not in prefill.book.ids(Stage.HELD) + prefill.book.ids(Stage.DECODING):
        prefill.step()
    if 1 in prefill.book.ids(Stage.HELD):
        prefill._keep(1, 0.0)
    prefill.handle(DecodeView(1, [DecodeInstanceView(1, 0, 48, 0, 0, 0)]))  # no room: held
    for req_id in (10, 11, 12):
        add(req_id, 64, 50)
    for _ in range(40):
        prefill.step()
    assert prefill.admission.running_ids == () and len(prefill.admission) == 1  # preempted
    pw.sent.clear()
    for i in range(60):  # a prompt arrives and one hand-off goes (and is pulled) each round
        add(100 + i, 64, 50)
        prefill.handle(DecodeView(2 + i, [DecodeInstanceView(1, 9, 48, 0, 0, 0)], 2 + i))
        prefill.step()
        for m in [m for m in pw.sent if isinstance(m, Handoff)]:
            prefill.handle(KVPulled(m.req_id))
        if tokens_of(pw.sent, 1):
            break
    assert tokens_of(pw.sent, 1), "the preempted request never ran again"


def test_a_prompt_routed_to_a_decode_worker_is_not_overtaken_by_later_hand_offs() -> None:
    """Regression (review of session 63): a decode worker took every hand-off that left its
    running batch room, the blocks of the prompt routed to it (which the router had checked)
    included: under a stream of hand-offs the prompt's first token came after 178 decode
    steps and 48 hand-offs. A hand-off now leaves the first queued prompt its blocks."""
    from tetri_server.messages import HandoffRejected
    from tetri_server.policy import LocalPrefill
    from tetri_server.workers.decode import DecodeRole

    w = FakeWorker(1, 32, [])
    w.cfg = load_config(None, ["predictor.kind=none", "decode.policy=greedy",
                               "decode.max_batch=16", "decode.local_prefill_tokens=64"])
    decode = DecodeRole(w)  # type: ignore[arg-type]
    next_id = iter(range(100, 10_000))

    def handoff(max_tokens: int) -> None:
        decode.handle(Handoff(next(next_id), 0, list(range(8)), list(range(5, 35)) + [7], 30,
                              SamplingParams(max_tokens=max_tokens, temperature=0.0,
                                             ignore_eos=True), 0, 0, 0.0, dst_worker=1))

    for i in range(6):
        handoff(10 + 6 * i)
    for _ in range(3):
        decode.step()
    assert LocalPrefill(16).fits(100, w.allocator.num_free)  # the router sends it here
    decode.handle(AddRequest(1, list(range(5, 105)), SamplingParams(
        max_tokens=5, temperature=0.0, ignore_eos=True), 0.0, prefill_chunk=64))
    for _ in range(3):  # dispatched on the view the router read
        handoff(36)
    w.sent.clear()
    steps = 0
    while not tokens_of(w.sent, 1) and steps < 200:
        w.sent = [m for m in w.sent if not isinstance(m, HandoffRejected)]
        for _ in range(3):
            handoff(36)
        decode.step()
        steps += 1
    assert steps < 10, f"first token after {steps} decode steps"
