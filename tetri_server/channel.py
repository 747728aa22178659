"""Shared-memory SPSC ring of msgspec frames, eventfd wake-ups, and an asyncio adapter.

A ``Channel`` carries one direction between two processes. Exactly one producer (one thread, or
one event loop) calls ``send`` or ``send_async``; exactly one consumer calls ``try_recv``/``recv``
/``drain`` or owns an ``AsyncReceiver``. The parent makes it with ``Channel.create``, starts the
child with ``subprocess.Popen(..., pass_fds=channel.spec.fds)`` and ``channel.spec`` (JSON) on
argv; the child calls ``Channel.attach(spec, msg_type)``. Each process closes its own handle; only
the creator unlinks the segment.

Segment layout (u64 words, each counter on its own 64-byte line):
    [0] magic  [8] capacity  [64] head  [128] tail  [192] beat  [256...] ``capacity`` bytes
    of frames
``beat`` is the producer's heartbeat (``CLOCK_MONOTONIC`` nanoseconds, any thread of the
producer's process may store it: ``beat``/``last_beat_s``), outside the frame protocol.
``head``/``tail`` count bytes ever written/consumed; only the producer stores ``head``, only the
consumer stores ``tail``; ``0 <= head - tail <= capacity``. A frame is a u64 payload length at an
8-aligned offset, then the msgpack payload padded to 8 bytes: the length word never wraps (the
capacity is a multiple of 8), the payload may wrap around the end of the data area.

Wake-ups: the producer writes ``data_fd`` after every push; the consumer writes ``space_fd`` after
every pop batch. A waiting side clears its eventfd *before* re-checking the ring, so no wake-up
is lost; a stale one costs one empty check. Hazard: payload and length are stored before
``head`` (and read before ``tail`` is stored) with plain stores, which relies on x86-64 store
ordering; an ARM port needs fences here.
"""

from __future__ import annotations

import asyncio
import logging
import os
import re
import select
import sys
import time
from collections.abc import Callable
from multiprocessing import resource_tracker
from multiprocessing.shared_memory import SharedMemory
from typing import Any, Generic, TypeVar

import msgspec

from tetri_server.messages import ChannelSpec

T = TypeVar("T")
log = logging.getLogger("tetri.channel")

SHM_DIR = "/dev/shm"
DEFAULT_SEND_TIMEOUT_S = 10.0
_MAGIC = int.from_bytes(b"TETRICH1", "little")
_CAPACITY, _HEAD, _TAIL, _BEAT = 1, 8, 16, 24  # word indices
_DATA = 256  # byte offset of the data area
_SEGMENT_RE = re.compile(r"^tetri-(\d+)-")


class MessageTooLarge(ValueError):
    """One encoded message needs more bytes than the whole ring holds."""


class ChannelBroken(RuntimeError):
    """A frame's length word is impossible (memory corruption, a second producer): nothing
    after it can be read, so the channel is given up for good (its peer must be replaced)."""


def reserve_shm(fd: int, num_bytes: int, what: str) -> None:
    """Give a /dev/shm file its pages now: a full tmpfs fails here with a clear error instead of
    a SIGBUS at the first write that finds no page."""
    try:
        os.posix_fallocate(fd, 0, num_bytes)
    except OSError as e:
        st = os.statvfs(SHM_DIR)
        free_mib = st.f_bavail * st.f_frsize / 2**20
        raise OSError(e.errno, f"{SHM_DIR} has no room for the {what} ({num_bytes / 2**20:.0f} "
                      f"MiB; {free_mib:.0f} MiB free): enlarge {SHM_DIR} (docker: --shm-size) "
                      "or lower kv.num_blocks / kv.memory_gb") from e


def unlink_segment(name: str) -> bool:
    """Remove a segment of ``SHM_DIR`` (a KV pool); False if it was already gone. Mappings stay
    valid."""
    try:
        os.unlink(os.path.join(SHM_DIR, name))
    except FileNotFoundError:
        return False
    return True


