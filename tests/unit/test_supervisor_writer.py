"""The control process's writer to a worker's inbox: a message that cannot be sent fails its
own request, and every message after it still reaches the worker."""

from __future__ import annotations

import asyncio
import time
from typing import Any

from tetri_server import messages as m
from tetri_server.channel import Channel, MessageTooLarge, new_run_id
from tetri_server.control.supervisor import WorkerHandle


def test_a_message_that_does_not_encode_fails_alone_and_the_rest_reach_the_worker() -> None:
    """Regression: a request whose guide held a lone UTF-16 surrogate (``"\\ud800"``, valid
    JSON) made msgspec raise UnicodeEncodeError in the writer task, which ended silently: every
    later message to that worker (requests, aborts, roles, shutdown) stayed queued for good
    while the worker's load reports kept it looking healthy."""
    run = new_run_id()
    inbox: Channel[Any] = Channel.create(f"{run}-in", 1 << 16, m.ToWorker)
    outbox: Channel[Any] = Channel.create(f"{run}-out", 1 << 16, m.FromWorker)
    failed: list[tuple[Any, Exception]] = []
    bad = m.AddRequest(1, [5, 6], m.SamplingParams(guide=m.Guide("regex", "a\ud800")), 0.0)
    big = m.AddRequest(3, [1 << 20] * (1 << 15), m.SamplingParams(), 0.0)  # past the ring

    async def main() -> list[Any]:
        h = WorkerHandle(0, "prefill", 0, None, inbox, outbox, "", -1,  # type: ignore[arg-type]
                         on_undeliverable=lambda msg, e: failed.append((msg, e)))
        h._writer = asyncio.get_running_loop().create_task(h._write_loop())
        for msg in (bad, m.Abort(1), big, m.Abort(2)):
            h.post(msg)
        got: list[Any] = []
        deadline = time.monotonic() + 20.0
        while len(got) < 2 and time.monotonic() < deadline and not h._writer.done():
            await asyncio.sleep(0.02)
            got += inbox.drain()
        assert not h._writer.done(), h._writer
        h._writer.cancel()
        return got

    try:
        got = asyncio.run(main())
    finally:
        for ch in (inbox, outbox):
            ch.close()
            ch.unlink()
    assert got == [m.Abort(1), m.Abort(2)]
    assert [(msg.req_id, type(e)) for msg, e in failed] == [
        (1, UnicodeEncodeError), (3, MessageTooLarge)]
