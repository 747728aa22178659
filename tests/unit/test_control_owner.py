"""The control process's message handlers trust only the worker that holds a request: on a
``Cluster`` without processes (its request table and handlers, nothing spawned)."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

from tetri_server.control.cluster import Cluster
from tetri_server.control.table import RequestTable
from tetri_server.messages import RequestFailed, SamplingParams


def test_a_failure_from_a_worker_that_no_longer_holds_the_request_is_ignored() -> None:
    """Regression: a RequestFailed from a former owner (a CUDA hand-off withdrawn and re-run
    elsewhere, the old owner not yet through its Abort) failed the request that was running
    fine on its new worker."""

    async def main() -> None:
        cluster = object.__new__(Cluster)
        cluster.table = RequestTable({}, 10)
        req = cluster.table.add([1, 2], SamplingParams(), "", None)
        req.owner = 2  # re-run on worker 2; worker 1 held it before
        cluster._on_request_failed(SimpleNamespace(worker_id=1),  # type: ignore[arg-type]
                                   RequestFailed(req.req_id, "stale"))
        assert cluster.table.get(req.req_id) is req and req.queue.empty()
        cluster._on_request_failed(SimpleNamespace(worker_id=2),  # type: ignore[arg-type]
                                   RequestFailed(req.req_id, "bad"))
        assert cluster.table.get(req.req_id) is None and not req.queue.empty()

    asyncio.run(main())


def test_a_pulled_handoff_whose_prefill_worker_died_is_decoding() -> None:
    """Regression: a KVPulled for a request whose prefill worker had died meanwhile (its source
    reset: the shm pool outlives it) left it in HANDOFF for good, its hand-off time never
    observed (and a later death of its decode worker took it for a hand-off in flight)."""
    from tetri_server.control.requests import ReqState
    from tetri_server.control.routing import Router
    from tetri_server.messages import KVPulled

    async def main() -> None:
        phases: list[str] = []
        router = object.__new__(Router)
        router.table = RequestTable({}, 10)
        router.workers = {}
        router.metrics = SimpleNamespace(observe_phase=lambda phase, s: phases.append(phase))
        req = router.table.add([1, 2], SamplingParams(), "", None)
        req.owner, req.src, req.state = 2, -1, ReqState.HANDOFF  # its prefill worker died
        router.on_kv_pulled(SimpleNamespace(worker_id=1), KVPulled(req.req_id))  # not owner
        assert req.state is ReqState.HANDOFF and phases == []
        router.on_kv_pulled(SimpleNamespace(worker_id=2), KVPulled(req.req_id))
        assert req.state is ReqState.DECODE and phases == ["handoff"]

    asyncio.run(main())


def test_a_suspect_is_cleared_by_a_decode_steps_token_not_by_its_prefill_token() -> None:
    """Regression: a suspect's mark was cleared by its first token after the re-run, which in
    disaggregated mode comes from the prefill worker: a request that crashed a decode step was
    cleared before it reached one, the next suspect was released, and a second crash of the
    decode batch again named no one. Two tokens (a prefill and a decode step's) clear it."""
    from collections import deque

    from tetri_server.config import Config
    from tetri_server.control.routing import Router
    from tetri_server.messages import StepOutput, TokenDelta

    async def main() -> None:
        posted: list[object] = []
        cluster = object.__new__(Cluster)
        cluster.cfg = Config()
        cluster.table = RequestTable({}, 10)
        cluster.accounting = SimpleNamespace(on_delta=lambda req, d, now: None)
        router = object.__new__(Router)
        router.table, router.workers, router._trial, router._suspects = (
            cluster.table, {}, None, deque())
        router.route = lambda req: (setattr(req, "owner", 0), posted.append(req.req_id))
        cluster.router = router
        a, b = (cluster.table.add([1, 2], SamplingParams(), "", None) for _ in range(2))
        for req in (a, b):
            req.suspect = True
            router.rerun(req)
        assert posted == [a.req_id]  # b waits for a's trial
        cluster._on_step_output(SimpleNamespace(worker_id=0),  # type: ignore[arg-type]
                                StepOutput(0, [TokenDelta(a.req_id, [7])]))  # prefill's token
        assert a.suspect and posted == [a.req_id]
        cluster._on_step_output(SimpleNamespace(worker_id=0),  # type: ignore[arg-type]
                                StepOutput(0, [TokenDelta(a.req_id, [8])]))  # a decode step's
        assert not a.suspect and posted == [a.req_id, b.req_id]

    asyncio.run(main())