def new_run_id() -> str:
    """``tetri-<pid>-<8 hex>``: the prefix of every segment of this run, so that
    ``cleanup_stale_segments`` can tell whether the run that made a segment is still alive."""
    return f"tetri-{os.getpid()}-{os.urandom(4).hex()}"


def cleanup_stale_segments(shm_dir: str = SHM_DIR) -> list[str]:
    """Unlink every ``tetri-<pid>-*`` entry of ``shm_dir`` whose pid is not alive; return their
    names. Called once by the control process at start-up, so a crashed run leaves nothing
    behind. Hazard: pids are only meaningful within one pid namespace sharing ``/dev/shm``."""
    removed: list[str] = []
    try:
        entries = sorted(os.listdir(shm_dir))
    except OSError as e:
        log.warning("cannot list %s: %s", shm_dir, e)
        return removed
    for entry in entries:
        match = _SEGMENT_RE.match(entry)
        if match is None or _pid_alive(int(match.group(1))):
            continue
        try:
            os.unlink(os.path.join(shm_dir, entry))
        except FileNotFoundError:
            continue  # another process cleaned it up first
        except OSError as e:  # not ours to delete (another user's, a directory): leave it
            log.warning("cannot remove stale shared-memory entry %s: %s", entry, e)
            continue
        removed.append(entry)
    return removed


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except (ProcessLookupError, OverflowError):
        return False
    except PermissionError:
        return True  # exists, owned by another user
    return True


def _clear(fd: int) -> None:
    """Reset an eventfd to zero (semaphore mode is off: one read takes the whole count)."""
    try:
        os.eventfd_read(fd)
    except BlockingIOError:
        return  # already zero


def _wait(poller: select.poll, deadline: float | None) -> bool:
    """Block until the polled fd is readable or ``deadline`` (monotonic) passes."""
    if deadline is None:
        return bool(poller.poll())
    remaining_ms = (deadline - time.monotonic()) * 1e3
    return remaining_ms > 0 and bool(poller.poll(remaining_ms))


def _deadline(timeout_s: float | None) -> float | None:
    return None if timeout_s is None else time.monotonic() + timeout_s


def _poller(fd: int) -> select.poll:
    poller = select.poll()
    poller.register(fd, select.POLLIN)
    return poller


