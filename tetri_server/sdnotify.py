"""systemd's sd_notify protocol without libsystemd: readiness, stopping, and a watchdog fed by the
event loop itself.

``Notifier.from_env()`` reads ``$NOTIFY_SOCKET`` (a path, or ``@name`` for an abstract socket) and
``$WATCHDOG_USEC``/``$WATCHDOG_PID`` once, then removes them from ``os.environ`` so worker
processes spawned later neither inherit them nor notify on our behalf (the unit says
``NotifyAccess=main``). Without ``$NOTIFY_SOCKET`` every method is a no-op: the same code runs
under systemd, in a terminal and in tests.

The watchdog is fed from a task on the serving event loop, every ``WATCHDOG_USEC / 2``: if the
loop blocks (a handler stuck in a sync call, a deadlock), feeding stops and systemd kills and
restarts the service after ``WatchdogSec``.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
from collections.abc import MutableMapping

log = logging.getLogger(__name__)

_ENV_KEYS = ("NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID")


class Notifier:
    """One service manager connection. Sending never raises: a lost notification must not take
    the server down (systemd itself times out a start that never reports READY)."""

    def __init__(self, address: str | None, watchdog_usec: int | None = None) -> None:
        # address: a filesystem path, or "\0name" for an abstract socket; None = not supervised.
        self.address = address
        self.watchdog_usec = watchdog_usec

    @classmethod
    def from_env(
        cls, environ: MutableMapping[str, str] | None = None, *, pid: int | None = None
    ) -> Notifier:
        """Read and remove the service manager's variables from ``environ`` (``os.environ``);
        ``pid`` (ours by default) is matched against ``$WATCHDOG_PID``. Call it before spawning
        any child process."""
        env = os.environ if environ is None else environ
        raw = env.get("NOTIFY_SOCKET") or None
        address = "\0" + raw[1:] if raw is not None and raw.startswith("@") else raw
        watchdog_usec = _watchdog_usec(env, os.getpid() if pid is None else pid)
        for key in _ENV_KEYS:
            env.pop(key, None)
        return cls(address, watchdog_usec)

    @property
    def enabled(self) -> bool:
        return self.address is not None

    def notify(self, *fields: str) -> bool:
        """Send ``KEY=VALUE`` lines as one datagram; True if it was sent."""
        if self.address is None:
            return False
        try:
            with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as sock:
                sock.sendto("\n".join(fields).encode(), self.address)
        except OSError as e:
            log.warning("sd_notify to %r failed: %s", self.address, e)
            return False
        return True

    def ready(self, status: str = "") -> bool:
        return self.notify("READY=1", *([f"STATUS={status}"] if status else []))

    def stopping(self, status: str = "") -> bool:
        return self.notify("STOPPING=1", *([f"STATUS={status}"] if status else []))

    def watchdog(self) -> bool:
        return self.notify("WATCHDOG=1")

    def start_watchdog(self) -> asyncio.Task[None] | None:
        """Feed the watchdog from the running loop until the task is cancelled; None when
        systemd asked for no watchdog (or for one on another pid)."""
        if self.address is None or self.watchdog_usec is None:
            return None
        return asyncio.get_running_loop().create_task(
            self._feed(self.watchdog_usec / 2e6), name="sd-watchdog"
        )

    async def _feed(self, interval_s: float) -> None:
        # A heartbeat, not a poll (it waits on no state). On the loop, not in a thread: the point
        # is that a blocked loop stops feeding.
        while True:
            self.watchdog()
            await asyncio.sleep(interval_s)


def _watchdog_usec(env: MutableMapping[str, str], pid: int) -> int | None:
    try:
        usec = int(env.get("WATCHDOG_USEC", ""))
    except ValueError:
        return None
    owner = env.get("WATCHDOG_PID")
    if usec <= 0 or (owner and owner.strip() != str(pid)):
        return None
    return usec
