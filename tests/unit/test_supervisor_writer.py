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


def test_a_full_inbox_kills_a_worker_only_once_it_shows_no_life(monkeypatch) -> None:
    """Regression (review of session 62): a burst of long prompts that filled a worker's inbox
    during one long step (a coupled worker prefilling whole prompts on a CPU: tens of seconds,
    its heartbeat stamped all along) got it killed after 30 s: its requests re-ran, and the
    re-run could do it again, up to ``max_restarts``. While it stamps its heartbeat the
    writer waits; once the stamps stop, the worker is killed as before."""
    import tetri_server.control.supervisor as sup

    monkeypatch.setattr(sup, "SEND_TIMEOUT_S", 0.2)
    run = new_run_id()
    inbox: Channel[Any] = Channel.create(f"{run}-in", 1 << 12, m.ToWorker)
    outbox: Channel[Any] = Channel.create(f"{run}-out", 1 << 12, m.FromWorker)
    kills: list[float] = []

    class Proc:
        def kill(self) -> None:
            kills.append(time.monotonic())

    async def main() -> float:
        h = WorkerHandle(0, "coupled", 0, Proc(), inbox, outbox, "", -1)  # type: ignore[arg-type]
        h.last_heard_s = 0.0
        h._writer = asyncio.get_running_loop().create_task(h._write_loop())
        for i in range(200):  # far more than the ring holds: nobody reads it
            h.post(m.AddRequest(i, [7] * 16, m.SamplingParams(), 0.0))
        beat_until = time.monotonic() + 1.5
        while time.monotonic() < beat_until:  # the worker steps: its heartbeat goes on
            outbox.beat()
            await asyncio.sleep(0.05)
        assert kills == [] and not h._writer.done()
        await asyncio.wait_for(h._writer, 5.0)  # stamps stopped: killed within the bound
        return beat_until

    try:
        beat_until = asyncio.run(main())
    finally:
        for ch in (inbox, outbox):
            ch.close()
            ch.unlink()
    assert len(kills) == 1 and kills[0] >= beat_until
