"""``Monitor.pick``: the global pick over the workers control may route to now (ready and not
draining), with each prefill worker's chunk from its handle (elastic P/D on by default)."""

from __future__ import annotations

from types import SimpleNamespace

from tetri_server.config import load_config
from tetri_server.control.monitor import Monitor
from tetri_server.messages import LoadReport
from tetri_server.metrics import Metrics


def report(wid: int, role: str, queued_tokens: int) -> LoadReport:
    return LoadReport(worker_id=wid, role=role, num_waiting=0, num_running=0,
                      num_queued_prompt_tokens=queued_tokens, num_free_blocks=1000,
                      num_total_blocks=1000, num_heavy=0, num_light=0,
                      predicted_demand_blocks=0, busy_s=0.0)


def test_only_ready_workers_not_draining_take_prompts_with_their_own_chunk() -> None:
    workers = {0: SimpleNamespace(worker_id=0, role="prefill", is_ready=True, chunk_size=256),
               1: SimpleNamespace(worker_id=1, role="decode", is_ready=True, chunk_size=0)}
    draining: set[int] = set()
    monitor = Monitor(load_config(None, ["cluster.mode=disaggregated"]), workers, draining,
                      Metrics("m"))

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


def test_the_decode_view_counts_prompts_routed_to_a_decode_worker_since_its_report() -> None:
    # a decode worker prefilling a routed prompt in one long step cannot report until it ends;
    # the prefill workers must see it busy meanwhile (a hand-off would wait behind the prompt)
    workers = {0: SimpleNamespace(worker_id=0, role="prefill", is_ready=True, chunk_size=256),
               1: SimpleNamespace(worker_id=1, role="decode", is_ready=True, chunk_size=0)}
    monitor = Monitor(load_config(None, ["cluster.mode=disaggregated"]), workers, set(),
                      Metrics("m"))
    monitor.on_report(workers[0], report(0, "prefill", 900))
    monitor.on_report(workers[1], report(1, "decode", 0))
    assert [d.num_queued_prompt_tokens for d in monitor.decode_view().decodes] == [0]
    assert monitor.pick(1000) == 1
    assert [d.num_queued_prompt_tokens for d in monitor.decode_view().decodes] == [1000]
    monitor.on_report(workers[1], report(1, "decode", 0))  # prefilled: its report says so
    assert [d.num_queued_prompt_tokens for d in monitor.decode_view().decodes] == [0]
