"""channel.py: ring semantics in one process, a real child via Popen(pass_fds), asyncio on uvloop.

Run as a script, this file is the echo child: ``test_channel.py IN_SPEC OUT_SPEC`` echoes every
message of IN back on OUT until ``STOP``.
"""

from __future__ import annotations

import asyncio
import os
import random
import subprocess
import sys
import threading
import time
import typing
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec
import pytest
import uvloop

from tetri_server import messages as m
from tetri_server.channel import (
    _DATA,
    _HEAD,
    _TAIL,
    SHM_DIR,
    AsyncReceiver,
    Channel,
    ChannelBroken,
    ChannelSpec,
    MessageTooLarge,
    cleanup_stale_segments,
    new_run_id,
)

Echo = m.AddRequest | m.Abort | m.StepOutput | m.KVPulled
STOP = m.Abort(-1)
SAMPLING = m.SamplingParams(max_tokens=8, temperature=0.0, seed=3, stop_token_ids=[2])
POOL = m.PoolHandle(0, "shm", "tetri-1-ab-kv0", 2, 64, 16, 4, 32, "float32", b"\x00\xff", -1)
HANDOFF = m.Handoff(7, 0, [3, 4], [1, 2, 3, 11], 3, SAMPLING, 2, 300, 12.5)
SAMPLES: dict[Any, list[Any]] = {
    m.ToWorker: [
        m.AddRequest(7, [1, 2, 3], SAMPLING, 12.5, true_output_len=9, prompt_text="héllo"),
        m.Abort(7),
        m.Shutdown(),
        m.PeerPools([POOL]),
        m.DecodeView(4, [m.DecodeInstanceView(1, 10, 64, 2, 3, 40)]),
        m.SetRole("decode"),
        HANDOFF,
        m.KVPulled(7),
        m.HandoffRejected(7, "no room"),
    ],
    m.FromWorker: [
        m.Ready(0, "prefill", POOL, 256, 1234),
        m.StepOutput(1, [m.TokenDelta(7, [5, 6], [-0.5, -1.0], "stop"), m.TokenDelta(8, [9])]),
        m.RequestFailed(7, "boom"),
        m.StepFailed(1, [3, 4], "RuntimeError: boom"),
        m.StartFailed(0, "ValueError: KV pool too small"),
        m.LoadReport(0, "decode", 1, 2, 30, 40, 64, 1, 1, 12, 0.25, num_preemptions=2),
        HANDOFF,
        m.KVPulled(7),
        m.HandoffRejected(7, "no room"),
    ],
}


@pytest.fixture
def run_id() -> Iterator[str]:
    run = new_run_id()
    yield run
    leaked = [name for name in os.listdir(SHM_DIR) if name.startswith(run)]
    for name in leaked:
        os.unlink(os.path.join(SHM_DIR, name))
    assert not leaked, f"segments left behind: {leaked}"


def make(run_id: str, purpose: str, capacity: int, msg_type: Any) -> Channel[Any]:
    return Channel.create(f"{run_id}-{purpose}", capacity, msg_type)


def dispose(*channels: Channel[Any]) -> None:
    for channel in channels:
        channel.close()
        channel.unlink()


@pytest.mark.parametrize(
    "union",
    [
        pytest.param(m.ToWorker, id="ToWorker"),
        pytest.param(m.FromWorker, id="FromWorker"),
    ],
)
def test_every_message_kind_round_trips(run_id: str, union: Any) -> None:
    samples = SAMPLES[union]
    assert {type(s) for s in samples} == (set(typing.get_args(union)) or {union})
    channel = make(run_id, "kinds", 4096, union)
    try:
        for sample in samples:
            channel.send(sample)
        assert channel.drain() == samples
        assert channel.try_recv() is None and channel.num_bytes_used() == 0
    finally:
        dispose(channel)


