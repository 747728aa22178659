"""Stopping the workers: a stop while they load their model (they read no message until then)
is bounded once for all of them, not once per worker."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time

import pytest

from tetri_server.config import load_config
from tetri_server.control import supervisor
from tetri_server.control.supervisor import Supervisor


class LoadingWorker:
    """A worker process that never reads its inbox (it is loading), as a stand-in handle."""

    def __init__(self, worker_id: int) -> None:
        self.worker_id = worker_id
        self.alive = True
        self.proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])

    def post(self, msg: object) -> None:
        pass


def test_a_stop_while_workers_load_waits_once_for_all_then_kills_them(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Regression: each worker was waited for in turn, up to 10 s each: a SIGTERM during
    the start-up of 8 workers took 80 s, past systemd's stop timeout."""
    monkeypatch.setattr(supervisor, "SHUTDOWN_WAIT_S", 1.0)
    reaped: list[int] = []

    def reap(h: LoadingWorker) -> None:
        reaped.append(h.worker_id)
        h.alive = False

    monkeypatch.setattr(supervisor, "reap", reap)
    sup = Supervisor(load_config(None, []), lambda h, m: None, lambda h, c: None,
                     lambda m, e: None, None)
    workers = [LoadingWorker(i) for i in range(5)]
    sup.workers = dict(enumerate(workers))  # type: ignore[arg-type]
    try:
        t0 = time.monotonic()
        asyncio.run(sup.shutdown())
        elapsed = time.monotonic() - t0
    finally:
        for w in workers:
            w.proc.kill()
            w.proc.wait()
    assert elapsed < 4.0  # one bound of 1 s for all; in turn it was at least 5 s
    assert reaped == [0, 1, 2, 3, 4]
    assert all(w.proc.returncode is not None and w.proc.returncode < 0 for w in workers)
