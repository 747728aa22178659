"""``Worker.handle`` and ``Worker.load_report`` on a worker without a model: the prompt stamps
(``AddRequest.add_seq``) its reports carry, which the global pick trusts (test_policy_global)."""

from __future__ import annotations

from typing import Any

from tetri_server.messages import (
    AddRequest,
    Guide,
    LoadReport,
    RequestFailed,
    SamplingParams,
    SetRole,
)
from tetri_server.workers.base import Worker


class _Role:
    name = "prefill"

    def __init__(self) -> None:
        self.handled: list[object] = []

    def handle(self, msg: object) -> None:
        self.handled.append(msg)

    def load_report(self) -> LoadReport:
        return LoadReport(0, "prefill", len(self.handled), 0, 0, 10, 10, 0, 0, 0, 0.0)


class _Grammars:
    def check(self, guide: Any) -> str | None:
        return None if guide is None else "bad guide"


def worker() -> tuple[Worker, list[object]]:
    w = object.__new__(Worker)  # the state handle() and load_report() use, no model or pool
    sent: list[object] = []
    w.last_add_seq = 0
    w.role = _Role()  # type: ignore[assignment]
    w.grammars = _Grammars()  # type: ignore[assignment]
    w.send = sent.append  # type: ignore[method-assign,assignment]
    return w, sent


def add(req_id: int, add_seq: int, guide: Guide | None = None) -> AddRequest:
    return AddRequest(req_id, [1, 2, 3], SamplingParams(guide=guide), 0.0, add_seq=add_seq)


def test_a_report_carries_the_last_prompt_stamp_handled() -> None:
    w, _ = worker()
    assert w.load_report().last_add_seq == 0  # nothing handled yet: count every prompt sent
    w.handle(add(7, 1))
    w.handle(add(8, 2))
    report = w.load_report()
    assert report.last_add_seq == 2 and report.num_waiting == 2  # both in the role's count


def test_a_prompt_failed_on_arrival_is_handled_too() -> None:
    """A prompt refused before any work (its guide does not compile) is answered at once; the
    pick must stop counting it, so its stamp counts as handled."""
    w, sent = worker()
    w.handle(add(7, 1, guide=Guide("regex", "(")))
    assert [type(m) for m in sent] == [RequestFailed]
    assert w.load_report().last_add_seq == 1


def test_a_flip_cancel_that_crossed_the_switch_does_not_flip_back() -> None:
    """Regression: control's flip timed out just as the worker switched (its Ready on the way)
    and sent SetRole(old role) to cancel; the worker, already in the new role, took it for a
    new flip and switched back later, unasked (no drain, no cooldown, maybe the last worker of
    a role). A cancel now names the flip it cancels."""
    w, _ = worker()  # a prefill worker
    w.pending_role = None
    w.handle(SetRole("decode"))
    assert w.pending_role == "decode"
    w.handle(SetRole("decode", cancel=True))  # still pending: dropped
    assert w.pending_role is None
    w.role.name = "decode"  # switched; the cancel of that flip arrives after
    w.handle(SetRole("decode", cancel=True))
    assert w.pending_role is None
    w.handle(SetRole("prefill"))  # a flip back control asked for
    assert w.pending_role == "prefill"
    w.handle(SetRole("decode"))  # to the current role: nothing pending
    assert w.pending_role is None


def test_a_flip_whose_caller_gives_up_is_cancelled_on_the_worker() -> None:
    """Regression: a POST /admin/flip whose client went away cancelled the flip's task; only a
    timeout sent the worker its cancel, so it still flipped later, behind control's back (and
    control already routed work to it again)."""
    import asyncio
    from types import SimpleNamespace

    from tetri_server.config import Config
    from tetri_server.control.flip import FlipController

    async def main() -> list[object]:
        posted: list[object] = []
        host = SimpleNamespace(cfg=Config(), workers={0: SimpleNamespace(post=posted.append)},
                               draining=set(), route_parked=lambda: None)
        flips = FlipController(host)  # type: ignore[arg-type]
        task = asyncio.ensure_future(flips._run(0, "prefill", "decode"))
        await asyncio.sleep(0.05)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        assert host.draining == set()
        return posted

    posted = asyncio.run(main())
    assert posted == [SetRole("decode"), SetRole("decode", cancel=True)]