def test_random_sizes_wrap_around_in_order(run_id: str) -> None:
    rng = random.Random(0)
    channel = make(run_id, "wrap", 1024, m.RequestFailed)
    sent: list[m.RequestFailed] = []
    got: list[Any] = []
    try:
        for i in range(3000):
            msg = m.RequestFailed(i, "x" * rng.randrange(0, 300))
            while channel.num_bytes_used() + 400 > 1024 or rng.random() < 0.3:
                got.extend(channel.drain() if rng.random() < 0.5 else [channel.try_recv()])
            channel.send(msg, timeout_s=0)
            sent.append(msg)
        got.extend(channel.drain())
        assert [g for g in got if g is not None] == sent
    finally:
        dispose(channel)


def corrupt_second_frame(channel: Channel[Any]) -> None:
    """Abort(1), Abort(2) and Abort(3) sent, then the second frame's length word made
    impossible, as memory corruption or a second producer would."""
    channel.send(m.Abort(1))
    first = channel.num_bytes_used()
    channel.send(m.Abort(2))
    channel.send(m.Abort(3))
    channel._words[(_DATA + first) >> 3] = 10**9


def test_a_corrupt_frame_length_gives_the_channel_up_after_the_frames_before_it(
        run_id: str) -> None:
    """Regression: a corrupt length raised out of drain, losing the frame drain had already
    popped, and every later drain raised again: the ring was wedged, and the control process's
    reap of that worker raised before it finished."""
    channel = make(run_id, "corrupt", 256, m.ToWorker)
    try:
        corrupt_second_frame(channel)
        assert channel.drain() == [m.Abort(1)]
        with pytest.raises(ChannelBroken, match="corrupt frame length"):
            channel.drain()
        with pytest.raises(ChannelBroken):
            channel.drain()
    finally:
        dispose(channel)


def test_a_frame_length_past_the_written_bytes_gives_the_channel_up(run_id: str) -> None:
    """Regression: a corrupt length small enough for the ring but past what the producer had
    written was decoded from bytes not written for it (old frames still in the ring: a decode
    error here, a stale message where they happen to parse) and moved the tail past the head,
    so the producer's next frames were never read."""
    channel = make(run_id, "short", 256, m.ToWorker)
    try:
        for k in range(6):  # wrap the ring: every byte of it holds an old Abort frame
            channel.send(m.Abort(k))
            assert channel.drain() == [m.Abort(k)]
        channel.send(m.Abort(7))
        tail = channel._words[_TAIL]
        channel._words[(_DATA + tail % 256) >> 3] = 200  # < 256, but 24 bytes were written
        with pytest.raises(ChannelBroken, match="corrupt frame length 200"):
            channel.drain()
        assert channel._words[_TAIL] <= channel._words[_HEAD]
    finally:
        dispose(channel)


def test_a_receiver_of_a_broken_channel_delivers_then_stops_and_says_so(run_id: str) -> None:
    channel = make(run_id, "broken", 256, m.ToWorker)
    got: list[Any] = []
    broken: list[bool] = []
    errors: list[Any] = []

    async def main() -> None:
        loop = asyncio.get_running_loop()
        loop.set_exception_handler(lambda _, ctx: errors.append(ctx["exception"]))
        receiver = AsyncReceiver(channel, loop, got.append, on_broken=lambda: broken.append(True))
        corrupt_second_frame(channel)
        await asyncio.sleep(0.2)
        receiver.flush()  # closed: nothing more, no error
        receiver.close()

    try:
        with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
            runner.run(main())
        assert got == [m.Abort(1)] and broken == [True]
        assert [type(e) for e in errors] == [ChannelBroken]
    finally:
        dispose(channel)


