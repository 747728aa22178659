"""``Monitor.pick``: the global pick over the workers control may route to now (ready and not
draining), with each prefill worker's chunk from its handle (elastic P/D on by default; its
decode side routes prompts by load with ``decode.local_prefill_margin`` >= 0, since session 41
not by default)."""

from __future__ import annotations

from types import SimpleNamespace

import msgspec

from tetri_server.config import load_config
from tetri_server.control.accounting import RequestAccounting
from tetri_server.control.monitor import Monitor
from tetri_server.control.requests import ReqState
from tetri_server.control.routing import Router
from tetri_server.control.table import RequestTable
from tetri_server.messages import Abort, AddRequest, LoadReport, SamplingParams
from tetri_server.metrics import Metrics

BY_LOAD = ("decode.local_prefill_margin=1",)  # prompts to a decode worker by load


def report(wid: int, role: str, queued_tokens: int) -> LoadReport:
    return LoadReport(worker_id=wid, role=role, num_waiting=0, num_running=0,
                      num_queued_prompt_tokens=queued_tokens, num_free_blocks=1000,
                      num_total_blocks=1000, num_heavy=0, num_light=0,
                      predicted_demand_blocks=0, busy_s=0.0)


def test_only_ready_workers_not_draining_take_prompts_with_their_own_chunk() -> None:
    workers = {0: SimpleNamespace(worker_id=0, role="prefill", is_ready=True, chunk_size=256),
               1: SimpleNamespace(worker_id=1, role="decode", is_ready=True, chunk_size=0)}
    draining: set[int] = set()
    monitor = Monitor(load_config(None, ["cluster.mode=disaggregated", *BY_LOAD]), workers,
                      draining, Metrics("m"))

    def pick_after_reports() -> int | None:
        monitor.on_report(workers[0], report(0, "prefill", 900))  # a long prompt queued
        monitor.on_report(workers[1], report(1, "decode", 0))
        return monitor.pick(100)

    assert pick_after_reports() == 1  # 900 tokens ahead there, none on the decode worker
    workers[1].is_ready = False  # restarting, or stalled
    assert pick_after_reports() == 0
    workers[1].is_ready = True
    draining.add(1)  # flipping
    assert pick_after_reports() == 0
    draining.clear()
    workers[0].chunk_size = 1024  # the prefill worker starts it within its next chunk
    assert pick_after_reports() == 0
    workers[0].is_ready = False  # and with it down, the decode worker takes the prompt
    assert pick_after_reports() == 1


def pair_monitor(*sets: str) -> tuple[Monitor, dict[int, SimpleNamespace]]:
    """A monitor over one prefill worker (chunk 256) and one decode worker, both ready, with
    the config ``sets``."""
    workers = {0: SimpleNamespace(worker_id=0, role="prefill", is_ready=True, chunk_size=256),
               1: SimpleNamespace(worker_id=1, role="decode", is_ready=True, chunk_size=0)}
    return (Monitor(load_config(None, ["cluster.mode=disaggregated", *BY_LOAD, *sets]), workers,
                    set(), Metrics("m")), workers)


def pick_with(prefill_queued: int, decode: LoadReport, *sets: str) -> int | None:
    """Where ``pair_monitor(*sets)`` sends a 100-token prompt once the prefill worker reports
    ``prefill_queued`` prompt tokens queued and the decode worker reports ``decode``."""
    monitor, workers = pair_monitor(*sets)
    monitor.on_report(workers[0], report(0, "prefill", prefill_queued))
    monitor.on_report(workers[1], decode)
    return monitor.pick(100)


def test_the_margin_from_the_config_decides_when_a_prompt_goes_to_the_decode_worker() -> None:
    idle = report(1, "decode", 0)
    assert pick_with(200, idle) == 0  # within the next chunk: a margin of one chunk
    assert pick_with(200, idle, "decode.local_prefill_margin=0") == 1  # any backlog: there
    # below 0: never while the prefill worker serves, whatever its backlog
    assert pick_with(90_000, idle, "decode.local_prefill_margin=-1") == 0


def test_the_gap_bound_from_the_config_reaches_the_pick() -> None:
    slow = msgspec.structs.replace(report(1, "decode", 0), step_s=0.050,
                                   fastest_step_s=0.010)  # 5x its fastest
    fast = msgspec.structs.replace(slow, step_s=0.019)  # under twice its fastest
    assert pick_with(900, slow) == 0  # the default bound: 2x its fastest
    assert pick_with(900, fast) == 1
    assert pick_with(900, slow, "decode.local_prefill_max_gap_x=0") == 1  # no bound
    assert pick_with(900, slow, "decode.local_prefill_max_gap_x=3") == 0
    assert pick_with(900, slow, "decode.local_prefill_max_gap_x=6") == 1


