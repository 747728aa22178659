"""Worker processes: spawn with their channels, notice death through a pidfd, clean up.

A worker is ``python -m tetri_server.workers.main <WorkerSpec JSON>`` started with
``Popen(pass_fds=...)``: its two rings' eventfds are the only fds it inherits. Every segment it
uses is named from the run id, so ``cleanup_stale_segments`` can remove them after a crash of
the control process; the control process unlinks them when the worker exits.
"""

from __future__ import annotations

import asyncio
import logging
import os
import secrets
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import msgspec

from tetri_server.channel import AsyncReceiver, Channel, MessageTooLarge
from tetri_server.kv.shm import unlink_segment
from tetri_server.messages import FromWorker, PoolHandle, ToWorker, WorkerSpec

log = logging.getLogger("tetri.supervisor")
RING_BYTES = 4 << 20
SEND_TIMEOUT_S = 30.0


@dataclass(eq=False)
class WorkerHandle:
    """The control process's side of one worker process (one generation of one worker id)."""

    worker_id: int
    role: str
    generation: int
    proc: subprocess.Popen[bytes]
    inbox: Channel[ToWorker]
    outbox: Channel[FromWorker]
    kv_segment: str
    pidfd: int
    receiver: AsyncReceiver[FromWorker] | None = None
    pool: PoolHandle | None = None
    chunk_size: int = 0
    ready: asyncio.Future[None] = field(default_factory=lambda: asyncio.get_running_loop()
                                        .create_future())
    alive: bool = True
    last_heard_s: float = field(default_factory=time.monotonic)  # any message (load reports)
    stalled: bool = False  # silent past monitor.stall_timeout_s: killed, not to be used
    # called with a message that can never fit the worker's ring (the rest keep flowing)
    on_undeliverable: Callable[[ToWorker, str], None] | None = None
    _outgoing: asyncio.Queue[ToWorker] = field(default_factory=asyncio.Queue)
    _writer: asyncio.Task[None] | None = None

    @property
    def is_ready(self) -> bool:
        return (self.alive and not self.stalled and self.ready.done()
                and not self.ready.exception())

    def post(self, msg: ToWorker) -> None:
        """Queue a message for the worker; a writer task sends them in order (back-pressure
        from a full ring waits there, never here)."""
        if self.alive:
            self._outgoing.put_nowait(msg)

    async def _write_loop(self) -> None:
        while True:
            msg = await self._outgoing.get()
            try:
                await self.inbox.send_async(msg, timeout_s=SEND_TIMEOUT_S)
            except MessageTooLarge as e:
                log.error("worker %d: %s does not fit its ring: %s", self.worker_id,
                          type(msg).__name__, e)
                if self.on_undeliverable is not None:
                    self.on_undeliverable(msg, str(e))
            except TimeoutError:
                log.error("worker %d inbox stayed full for %.0f s; killing it", self.worker_id,
                          SEND_TIMEOUT_S)
                self.proc.kill()
                return


def spawn_worker(worker_id: int, role: str, generation: int, run_id: str,
                 config: dict[str, dict[str, object]], cpus: list[int], num_threads: int,
                 device: str, on_message: Callable[[WorkerHandle, FromWorker], None],
                 on_exit: Callable[[WorkerHandle], None]) -> WorkerHandle:
    loop = asyncio.get_running_loop()
    # A fresh random part per generation: names no other local user can guess or pre-create.
    prefix = f"{run_id}-w{worker_id}g{generation}-{secrets.token_hex(4)}"
    inbox: Channel[ToWorker] = Channel.create(f"{prefix}-in", RING_BYTES, ToWorker)
    outbox: Channel[FromWorker] = Channel.create(f"{prefix}-out", RING_BYTES, FromWorker)
    spec = WorkerSpec(worker_id, role, generation, run_id, config, inbox.spec, outbox.spec, cpus,
                      num_threads, os.getpid(), f"{prefix}-kv", device)
    # glibc would hand a step's large temporaries back to the OS and fault them in again on
    # the next step (30-40% extra time in a prefill-only process): keep freed memory.
    env = dict(os.environ, TOKENIZERS_PARALLELISM="false", OMP_NUM_THREADS=str(num_threads))
    env.setdefault("GLIBC_TUNABLES", "glibc.malloc.mmap_threshold=268435456:"
                   "glibc.malloc.trim_threshold=1073741824")
    proc = subprocess.Popen(
        [sys.executable, "-m", "tetri_server.workers.main", msgspec.json.encode(spec).decode()],
        pass_fds=inbox.spec.fds + outbox.spec.fds, stdin=subprocess.DEVNULL, env=env)
    handle = WorkerHandle(worker_id, role, generation, proc, inbox, outbox, f"{prefix}-kv",
                          os.pidfd_open(proc.pid))
    handle.receiver = AsyncReceiver(outbox, loop, lambda msg: on_message(handle, msg))
    loop.add_reader(handle.pidfd, on_exit, handle)
    handle._writer = loop.create_task(handle._write_loop())
    return handle


def reap(handle: WorkerHandle) -> int | None:
    """After the worker exited (or to clean up): deliver what it sent before it died (a
    StepFailed naming the requests that crashed it, tokens, hand-offs), stop watching, unlink
    its segments."""
    loop = asyncio.get_running_loop()
    if handle.receiver is not None and handle.alive:
        handle.receiver.flush()
    handle.alive = False
    loop.remove_reader(handle.pidfd)
    os.close(handle.pidfd)
    if handle.receiver is not None:
        handle.receiver.close()
    if handle._writer is not None:
        handle._writer.cancel()
    for ch in (handle.inbox, handle.outbox):
        ch.close()
        ch.unlink()
    unlink_segment(handle.kv_segment)  # a worker that exits cleanly has unlinked it already
    if not handle.ready.done():
        handle.ready.set_exception(RuntimeError(
            f"worker {handle.worker_id} ({handle.role}) exited with code "
            f"{handle.proc.poll()} before it was ready"))
    return handle.proc.wait()
