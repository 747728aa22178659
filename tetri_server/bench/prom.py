"""Resource usage from the server's Prometheus ``/metrics``: worker busy seconds.

tetri_server exports ``tetri_worker_busy_seconds_total{worker,role}``: seconds each worker spent
executing model steps. Keys here are ``"<worker>:<role>"``; a worker that flips role shows up
under both roles. A server without the metric (vLLM) yields ``None``, not zeros.
"""

from __future__ import annotations

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

BUSY_METRIC = "tetri_worker_busy_seconds_total"
SCRAPE_TIMEOUT_S = 10.0


def parse_busy_seconds(text: str) -> dict[str, float] | None:
    """``{"worker:role": seconds}`` from a Prometheus page; ``None`` if the metric is absent."""
    found: dict[str, float] = {}
    seen = False
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name != BUSY_METRIC:
                continue
            seen = True
            key = f"{sample.labels.get('worker', '?')}:{sample.labels.get('role', '?')}"
            found[key] = found.get(key, 0.0) + float(sample.value)
    return found if seen else None


async def scrape_busy_seconds(
    session: aiohttp.ClientSession, base_url: str
) -> dict[str, float] | None:
    """Scrape ``/metrics`` once; ``None`` when the server has no such page or metric."""
    timeout = aiohttp.ClientTimeout(total=SCRAPE_TIMEOUT_S)
    try:
        async with session.get(f"{base_url}/metrics", timeout=timeout) as resp:
            if resp.status != 200:
                return None
            text = await resp.text()
    except (aiohttp.ClientError, TimeoutError):
        return None
    return parse_busy_seconds(text)


def busy_delta(
    before: dict[str, float] | None, after: dict[str, float] | None
) -> dict[str, float] | None:
    """Busy seconds spent between two scrapes, per ``worker:role`` (counters only grow; a key
    missing before started at 0, e.g. a worker that flipped into that role during the run; a
    counter that went down was reset, as Prometheus' rate() assumes, and counts from 0)."""
    if before is None or after is None:
        return None
    out: dict[str, float] = {}
    for key, value in sorted(after.items()):
        spent = value - before.get(key, 0.0)
        out[key] = value if spent < 0 else spent
    return out


def num_workers(busy: dict[str, float] | None) -> int | None:
    """Distinct workers named in a busy-seconds map."""
    if busy is None:
        return None
    return len({k.rsplit(":", 1)[0] for k in busy})