def test_the_decode_view_counts_prompts_routed_to_a_decode_worker_since_its_report() -> None:
    # a decode worker prefilling a routed prompt in one long step cannot report until it ends;
    # the prefill workers must see it busy meanwhile (a hand-off would wait behind the prompt)
    monitor, workers = pair_monitor()
    monitor.on_report(workers[0], report(0, "prefill", 900))
    monitor.on_report(workers[1], report(1, "decode", 0))
    assert [d.num_queued_prompt_tokens for d in monitor.decode_view().decodes] == [0]
    assert monitor.pick(1000) == 1
    assert [d.num_queued_prompt_tokens for d in monitor.decode_view().decodes] == [1000]
    # prefilled: its report says so, and that the view is worth re-sending at once
    assert monitor.on_report(workers[1], report(1, "decode", 0))
    assert [d.num_queued_prompt_tokens for d in monitor.decode_view().decodes] == [0]
    assert not monitor.on_report(workers[1], report(1, "decode", 0))  # no change: none
    assert not monitor.on_report(workers[0], report(0, "prefill", 0))


def test_a_prompt_routed_to_a_decode_worker_sends_the_decode_view_at_once() -> None:
    # the prefill worker must not wait for the next tick to learn it (a hand-off it makes
    # meanwhile waits behind the prompt): the router tells the cluster, which re-sends the view
    cfg = load_config(None, ["cluster.mode=disaggregated", *BY_LOAD])
    posted: dict[int, list[object]] = {0: [], 1: []}
    workers = {w: SimpleNamespace(worker_id=w, role=role, is_ready=True, chunk_size=chunk,
                                  post=posted[w].append)
               for w, role, chunk in ((0, "prefill", 256), (1, "decode", 0))}
    monitor = Monitor(cfg, workers, set(), Metrics("m"))
    views = []
    router = Router(cfg, workers, set(), RequestTable(workers, 100), monitor,
                    RequestAccounting(cfg, Metrics("m")),
                    lambda: views.append(monitor.decode_view()))
    table = router.table
    monitor.on_report(workers[0], report(0, "prefill", 900))
    monitor.on_report(workers[1], report(1, "decode", 0))
    params = SamplingParams(max_tokens=4)
    router.route(table.add([1] * 100, params, "", None))  # 900 tokens ahead: the decode worker
    assert [type(m).__name__ for m in posted[1]] == ["AddRequest"]
    assert posted[1][0].add_seq == monitor.picker.stamp(1) == 1  # stamped for its report
    # its slices: at most the prefill side's chunk and prefill.local_decode_chunk (128)
    assert posted[1][0].prefill_chunk == 128
    assert Monitor(load_config(None, ["prefill.local_decode_chunk=0"]), workers, set(),
                   Metrics("m")).prefill_chunk() == 256  # no cap: the chunk
    assert [d.num_queued_prompt_tokens for v in views for d in v.decodes] == [100]
    # a view re-sent from the same reports keeps their generation (dispatchers keep counting
    # their own hand-offs); a decode worker's report moves it
    assert views[0].generation == monitor.decode_view().generation
    stale = msgspec.structs.replace(report(1, "decode", 0), last_add_seq=0)  # left before it
    monitor.on_report(workers[1], stale)
    after = monitor.decode_view()
    assert after.generation > views[0].generation
    assert [d.num_queued_prompt_tokens for d in after.decodes] == [100]  # still counted
    monitor.on_report(workers[1], msgspec.structs.replace(stale, num_queued_prompt_tokens=100,
                                                          last_add_seq=1))
    assert [d.num_queued_prompt_tokens for d in monitor.decode_view().decodes] == [100]
    monitor.on_report(workers[0], report(0, "prefill", 0))  # the prefill worker is free
    router.route(table.add([1] * 100, params, "", None))
    assert [type(m).__name__ for m in posted[0]] == ["AddRequest"]
    assert len(views) == 1  # a prompt to a prefill worker changes no decode worker's load


def test_the_prefill_chunk_sent_to_decode_workers_is_the_smallest_of_those_serving() -> None:
    workers = {w: SimpleNamespace(worker_id=w, role=role, is_ready=True, chunk_size=chunk)
               for w, role, chunk in ((0, "prefill", 256), (1, "prefill", 512),
                                      (2, "decode", 0))}
    draining: set[int] = set()
    monitor = Monitor(load_config(None, ["cluster.mode=disaggregated", *BY_LOAD,
                                         "prefill.local_decode_chunk=0"]), workers, draining,
                      Metrics("m"))
    assert monitor.prefill_chunk() == 256
    draining.add(0)  # flipping to decode
    assert monitor.prefill_chunk() == 512
    workers[1].is_ready = False  # restarting: none serving, the decode side's own limit
    assert monitor.prefill_chunk() == 0