class Channel(Generic[T]):
    """One SPSC ring of ``msg_type`` messages (usually a tagged union from ``messages.py``)."""

    def __init__(self, shm: SharedMemory, spec: ChannelSpec, msg_type: Any, owner: bool) -> None:
        # First, so that an unsupported msg_type fails before anything is mapped.
        self._decoder: msgspec.msgpack.Decoder[Any] = msgspec.msgpack.Decoder(msg_type)
        self._encoder = msgspec.msgpack.Encoder()
        self.spec = spec
        self._shm, self._owner = shm, owner
        self._cap = spec.capacity
        assert shm.buf is not None  # None only after shm.close()
        self._view = shm.buf[: _DATA + spec.capacity]
        self._words = self._view.cast("Q")
        self._data_fd, self._space_fd = spec.data_fd, spec.space_fd
        self._data_poll, self._space_poll = _poller(spec.data_fd), _poller(spec.space_fd)
        self._async_lock: asyncio.Lock | None = None
        self._num_async_waiting = 0  # send_async calls queued behind a full ring
        self._space_loop: asyncio.AbstractEventLoop | None = None  # watching _space_fd
        self._closed = self._unlinked = False
        self._broken: ChannelBroken | None = None

    @property
    def capacity(self) -> int:
        """Bytes of the ring; a frame (8 + the payload, rounded up to 8) must fit in it."""
        return self._cap

    @classmethod
    def create(cls, name: str, capacity: int, msg_type: Any) -> Channel[Any]:
        """Make the segment and both eventfds (non-blocking, close-on-exec: only children given
        them in ``pass_fds`` inherit them). The caller owns the name and must ``unlink`` it."""
        if capacity < 64 or capacity % 8:
            raise ValueError(f"channel capacity must be a multiple of 8 >= 64, got {capacity}")
        fds = [os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC) for _ in range(2)]
        shm: SharedMemory | None = None
        try:
            shm = SharedMemory(name=name, create=True, size=_DATA + capacity)
            reserve_shm(shm._fd, _DATA + capacity, f"message ring {name}")  # type: ignore[attr-defined]
            channel: Channel[Any] = cls(shm, ChannelSpec(name, capacity, *fds), msg_type, True)
        except BaseException:
            if shm is not None:
                shm.close()
                shm.unlink()
            for fd in fds:
                os.close(fd)
            raise
        channel._words[_CAPACITY] = capacity
        channel._words[0] = _MAGIC
        return channel

    @classmethod
    def attach(cls, spec: ChannelSpec, msg_type: Any) -> Channel[Any]:
        """Map a channel made by the parent; the fds of ``spec`` must have been inherited."""
        for fd in spec.fds:
            try:
                os.fstat(fd)
            except OSError as exc:
                raise ValueError(f"channel {spec.name}: fd {fd} not inherited (pass_fds?)") from exc
        if sys.version_info >= (3, 13):
            shm = SharedMemory(name=spec.name, track=False)
        else:
            shm = SharedMemory(name=spec.name)
            # 3.11/3.12 track attached segments too and would unlink the parent's at our exit.
            resource_tracker.unregister(f"/{shm.name}", "shared_memory")
        try:
            channel: Channel[Any] = cls(shm, spec, msg_type, owner=False)
        except BaseException:
            shm.close()
            raise
        if channel._words[0] != _MAGIC or channel._words[_CAPACITY] != spec.capacity:
            channel.close()
            raise ValueError(f"channel {spec.name}: segment does not match its spec")
        return channel

    @property
    def name(self) -> str:
        return self.spec.name

    def fileno(self) -> int:
        """The data eventfd: readable while a wake-up is pending (``drain``/``recv`` clear it)."""
        return self._data_fd

    def num_bytes_used(self) -> int:
        return int(self._words[_HEAD] - self._words[_TAIL])

    def beat(self) -> None:
        """Stamp the heartbeat word with now (producer side; one aligned store, so another
        thread of the producer's process may call it while the owner sends)."""
        if not self._closed:
            self._words[_BEAT] = time.monotonic_ns()

    def last_beat_s(self) -> float:
        """The producer's last ``beat`` on the ``time.monotonic`` clock (0.0: none yet)."""
        return 0.0 if self._closed else self._words[_BEAT] / 1e9

    # ------------------------------------------------------------------ producer side

    def send(self, msg: T, timeout_s: float | None = DEFAULT_SEND_TIMEOUT_S) -> None:
        """Push ``msg``; while the ring is full, block on ``space_fd`` for at most ``timeout_s``
        (``None``: forever), then raise ``TimeoutError``. Never drops, never grows."""
        data, frame = self._encode(msg)
        deadline = _deadline(timeout_s)
        while not self._try_push(data, frame):
            _clear(self._space_fd)
            if self._try_push(data, frame):
                break
            if not _wait(self._space_poll, deadline):
                raise TimeoutError(f"channel {self.name}: ring still full after {timeout_s} s")
        os.eventfd_write(self._data_fd, 1)

    async def send_async(self, msg: T, timeout_s: float | None = DEFAULT_SEND_TIMEOUT_S) -> None:
        """``send`` for an event loop: awaits ``space_fd`` with ``loop.add_reader``. Sends from
        concurrent tasks keep their call order. Do not mix with ``send`` on one channel."""
        data, frame = self._encode(msg)
        if self._num_async_waiting == 0 and self._try_push(data, frame):
            os.eventfd_write(self._data_fd, 1)
            return
        if self._async_lock is None:
            self._async_lock = asyncio.Lock()
        self._num_async_waiting += 1
        try:
            async with asyncio.timeout(timeout_s), self._async_lock:
                await self._push_when_space(data, frame)
        finally:
            self._num_async_waiting -= 1
        os.eventfd_write(self._data_fd, 1)

    async def _push_when_space(self, data: bytes, frame: int) -> None:
        loop = asyncio.get_running_loop()
        while True:
            _clear(self._space_fd)
            if self._try_push(data, frame):
                return
            woken: asyncio.Future[None] = loop.create_future()
            loop.add_reader(self._space_fd, _set_done, woken)
            self._space_loop = loop
            try:
                await woken
            finally:
                # not after close(): the fd's number may be another's by then (its reader
                # would go silently)
                if self._space_loop is loop:
                    self._space_loop = None
                    loop.remove_reader(self._space_fd)

    def _encode(self, msg: T) -> tuple[bytes, int]:
        data = self._encoder.encode(msg)
        frame = 8 + ((len(data) + 7) & ~7)
        if frame > self._cap:
            raise MessageTooLarge(
                f"{type(msg).__name__} of {len(data)} bytes does not fit channel {self.name} "
                f"of {self._cap} bytes (raise its capacity)"
            )
        return data, frame

    def _try_push(self, data: bytes, frame: int) -> bool:
        words, cap = self._words, self._cap
        head = words[_HEAD]
        if head - words[_TAIL] + frame > cap:
            return False
        pos = head % cap
        words[(_DATA + pos) >> 3] = len(data)
        start = _DATA + (pos + 8) % cap
        end, limit = start + len(data), _DATA + cap
        if end <= limit:
            self._view[start:end] = data
        else:
            split = limit - start
            self._view[start:limit] = data[:split]
            self._view[_DATA : _DATA + len(data) - split] = data[split:]
        words[_HEAD] = head + frame  # publishes the frame
        return True

    # ------------------------------------------------------------------ consumer side

    def try_recv(self) -> T | None:
        """Pop one message, or ``None`` if the ring is empty. Does not clear ``fileno()``."""
        tail = self._words[_TAIL]
        if tail == self._words[_HEAD]:
            return None
        try:
            return self._pop(tail, self._words[_HEAD])
        finally:
            os.eventfd_write(self._space_fd, 1)

    def recv(self, timeout_s: float | None) -> T | None:
        """Pop one message, blocking on ``data_fd`` for at most ``timeout_s`` (``None``: forever);
        ``None`` on timeout."""
        deadline = _deadline(timeout_s)
        msg = self.try_recv()
        while msg is None:
            _clear(self._data_fd)
            msg = self.try_recv()
            if msg is None and not _wait(self._data_poll, deadline):
                return None
        return msg

    def drain(self, on_error: Callable[[Exception], None] | None = None) -> list[T]:
        """Clear the wake-up and pop every message pushed so far. A frame that does not decode
        (the peer broke the wire contract) is consumed and its error raised, or passed to
        ``on_error`` and skipped when given. A broken channel (``ChannelBroken``) returns the
        frames before the break; its error goes to ``on_error`` once, or is raised by the
        next call without one (and by every later one)."""
        _clear(self._data_fd)
        out: list[T] = []
        if self._broken is not None:
            if on_error is None:
                raise self._broken
            return out
        head = self._words[_HEAD]
        if self._words[_TAIL] == head:
            return out
        try:
            while (tail := self._words[_TAIL]) < head:
                try:
                    out.append(self._pop(tail, head))
                except (msgspec.DecodeError, msgspec.ValidationError) as exc:
                    if on_error is None:
                        raise
                    on_error(exc)
                except ChannelBroken as exc:
                    if on_error is not None:
                        on_error(exc)
                    elif not out:
                        raise
                    break
        finally:
            os.eventfd_write(self._space_fd, 1)
        return out

    def _pop(self, tail: int, head: int) -> T:
        """Decode the frame at ``tail`` (< ``head``, read before) and store the tail past it,
        even if decoding fails: the bytes stay untouched by the producer until the tail moves.
        A length that runs past ``head`` is corrupt too: decoding would read bytes not yet
        written (or a stale message still there), and the tail would pass the head."""
        cap = self._cap
        pos = tail % cap
        size = self._words[(_DATA + pos) >> 3]
        if size > cap - 8 or tail + 8 + size > head:
            self._broken = ChannelBroken(f"channel {self.name}: corrupt frame length {size} at "
                                         f"{pos} ({head - tail} bytes written); the channel "
                                         "is given up")
            raise self._broken
        start = _DATA + (pos + 8) % cap
        end, limit = start + size, _DATA + cap
        try:
            if end <= limit:
                with self._view[start:end] as payload:
                    return self._decoder.decode(payload)  # type: ignore[no-any-return]
            wrapped = bytes(self._view[start:limit]) + bytes(self._view[_DATA : end - cap])
            return self._decoder.decode(wrapped)  # type: ignore[no-any-return]
        finally:
            self._words[_TAIL] = tail + 8 + ((size + 7) & ~7)

    # ------------------------------------------------------------------ lifetime

    def close(self) -> None:
        """Unmap and close this process's fds; safe to call twice. Remove any ``AsyncReceiver``
        or ``add_reader`` on the fds first."""
        if self._closed:
            return
        self._closed = True
        if self._space_loop is not None:  # a send_async waits for space: stop watching first
            self._space_loop.remove_reader(self._space_fd)
            self._space_loop = None
        self._words.release()
        self._view.release()
        self._shm.close()
        os.close(self._data_fd)
        os.close(self._space_fd)

    def unlink(self) -> None:
        """Remove the segment's name (the creator's job); mappings stay valid until closed."""
        if self._unlinked:
            return
        self._unlinked = True
        try:
            self._shm.unlink()  # in the creator this also unregisters from the resource tracker
        except FileNotFoundError:
            if self._owner:
                resource_tracker.unregister(f"/{self.name}", "shared_memory")

    def __enter__(self) -> Channel[T]:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _set_done(fut: asyncio.Future[None]) -> None:
    if not fut.done():
        fut.set_result(None)


