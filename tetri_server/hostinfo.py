"""What this machine's CPU is, from ``/proc/cpuinfo`` (no torch import: the bench client uses it
too)."""

from __future__ import annotations


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