def test_a_request_routed_in_a_decode_outage_waits_bounded_only_while_it_lasts() -> None:
    # Regression: the bound stayed after a decode worker served again, and a request kept
    # decoding on the prefill worker (or queued there) was failed at it.
    cfg = load_config(None, ["cluster.mode=disaggregated", "cluster.worker_wait_s=5"])
    workers = {0: SimpleNamespace(worker_id=0, role="prefill", is_ready=True, chunk_size=64,
                                  post=lambda msg: None)}
    monitor = Monitor(cfg, workers, set(), Metrics("m"))
    router = Router(cfg, workers, set(), RequestTable(workers, 100), monitor,
                    RequestAccounting(cfg, Metrics("m")), lambda: None)
    table = router.table
    monitor.on_report(workers[0], report(0, "prefill", 0))
    req = table.add([1] * 10, SamplingParams(max_tokens=4), "", None)
    router.route(req)
    assert req.owner == 0 and req.wait_deadline_s is not None  # no decode worker: bounded
    late = req.wait_deadline_s + 1
    assert table.expired(late, decode_serving=False) == [req]  # the outage lasts: 503
    assert table.expired(late, decode_serving=True) == []  # it is over: nothing to wait for
    assert req.wait_deadline_s is None
    parked = table.add([1] * 10, SamplingParams(max_tokens=4), "", None)
    table.park(parked, late)  # no worker at all could take it: it still waits for one
    assert table.expired(late + 1, decode_serving=True) == [parked]


def test_a_request_withdrawn_from_a_decode_worker_may_run_again_there_as_a_new_attempt(
        ) -> None:
    """With CUDA IPC and elastic P/D, a hand-off withdrawn because its prefill worker died
    re-runs at once; with no prefill worker serving, the pick may choose the decode worker it
    was withdrawn from. It gets the Abort of the old attempt and then the re-run under a new
    id (session 61 parked it instead, until another worker came; the ids now keep the old
    attempt's tokens out: ``test_control_owner``)."""
    cfg = load_config(None, ["cluster.mode=disaggregated", "cluster.elastic=on"])
    posted: dict[int, list[object]] = {0: [], 1: []}
    workers = {0: SimpleNamespace(worker_id=0, role="prefill", is_ready=False, chunk_size=64,
                                  alive=False, post=posted[0].append),
               1: SimpleNamespace(worker_id=1, role="decode", is_ready=True, chunk_size=0,
                                  alive=True, post=posted[1].append)}
    monitor = Monitor(cfg, workers, set(), Metrics("m"))
    router = Router(cfg, workers, set(), RequestTable(workers, 100), monitor,
                    RequestAccounting(cfg, Metrics("m")), lambda: None)
    monitor.on_report(workers[1], report(1, "decode", 0))
    req = router.table.add([1] * 10, SamplingParams(max_tokens=4), "", None)
    req.owner, req.src, req.state = 1, 0, ReqState.HANDOFF
    old = req.wire_id
    router.withdraw(req)
    abort, again = posted[1]
    assert isinstance(abort, Abort) and abort.req_id == old
    assert isinstance(again, AddRequest) and again.req_id == req.wire_id != old
    assert req.owner == 1 and req.state is ReqState.PREFILL and posted[0] == []


def test_dropped_waiting_kv_is_its_own_counter_not_a_preemption() -> None:
    """Regression (review of session 49): a decode worker that drops the KV of requests
    waiting for admission (to keep its running batch going) reported them as preemptions, so
    ``tetri_preemptions`` said running streams were stalled and recomputed when none was. The
    report now carries them apart, through the channel's encoding, and /metrics shows them as
    ``tetri_waiting_kv_drops``."""
    monitor, workers = pair_monitor()
    sent = msgspec.structs.replace(report(1, "decode", 0), num_preemptions=1, num_kv_drops=3)
    got = msgspec.msgpack.decode(msgspec.msgpack.encode(sent), type=LoadReport)
    monitor.on_report(workers[1], got)
    text = monitor.metrics.render().decode()
    assert 'tetri_preemptions_total{model_name="m"} 1.0' in text
    assert 'tetri_waiting_kv_drops_total{model_name="m"} 3.0' in text


def test_a_flipped_worker_keeps_its_busy_total_and_a_restarted_one_starts_at_zero() -> None:
    """Regression (review of session 64): control's placeholder report of a worker that just
    flipped said busy_s 0, while the worker's process goes on counting its total (300 s of
    prefill here). A flip-rule tick between it and the worker's first report read the whole
    past as the new role's first window: 100% busy, and a second worker flipped. A restarted
    worker is a new process: 0."""
    from tetri_server.messages import PoolHandle, Ready

    monitor, workers = pair_monitor()
    monitor.on_report(workers[0], msgspec.structs.replace(report(0, "prefill", 0),
                                                          busy_s=300.0))
    pool = PoolHandle(0, "shm", "x", 2, 64, 16, 4, 8, "float32")
    workers[0].role = "decode"
    monitor.on_ready(workers[0], Ready(0, "decode", pool, 0, 1))  # flipped
    assert monitor.reports[0].busy_s == 300.0 and monitor.reports[0].role == "decode"
    monitor.remove(0)  # died
    monitor.on_ready(workers[0], Ready(0, "decode", pool, 0, 2))  # restarted
    assert monitor.reports[0].busy_s == 0.0
