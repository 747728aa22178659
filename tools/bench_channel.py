"""Latency and throughput of ``tetri_server.channel`` between a parent and a child process.

    .venv/bin/python tools/bench_channel.py [--iters 5000] [--msgs 100000] [--pin]

Round trip: the parent sends a ~200-byte ``StepOutput``, the child (blocked in ``recv`` on its
eventfd, no spinning) echoes it, the parent blocks in ``recv`` for the echo. One-way: the parent
sends ``--msgs`` messages back to back (back-pressure when the ring is full), the child drains
them the way a worker loop does (``select`` on ``fileno()``, then ``drain()``) and acknowledges.
"""

from __future__ import annotations

import argparse
import os
import select
import statistics
import subprocess
import sys
import time

import msgspec

from tetri_server.channel import Channel, ChannelSpec, new_run_id
from tetri_server.messages import StepOutput, TokenDelta


class Count(msgspec.Struct, tag=True, array_like=True):
    """Bench-only control frame: the child counts ``num_msgs`` frames, then echoes this back."""

    num_msgs: int


Bench = StepOutput | Count


def step_output(seq: int) -> StepOutput:
    """One decode step of 18 requests, one new token each (~200 bytes of msgpack)."""
    return StepOutput(seq % 8, [TokenDelta(1000 + i, [31_000 + seq % 1000]) for i in range(18)])


def child_main(in_json: str, out_json: str, cpu: int) -> None:
    if cpu >= 0:
        os.sched_setaffinity(0, {cpu})
    inbox = Channel.attach(msgspec.json.decode(in_json, type=ChannelSpec), Bench)
    outbox = Channel.attach(msgspec.json.decode(out_json, type=ChannelSpec), Bench)
    while (msg := inbox.recv(timeout_s=30)) is not None:
        if isinstance(msg, StepOutput):
            outbox.send(msg)
            continue
        if msg.num_msgs < 0:
            break
        num_seen = 0
        while num_seen < msg.num_msgs:
            select.select([inbox], [], [], 30)
            num_seen += len(inbox.drain())
        outbox.send(msg)
    inbox.close()
    outbox.close()


def percentile(sorted_values: list[float], q: float) -> float:
    return sorted_values[min(len(sorted_values) - 1, int(q * len(sorted_values)))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iters", type=int, default=5000, help="round trips measured")
    parser.add_argument("--msgs", type=int, default=100_000, help="one-way messages")
    parser.add_argument("--capacity", type=int, default=1 << 20, help="ring bytes")
    parser.add_argument("--pin", action="store_true", help="parent on cpu 0, child on cpu 1")
    args = parser.parse_args()
    if args.pin:
        os.sched_setaffinity(0, {0})
    run_id = new_run_id()
    down = Channel.create(f"{run_id}-bench-down", args.capacity, Bench)
    up = Channel.create(f"{run_id}-bench-up", args.capacity, Bench)
    specs = [msgspec.json.encode(c.spec).decode() for c in (down, up)]
    cmd = [sys.executable, __file__, "--child", *specs, "1" if args.pin else "-1"]
    child = subprocess.Popen(cmd, pass_fds=down.spec.fds + up.spec.fds)
    try:
        msg = step_output(0)
        size = len(msgspec.msgpack.encode(msg))
        for _ in range(500):  # warm-up: child start-up, caches, CPU frequency
            down.send(msg)
            up.recv(timeout_s=30)
        rtt_us = []
        for i in range(args.iters):
            msg = step_output(i)
            start = time.perf_counter_ns()
            down.send(msg)
            echo = up.recv(timeout_s=30)
            rtt_us.append((time.perf_counter_ns() - start) / 1e3)
            assert echo == msg
        rtt_us.sort()
        start_s = time.perf_counter()
        down.send(Count(args.msgs))
        for _ in range(args.msgs):
            down.send(msg)
        assert up.recv(timeout_s=60) == Count(args.msgs)
        elapsed_s = time.perf_counter() - start_s
        down.send(Count(-1))
        child.wait(timeout=30)
    finally:
        child.kill()
        for channel in (down, up):
            channel.close()
            channel.unlink()
    print(f"message: StepOutput, {size} bytes msgpack; ring {args.capacity} bytes; pin={args.pin}")
    print(
        f"round trip over {args.iters}: p50 {percentile(rtt_us, 0.5):.1f} us, "
        f"p99 {percentile(rtt_us, 0.99):.1f} us, mean {statistics.fmean(rtt_us):.1f} us"
    )
    print(
        f"one-way: {args.msgs / elapsed_s:,.0f} msgs/s "
        f"({args.msgs * size / elapsed_s / 1e6:.0f} MB/s of payload)"
    )


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        child_main(sys.argv[2], sys.argv[3], int(sys.argv[4]))
    else:
        main()
