"""`tetri-server serve` under a stand-in for systemd: READY=1 only once /health is 200, the
watchdog fed while serving, STOPPING=1 on SIGTERM, and workers that never see NOTIFY_SOCKET."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.request


def _recv(
    sock: socket.socket, prefix: bytes, timeout_s: float, proc: subprocess.Popen[bytes]
) -> tuple[bytes, list[bytes]]:
    """Wait for the first datagram starting with ``prefix``; also return those before it."""
    before: list[bytes] = []
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        sock.settimeout(min(1.0, max(0.01, deadline - time.monotonic())))
        try:
            msg = sock.recv(4096)
        except TimeoutError:
            if proc.poll() is not None and not msg_waiting(sock):
                break  # the server exited: nothing more will come
            continue
        if msg.startswith(prefix):
            return msg, before
        before.append(msg)
    raise AssertionError(
        f"no {prefix!r} within {timeout_s} s (exit code {proc.poll()}); got {before}"
    )


def msg_waiting(sock: socket.socket) -> bool:
    sock.setblocking(False)
    try:
        sock.recv(4096, socket.MSG_PEEK)
    except BlockingIOError:
        return False
    return True


def test_serve_notifies_ready_watchdog_and_stopping(tmp_path):
    path = tmp_path / "notify"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(str(path))
    env = dict(
        os.environ,
        TETRI_CACHE_DIR=str(tmp_path / "cache"),
        NOTIFY_SOCKET=str(path),
        WATCHDOG_USEC="1000000",
    )
    env.pop("WATCHDOG_PID", None)
    log = open(tmp_path / "server.log", "w")  # noqa: SIM115 - closed in finally
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "tetri_server",
            "serve",
            "--set",
            "server.port=0",
            "--set",
            "prefill.chunk_size=64",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
        env=env,
    )
    try:
        try:
            ready, before = _recv(sock, b"READY=1", 180, proc)
        except AssertionError:
            raise AssertionError((tmp_path / "server.log").read_text()[-4000:]) from None
        assert before == []  # no watchdog pings (nor anything else) before READY
        m = re.search(r"STATUS=serving tiny at (http://\S+)", ready.decode())
        assert m, ready
        url = m.group(1)
        with urllib.request.urlopen(url + "/health", timeout=10) as r:
            assert r.status == 200  # READY=1 came after the workers and the socket were up

        _recv(sock, b"WATCHDOG=1", 5, proc)
        with urllib.request.urlopen(url + "/admin/workers", timeout=10) as r:
            pids = [w["pid"] for w in json.load(r)["workers"]]
        for pid in pids:
            with open(f"/proc/{pid}/environ", "rb") as f:
                assert b"NOTIFY_SOCKET=" not in f.read()

        proc.send_signal(signal.SIGTERM)
        stopping, _ = _recv(sock, b"STOPPING=1", 30, proc)
        assert stopping == b"STOPPING=1\nSTATUS=draining"
        assert proc.wait(60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
        log.close()
        sock.close()