def test_full_ring_blocks_sender_until_consumer_reads(run_id: str) -> None:
    channel = make(run_id, "full", 256, m.ToWorker)
    try:
        num_sent = 0
        with pytest.raises(TimeoutError):
            while True:
                channel.send(m.KVPulled(num_sent), timeout_s=0)
                num_sent += 1
        used = channel.num_bytes_used()
        assert num_sent > 1 and used + used // num_sent > 256
        start = time.monotonic()
        with pytest.raises(TimeoutError):
            channel.send(m.KVPulled(-1), timeout_s=0.05)
        assert time.monotonic() - start >= 0.05
        reader = threading.Timer(0.1, channel.try_recv)
        start = time.monotonic()
        reader.start()
        channel.send(m.KVPulled(num_sent), timeout_s=5)
        assert 0.08 <= time.monotonic() - start < 2
        reader.join()
        assert [msg.req_id for msg in channel.drain()] == list(range(1, num_sent + 1))
    finally:
        dispose(channel)


def test_message_bigger_than_ring_is_refused_at_send(run_id: str) -> None:
    channel = make(run_id, "big", 128, m.RequestFailed)
    try:
        with pytest.raises(MessageTooLarge, match="does not fit channel"):
            channel.send(m.RequestFailed(1, "x" * 200))
        assert channel.num_bytes_used() == 0
        channel.send(m.RequestFailed(2, "ok"))
        assert channel.drain() == [m.RequestFailed(2, "ok")]
    finally:
        dispose(channel)


def spawn_echo(to_child: Channel[Any], from_child: Channel[Any]) -> subprocess.Popen[str]:
    specs = [msgspec.json.encode(c.spec).decode() for c in (to_child, from_child)]
    return subprocess.Popen(
        [sys.executable, __file__, *specs],
        pass_fds=to_child.spec.fds + from_child.spec.fds,
        stderr=subprocess.PIPE,
        text=True,
    )


def test_child_process_ping_pong(run_id: str) -> None:
    to_child = make(run_id, "ping", 4096, Echo)
    from_child = make(run_id, "pong", 4096, Echo)
    try:
        child = spawn_echo(to_child, from_child)
        for i in range(1000):
            msg = m.StepOutput(i, [m.TokenDelta(i, [i % 50_000, 1])])
            to_child.send(msg)
            assert from_child.recv(timeout_s=10) == msg
        to_child.send(STOP)
        _, stderr = child.communicate(timeout=10)
        assert child.returncode == 0, stderr
        assert stderr == ""  # no resource_tracker warnings from the child
        assert os.path.exists(os.path.join(SHM_DIR, to_child.name))  # child did not unlink
        assert os.path.exists(os.path.join(SHM_DIR, from_child.name))
    finally:
        dispose(to_child, from_child)


def test_asyncio_sender_and_receiver_on_uvloop(run_id: str) -> None:
    to_child = make(run_id, "aping", 256, Echo)  # small: send_async must wait for space
    from_child = make(run_id, "apong", 256, Echo)
    sent = [m.Abort(i) for i in range(500)]
    got: list[Any] = []

    async def main() -> None:
        loop = asyncio.get_running_loop()
        assert isinstance(loop, uvloop.Loop)
        done = loop.create_future()

        def on_msg(msg: Any) -> None:
            got.append(msg)
            if len(got) == len(sent):
                done.set_result(None)

        receiver = AsyncReceiver(from_child, loop, on_msg)
        await asyncio.gather(*(to_child.send_async(msg, timeout_s=10) for msg in sent))
        await asyncio.wait_for(done, 10)
        receiver.close()

    try:
        child = spawn_echo(to_child, from_child)
        with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
            runner.run(main())
        to_child.send(STOP)
        assert child.wait(timeout=10) == 0
        assert got == sent
    finally:
        dispose(to_child, from_child)


async def fill(channel: Channel[Any], capacity: int) -> None:
    """Send frames until the next would not fit in ``capacity`` bytes of ring."""
    await channel.send_async(m.KVPulled(0))
    frame = channel.num_bytes_used()
    while channel.num_bytes_used() + frame <= capacity:
        await channel.send_async(m.KVPulled(0))


