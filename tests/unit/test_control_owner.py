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
