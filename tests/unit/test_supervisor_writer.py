"""The control process's writer to a worker's inbox: a message that cannot be sent fails its
own request, every message after it still reaches the worker, and a full inbox kills only a
worker that shows no life."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Iterator
from typing import Any

from tetri_server import messages as m
from tetri_server.channel import Channel, MessageTooLarge, new_run_id
from tetri_server.control.supervisor import WorkerHandle


@contextlib.contextmanager
def rings(capacity: int) -> Iterator[tuple[Channel[Any], Channel[Any]]]:
    """A worker's (inbox, outbox) of ``capacity`` bytes each, unlinked afterwards."""
    run = new_run_id()
    inbox: Channel[Any] = Channel.create(f"{run}-in", capacity, m.ToWorker)
    outbox: Channel[Any] = Channel.create(f"{run}-out", capacity, m.FromWorker)
    try:
        yield inbox, outbox
    finally:
        for ch in (inbox, outbox):
            ch.close()
            ch.unlink()


def test_a_message_that_does_not_encode_fails_alone_and_the_rest_reach_the_worker() -> None:
    """Regression: a request whose guide held a lone UTF-16 surrogate (``"\\ud800"``, valid
    JSON) made msgspec raise UnicodeEncodeError in the writer task, which ended silently: every
    later message to that worker (requests, aborts, roles, shutdown) stayed queued for good
    while the worker's load reports kept it looking healthy."""
    failed: list[tuple[Any, Exception]] = []
    bad = m.AddRequest(1, [5, 6], m.SamplingParams(guide=m.Guide("regex", "a\ud800")), 0.0)
    big = m.AddRequest(3, [1 << 20] * (1 << 15), m.SamplingParams(), 0.0)  # past the ring

    async def main(inbox: Channel[Any], outbox: Channel[Any]) -> list[Any]:
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

    with rings(1 << 16) as (inbox, outbox):
        got = asyncio.run(main(inbox, outbox))
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
    kills: list[float] = []

    class Proc:
        def kill(self) -> None:
            kills.append(time.monotonic())

    async def main(inbox: Channel[Any], outbox: Channel[Any]) -> float:
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

    with rings(1 << 12) as (inbox, outbox):
        beat_until = asyncio.run(main(inbox, outbox))
    assert len(kills) == 1 and kills[0] >= beat_until