class AsyncReceiver(Generic[T]):
    """Calls ``callback(msg)`` on ``loop`` for every message of ``channel``, woken by
    ``loop.add_reader`` on its data fd (no polling). It is the channel's only consumer while
    open; ``close()`` removes the reader and leaves the channel to its owner. Errors from a bad
    frame or from ``callback`` go to ``loop.call_exception_handler`` and the next message is
    still delivered. A broken channel (``ChannelBroken``) closes the receiver, after the frames
    before the break, and calls ``on_broken`` (the peer must go: nothing it sends can be read)."""

    def __init__(
        self, channel: Channel[T], loop: asyncio.AbstractEventLoop, callback: Callable[[T], None],
        on_broken: Callable[[], None] | None = None,
    ) -> None:
        self._channel, self._loop, self._callback = channel, loop, callback
        self._on_broken = on_broken
        self._open = True
        loop.add_reader(channel.fileno(), self._on_readable)
        loop.call_soon(self._on_readable)  # frames pushed before the reader existed

    def _on_readable(self) -> None:
        if not self._open:
            return
        # Only frames present now: a fast producer re-arms the fd instead of starving the loop.
        for msg in self._channel.drain(on_error=self._report):
            try:
                self._callback(msg)
            except Exception as exc:  # reported, not swallowed; later messages still delivered
                self._report(exc)

    def flush(self) -> None:
        """Deliver every frame present now (the producer died: its last frames still count)."""
        self._on_readable()

    def _report(self, exc: Exception) -> None:
        self._loop.call_exception_handler(
            {"message": f"channel {self._channel.name}: receive failed", "exception": exc}
        )
        if isinstance(exc, ChannelBroken):
            self.close()
            if self._on_broken is not None:
                self._on_broken()

    def close(self) -> None:
        if self._open:
            self._open = False
            self._loop.remove_reader(self._channel.fileno())