def test_send_async_waits_for_space_then_times_out(run_id: str) -> None:
    channel = make(run_id, "afull", 64, m.ToWorker)

    async def main() -> float:
        loop = asyncio.get_running_loop()
        await fill(channel, 64)
        start = loop.time()  # the timer's clock, before it is armed (time.monotonic's base)
        loop.call_later(0.05, channel.try_recv)
        await channel.send_async(m.KVPulled(1), timeout_s=5)
        waited = time.monotonic() - start
        with pytest.raises(TimeoutError):
            await channel.send_async(m.KVPulled(2), timeout_s=0.05)
        return waited

    try:
        with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
            assert runner.run(main()) >= 0.04
        assert channel.drain()[-1] == m.KVPulled(1)
    finally:
        dispose(channel)


@pytest.mark.parametrize("loop_factory", [asyncio.new_event_loop, uvloop.new_event_loop])
def test_closing_under_a_waiting_sender_leaves_the_fd_number_to_its_next_owner(
        run_id: str, loop_factory: Any) -> None:
    """Regression: a worker died while control's writer waited for space in its inbox; reap
    cancelled the writer and closed the channel, and the writer's cleanup, a loop turn later,
    removed the reader of whatever fd took the freed number (an HTTP socket goes deaf)."""
    channel = make(run_id, "areap", 64, m.ToWorker)

    async def main() -> bool:
        loop = asyncio.get_running_loop()
        await fill(channel, 64)
        writer = loop.create_task(channel.send_async(m.KVPulled(1), timeout_s=None))
        await asyncio.sleep(0.05)
        space_fd = channel._space_fd
        writer.cancel()
        channel.close()
        fds = [os.eventfd(0, os.EFD_NONBLOCK) for _ in range(2)]
        new_fd = next(fd for fd in fds if fd == space_fd)  # the number is free again
        fired = asyncio.Event()
        loop.add_reader(new_fd, fired.set)
        with pytest.raises(asyncio.CancelledError):
            await writer
        os.eventfd_write(new_fd, 1)
        try:
            await asyncio.wait_for(fired.wait(), 2)
            return True
        except TimeoutError:
            return False
        finally:
            loop.remove_reader(new_fd)
            for fd in fds:
                os.close(fd)

    try:
        with asyncio.Runner(loop_factory=loop_factory) as runner:
            assert runner.run(main())
    finally:
        channel.unlink()


def test_cleanup_unlinks_segments_of_dead_pids_only(run_id: str) -> None:
    dead_pid = int(Path("/proc/sys/kernel/pid_max").read_text()) + 1
    dead = Path(SHM_DIR, f"tetri-{dead_pid}-{run_id[-8:]}-test")
    live = Path(SHM_DIR, f"{run_id}-live")
    dead.write_bytes(b"x")
    live.write_bytes(b"x")
    try:
        assert dead.name in cleanup_stale_segments()
        assert not dead.exists() and live.exists()
    finally:
        dead.unlink(missing_ok=True)
        live.unlink()


def test_close_and_unlink_leave_nothing(run_id: str) -> None:
    channel = make(run_id, "gone", 128, m.ToWorker)
    channel.send(m.KVPulled(3))
    assert channel.drain() == [m.KVPulled(3)]
    for _ in range(2):  # both are idempotent
        channel.close()
        channel.unlink()
    assert not Path(SHM_DIR, channel.name).exists()
    for fd in channel.spec.fds:
        with pytest.raises(OSError):
            os.fstat(fd)


def test_attach_without_inherited_fds_is_a_clear_error(run_id: str) -> None:
    spec = ChannelSpec(f"{run_id}-nofds", 128, 1_000_000, 1_000_001)
    with pytest.raises(ValueError, match="not inherited"):
        Channel.attach(spec, m.ToWorker)


def _echo_main(in_json: str, out_json: str) -> None:
    inbox = Channel.attach(msgspec.json.decode(in_json, type=ChannelSpec), Echo)
    outbox = Channel.attach(msgspec.json.decode(out_json, type=ChannelSpec), Echo)
    while (msg := inbox.recv(timeout_s=30)) not in (STOP, None):
        outbox.send(msg)
    inbox.close()
    outbox.close()


if __name__ == "__main__":
    _echo_main(sys.argv[1], sys.argv[2])