def test_workers_sharing_a_gpu_split_its_kv_memory_evenly_whoever_sizes_first() -> None:
    """Regression (review of session 63): each worker on a GPU took memory_fraction of what
    was free when it sized its pool: two starting together each took half of all of it, and
    one sizing after the other got half the first's pool (the decode worker, often)."""
    from tetri_server.workers.base import cuda_kv_budget, workers_on_device

    assert [workers_on_device(d, 2, 1) for d in (0,)] == [2]  # 1 prefill + 1 decode, one GPU
    assert [workers_on_device(d, 5, 2) for d in (0, 1)] == [3, 2]
    gib, total, weights = 2**30, 80 * 2**30, 16 * 2**30
    first = cuda_kv_budget(total - 2 * weights, total, weights, 2, 0.5)  # both weights loaded
    second = cuda_kv_budget(total - 2 * weights - first, total, weights, 2, 0.5)
    assert first == second == 12 * gib
    alone = cuda_kv_budget(total - weights - gib, total, weights, 1, 0.5)  # a CUDA context
    assert alone == (total - weights - gib) * 0.5


def _sizing_worker(monkeypatch: Any, avail_bytes: int, previous_num_blocks: int) -> Worker:
    """A CPU worker with only what ``_blocks_from_memory`` reads; ``avail_bytes`` of RAM free."""
    import os
    from types import SimpleNamespace

    import torch

    from tetri_server.config import load_config
    from tetri_server.engine.spec import ModelSpec

    page = 4096
    real_sysconf = os.sysconf
    monkeypatch.setattr(os, "sysconf", lambda name: {"SC_AVPHYS_PAGES": avail_bytes // page,
                                                     "SC_PAGE_SIZE": page}.get(name)
                        or real_sysconf(name))
    monkeypatch.setattr(os, "statvfs", lambda path: SimpleNamespace(f_bavail=2**40 // page,
                                                                   f_frsize=page))
    w = object.__new__(Worker)
    w.cfg = load_config(None, ["cluster.prefill_workers=1", "cluster.decode_workers=1",
                                 "decode.max_batch=4096"])
    w.spec = SimpleNamespace(previous_num_blocks=previous_num_blocks)  # type: ignore[assignment]
    w.worker_id, w.device, w.max_model_len = 1, torch.device("cpu"), 2048
    w.model_spec = ModelSpec("llama", 100, 512, 8, 8, 8, 64, 1408, 2048, 1e-6, False, (2,), 1)
    return w


def test_a_restarted_cpu_worker_gets_the_kv_pool_it_had(monkeypatch: Any) -> None:
    """Regression (review of session 64): a CPU worker sized its pool from the RAM available
    when it started, split among all workers. Restarted, its peers' pools counted as used:
    with 2 workers at the default fraction it got a quarter fewer blocks, for good."""
    import torch

    gib = 2**30
    first = _sizing_worker(monkeypatch, 23 * gib, 0)._blocks_from_memory(torch.float32)
    pool = first * 16 * 2 * 8 * 8 * 64 * 4  # blocks x tokens x K/V x layers x heads x dim x 4 B
    assert abs(pool - 23 * gib * 0.5 / 2) < 2 * gib / 1000  # half the RAM, split in two
    # restarted: its peer's pool (and a dead one's, still mapped) count as used now
    again = _sizing_worker(monkeypatch, 23 * gib - 2 * pool, first)._blocks_from_memory(
        torch.float32)
    assert again == first
    # memory really short now (other programs took it): never more than half of what is free
    short = _sizing_worker(monkeypatch, pool, first)._blocks_from_memory(torch.float32)
    assert short == first // 2
