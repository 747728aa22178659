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


def test_reaping_a_killed_worker_that_does_not_exit_is_bounded(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """Regression (review of session 63): reap waited for the process with no bound; one stuck
    in the kernel (a hung GPU driver call) after its kill blocked the event loop for good."""
    import os
    from types import SimpleNamespace

    class StuckProc:
        pid = 4242

        def wait(self, timeout: float | None = None) -> int:
            if timeout is None:
                raise AssertionError("an unbounded wait")
            raise subprocess.TimeoutExpired("worker", timeout)

        def poll(self) -> None:
            return None

    monkeypatch.setattr(supervisor, "REAP_WAIT_S", 0.1, raising=False)

    async def main() -> int | None:
        ready = asyncio.get_running_loop().create_future()
        ready.set_result(None)
        channel = SimpleNamespace(close=lambda: None, unlink=lambda: None)
        handle = SimpleNamespace(worker_id=3, receiver=None, alive=False, _writer=None,
                                 pidfd=os.pidfd_open(os.getpid()), inbox=channel,
                                 outbox=channel, kv_segment="tetri-absent-kv", ready=ready,
                                 start_error="", proc=StuckProc())
        return supervisor.reap(handle)  # type: ignore[arg-type]

    assert asyncio.run(main()) is None
    assert "did not exit" in caplog.text
