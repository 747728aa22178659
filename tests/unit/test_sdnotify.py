"""sd_notify as systemd sees it: datagrams on a real unix socket named by $NOTIFY_SOCKET, a
watchdog fed from the event loop at WATCHDOG_USEC/2, and the shipped unit's sandbox score."""

from __future__ import annotations

import asyncio
import os
import re
import shutil
import socket
import statistics
import subprocess
import time
import uuid
from pathlib import Path

import pytest

from tetri_server.sdnotify import Notifier

UNIT = Path(__file__).resolve().parents[2] / "deploy" / "tetri-server.service"


@pytest.fixture
def notify_sock(tmp_path, monkeypatch):
    """A bound datagram socket standing in for systemd's, named by $NOTIFY_SOCKET."""
    path = tmp_path / "notify"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(str(path))
    sock.settimeout(5)
    monkeypatch.setenv("NOTIFY_SOCKET", str(path))
    monkeypatch.delenv("WATCHDOG_USEC", raising=False)
    monkeypatch.delenv("WATCHDOG_PID", raising=False)
    yield sock
    sock.close()


def _pending(sock: socket.socket) -> list[bytes]:
    out = []
    sock.setblocking(False)
    try:
        while True:
            out.append(sock.recv(4096))
    except BlockingIOError:
        return out
    finally:
        sock.settimeout(5)


def test_ready_stopping_watchdog_datagrams(notify_sock):
    n = Notifier.from_env()
    assert "NOTIFY_SOCKET" not in os.environ  # workers spawned later must not inherit it
    assert n.ready("serving tiny at http://127.0.0.1:8000")
    assert notify_sock.recv(4096) == b"READY=1\nSTATUS=serving tiny at http://127.0.0.1:8000"
    assert n.stopping("draining")
    assert notify_sock.recv(4096) == b"STOPPING=1\nSTATUS=draining"
    assert n.watchdog()
    assert notify_sock.recv(4096) == b"WATCHDOG=1"
    assert n.ready()
    assert notify_sock.recv(4096) == b"READY=1"


def test_abstract_socket(monkeypatch):
    name = f"tetri-test-{uuid.uuid4().hex}"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.bind("\0" + name)
        sock.settimeout(5)
        monkeypatch.setenv("NOTIFY_SOCKET", "@" + name)
        assert Notifier.from_env().ready("up")
        assert sock.recv(4096) == b"READY=1\nSTATUS=up"


def test_unset_is_a_silent_no_op(monkeypatch):
    monkeypatch.delenv("NOTIFY_SOCKET", raising=False)
    monkeypatch.setenv("WATCHDOG_USEC", "200000")
    n = Notifier.from_env()
    assert not n.enabled
    assert not n.ready("x") and not n.stopping() and not n.watchdog()
    assert n.start_watchdog() is None


def test_vanished_socket_does_not_raise(tmp_path, monkeypatch):
    monkeypatch.setenv("NOTIFY_SOCKET", str(tmp_path / "gone"))
    n = Notifier.from_env()
    assert n.enabled and not n.ready("x") and not n.watchdog()


def test_watchdog_env_is_honoured_only_for_our_pid():
    env = {"NOTIFY_SOCKET": "/run/x", "WATCHDOG_USEC": "30000000"}
    assert Notifier.from_env(dict(env), pid=42).watchdog_usec == 30_000_000
    assert Notifier.from_env(dict(env, WATCHDOG_PID="42"), pid=42).watchdog_usec == 30_000_000
    assert Notifier.from_env(dict(env, WATCHDOG_PID="43"), pid=42).watchdog_usec is None
    assert Notifier.from_env({"NOTIFY_SOCKET": "/run/x"}, pid=42).watchdog_usec is None
    assert Notifier.from_env(dict(env, WATCHDOG_USEC="soon"), pid=42).watchdog_usec is None


async def _collect(sock: socket.socket, seconds: float) -> list[float]:
    """Arrival times (loop clock) of WATCHDOG=1 datagrams over ``seconds``."""
    loop = asyncio.get_running_loop()
    times: list[float] = []

    def on_readable() -> None:
        for msg in _pending(sock):
            assert msg == b"WATCHDOG=1"
            times.append(loop.time())

    loop.add_reader(sock.fileno(), on_readable)
    try:
        await asyncio.sleep(seconds)
    finally:
        loop.remove_reader(sock.fileno())
    return times


async def test_watchdog_feeder_cadence_and_cancel(notify_sock, monkeypatch):
    monkeypatch.setenv("WATCHDOG_USEC", "200000")  # feed every 0.1 s
    monkeypatch.setenv("WATCHDOG_PID", str(os.getpid()))
    task = Notifier.from_env().start_watchdog()
    assert task is not None
    times = await _collect(notify_sock, 1.5)
    gaps = [b - a for a, b in zip(times, times[1:], strict=False)]
    assert len(times) >= 5, times  # ~15 when idle; a stalled loop on a busy machine sends fewer
    assert 0.05 <= statistics.median(gaps) <= 0.18, gaps  # half the period, not the whole one

    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    _pending(notify_sock)
    assert await _collect(notify_sock, 0.5) == []  # cancelled: nothing more, ever


async def test_blocked_loop_stops_feeding(notify_sock, monkeypatch):
    monkeypatch.setenv("WATCHDOG_USEC", "200000")
    task = Notifier.from_env().start_watchdog()
    assert task is not None
    await asyncio.sleep(0.3)
    _pending(notify_sock)
    time.sleep(0.6)  # a handler stuck in a sync call; a feeder thread would send ~6 meanwhile
    assert _pending(notify_sock) == []  # so systemd's watchdog fires and restarts us
    task.cancel()


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="needs systemd-analyze")
def test_unit_sandbox_exposure_is_low():
    out = subprocess.run(
        ["systemd-analyze", "security", "--offline=yes", str(UNIT)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    lines = out.stdout.strip().splitlines()
    assert lines, out.stderr
    m = re.search(r"Overall exposure level for \S+: ([0-9.]+)", lines[-1])
    assert m, lines[-1]
    assert float(m.group(1)) <= 3.0, "\n".join(line for line in lines if "✗" in line)


def test_unit_uses_the_notify_protocol():
    text = UNIT.read_text()
    # MemoryDenyWriteExecute=yes would kill torch's JIT on first use, not at start-up.
    for line in ("Type=notify", "NotifyAccess=main", "WatchdogSec=30", "MemoryDenyWriteExecute=no"):
        assert re.search(rf"^{re.escape(line)}$", text, re.M), line
