"""What this machine is: its CPU, from ``/proc/cpuinfo`` (no torch import: the bench client uses
it too), and the addresses of a host name it can listen on."""

from __future__ import annotations

import errno
import socket


def cpuinfo(field: str) -> str:
    """The first value of ``field`` in ``/proc/cpuinfo`` ('vendor_id': 'GenuineIntel',
    'AuthenticAMD'; 'model name': 'AMD EPYC'), '' where there is none (no such file or field:
    the callers then fall back to what they know without it)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith(field):
                    return line.split(":", 1)[1].strip()
    except OSError:
        return ""
    return ""


def listen_addresses(host: str, port: int) -> list[str]:
    """The addresses of ``host`` this machine can listen on, in resolver order: one of a family
    the kernel lacks (IPv6 off) or not assigned here (``::1`` of ``localhost`` with IPv6
    disabled on the loopback: EADDRNOTAVAIL) is left out, as asyncio's create_server does
    (bpo-30945) and uvloop's does not. Each is tried with ``port`` 0, so a busy port is not
    judged here. All left out, or ``host`` does not resolve: ``[host]``, for the bind to
    report."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except OSError:
        return [host]
    usable: list[str] = []
    for family, kind, proto, _, addr in infos:
        try:
            sock = socket.socket(family, kind, proto)
        except OSError:
            continue
        with sock:
            try:
                sock.bind((addr[0], 0, *addr[2:]))
            except OSError as e:
                if e.errno == errno.EADDRNOTAVAIL:
                    continue
        if addr[0] not in usable:
            usable.append(addr[0])
    return usable or [host]
