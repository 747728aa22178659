"""Worker processes: spawn with their channels, notice death through a pidfd, clean up.

A worker is ``python -m tetri_server.workers.main <WorkerSpec JSON>`` started with
``Popen(pass_fds=...)``: its two rings' eventfds are the only fds it inherits. Every segment it
uses is named from the run id, so ``cleanup_stale_segments`` can remove them after a crash of
the control process; the control process unlinks them when the worker exits.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import secrets
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import msgspec

from tetri_server.channel import AsyncReceiver, Channel, unlink_segment
from tetri_server.config import Config, ConfigError
from tetri_server.control.restarts import RestartPolicy
from tetri_server.messages import FromWorker, PoolHandle, Shutdown, ToWorker, WorkerSpec

log = logging.getLogger("tetri.supervisor")
RING_BYTES = 4 << 20
SHUTDOWN_WAIT_S = 10.0  # Shutdown to exit, all workers together; then they are killed
SEND_TIMEOUT_S = 30.0
REAP_WAIT_S = 5.0  # a killed worker to be reaped (one stuck in the kernel is left behind)
PEER_CHECK_TIMEOUT_S = 120.0  # the GPU peer-access query (imports torch, sets CUDA up)


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
    killed_s: float = 0.0  # when the stall check killed it (monotonic; 0: not killed)
    start_error: str | None = None  # its StartFailed: why it exits before it is ready
    # called with a message that can never be sent (larger than the worker's ring, or
    # not encodable) and why; the messages after it keep flowing
    on_undeliverable: Callable[[ToWorker, Exception], None] | None = None
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

    def shows_life(self, within_s: float) -> bool:
        """It sent a message or stamped its heartbeat (its step goes on) within ``within_s``."""
        return time.monotonic() - max(self.last_heard_s, self.outbox.last_beat_s()) < within_s

    async def _write_loop(self) -> None:
        while True:
            msg = await self._outgoing.get()
            while self.alive:
                try:
                    await self.inbox.send_async(msg, timeout_s=SEND_TIMEOUT_S)
                except TimeoutError:
                    if self.shows_life(SEND_TIMEOUT_S):  # a long step: it reads after it
                        log.warning("worker %d inbox full for %.0f s while it steps; waiting",
                                    self.worker_id, SEND_TIMEOUT_S)
                        continue
                    log.error("worker %d inbox stayed full for %.0f s and it shows no life; "
                              "killing it", self.worker_id, SEND_TIMEOUT_S)
                    self.proc.kill()
                    return
                except Exception as e:  # too large, or not encodable: this one alone is lost
                    log.error("worker %d: %s cannot be sent (%s: %s)", self.worker_id,
                              type(msg).__name__, type(e).__name__, e)
                    if self.on_undeliverable is not None:
                        self.on_undeliverable(msg, e)
                break


def spawn_worker(worker_id: int, role: str, generation: int, run_id: str,
                 config: dict[str, dict[str, object]], cpus: list[int], num_threads: int,
                 device: str, on_message: Callable[[WorkerHandle, FromWorker], None],
                 on_exit: Callable[[WorkerHandle], None],
                 previous_num_blocks: int = 0) -> WorkerHandle:
    loop = asyncio.get_running_loop()
    # A fresh random part per generation: names no other local user can guess or pre-create.
    prefix = f"{run_id}-w{worker_id}g{generation}-{secrets.token_hex(4)}"
    made: list[Channel[Any]] = []
    try:  # a failure (/dev/shm full, no fork) leaves no segment behind
        inbox: Channel[ToWorker] = Channel.create(f"{prefix}-in", RING_BYTES, ToWorker)
        made.append(inbox)
        outbox: Channel[FromWorker] = Channel.create(f"{prefix}-out", RING_BYTES, FromWorker)
        made.append(outbox)
        spec = WorkerSpec(worker_id, role, generation, run_id, config, inbox.spec, outbox.spec,
                          cpus, num_threads, os.getpid(), f"{prefix}-kv", device,
                          previous_num_blocks)
        # glibc would hand a step's large temporaries back to the OS and fault them in again
        # on the next step (30-40% extra time in a prefill-only process): keep freed memory.
        env = dict(os.environ, TOKENIZERS_PARALLELISM="false", OMP_NUM_THREADS=str(num_threads))
        env.setdefault("GLIBC_TUNABLES", "glibc.malloc.mmap_threshold=268435456:"
                       "glibc.malloc.trim_threshold=1073741824")
        proc = subprocess.Popen(
            [sys.executable, "-m", "tetri_server.workers.main",
             msgspec.json.encode(spec).decode()],
            pass_fds=inbox.spec.fds + outbox.spec.fds, stdin=subprocess.DEVNULL, env=env)
    except BaseException:
        for ch in made:
            ch.close()
            ch.unlink()
        raise
    handle = WorkerHandle(worker_id, role, generation, proc, inbox, outbox, f"{prefix}-kv",
                          os.pidfd_open(proc.pid))
    handle.receiver = AsyncReceiver(outbox, loop, lambda msg: on_message(handle, msg),
                                    on_broken=handle.proc.kill)  # its exit re-runs its work
    loop.add_reader(handle.pidfd, on_exit, handle)
    handle._writer = loop.create_task(handle._write_loop())
    return handle


def reap(handle: WorkerHandle, wait_s: float = REAP_WAIT_S) -> int | None:
    """After the worker exited (or to clean up): deliver what it sent before it died (a
    StepFailed naming the requests that crashed it, a StartFailed naming why it did not start,
    tokens, hand-offs), stop watching, unlink its segments. ``wait_s``: how long its exit may
    block this loop (0: a killed worker that has not gone is left behind at once)."""
    loop = asyncio.get_running_loop()
    if handle.receiver is not None and handle.alive:
        try:
            handle.receiver.flush()
        except Exception:  # a callback's error is reported there; the rest must still run
            log.exception("worker %d: delivering its last messages failed", handle.worker_id)
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
        why = f": {handle.start_error}" if handle.start_error else ""
        handle.ready.set_exception(RuntimeError(
            f"worker {handle.worker_id} ({handle.role}) exited with code "
            f"{handle.proc.poll()} before it was ready{why}"))
    try:  # at once after its exit; after a kill, a process stuck in the kernel may not go
        return handle.proc.wait(wait_s)
    except subprocess.TimeoutExpired:
        log.error("worker %d (pid %d) did not exit after it was killed; left behind",
                  handle.worker_id, handle.proc.pid)
        return None


class Supervisor:
    """Owns the worker processes of one run: spawns them (pinned cores, device), notices their
    exit (pidfd), restarts them with back-off and gives up after too many deaths in a row
    (``fatal``: the server exits non-zero). What a death means for requests is the caller's
    ``on_death``; messages go to ``on_message``."""

    def __init__(self, cfg: Config, on_message: Callable[[WorkerHandle, FromWorker], None],
                 on_death: Callable[[WorkerHandle, int | None], None],
                 on_undeliverable: Callable[[ToWorker, Exception], None], metrics: Any) -> None:
        c = cfg.cluster
        self.cfg = cfg
        self.workers: dict[int, WorkerHandle] = {}
        self.generations: dict[int, int] = {}
        self.pool_blocks: dict[int, int] = {}  # each worker id's KV pool at its first start
        self.restarts = RestartPolicy(c.restart_backoff_s, c.restart_backoff_max_s,
                                      c.max_restarts, c.restart_reset_s)
        self.num_restarts = 0
        self._left_behind: list[WorkerHandle] = []  # taken for dead, not exited: no restart yet
        self.run_id = ""
        self.fatal: asyncio.Future[str] | None = None  # set: the server must exit non-zero
        self.stopping = False
        self.started = False
        self._on_message = on_message
        self._on_death = on_death
        self._on_undeliverable = on_undeliverable
        self._num_cuda: int | None = None
        self.metrics = metrics

    def begin(self, run_id: str) -> None:
        self.run_id = run_id
        self.fatal = asyncio.get_running_loop().create_future()

    def _cpus(self, worker_id: int) -> tuple[list[int], int]:
        cores = sorted(os.sched_getaffinity(0))
        n = max(1, self.cfg.cluster.threads_per_worker)
        if self.cfg.cluster.device != "cpu":
            return [], n
        first = (worker_id * n) % len(cores)
        return [cores[(first + k) % len(cores)] for k in range(min(n, len(cores)))], n

    def _device(self, worker_id: int) -> str:
        if self.cfg.cluster.device != "cuda":
            return "cpu"
        if self._num_cuda is None:
            self._num_cuda = _num_cuda_devices()
        return f"cuda:{worker_id % max(1, self._num_cuda)}"

    def check_peer_access(self, num_workers: int) -> None:
        """Disaggregated on several GPUs: a decode worker maps a prefill worker's KV pool over
        CUDA IPC, which needs peer access between their GPUs (``cudaDeviceCanAccessPeer`` says
        whether such a mapping is possible). Without it every hand-off was refused and retried
        until the request timed out. Raises ``ConfigError`` naming the first such pair."""
        devices = sorted({self._device(w) for w in range(num_workers)})
        if len(devices) < 2:
            return
        pairs = _gpus_without_peer_access([int(d.split(":")[1]) for d in devices])
        if pairs:
            src, dst = pairs[0]
            raise ConfigError(
                f"GPU {dst} cannot map GPU {src}'s memory (no peer access): the KV hand-off "
                f"between workers on them goes over CUDA IPC. Give the workers GPUs with peer "
                f"access (CUDA_VISIBLE_DEVICES), or run cluster.mode = coupled")

    def spawn(self, worker_id: int, role: str,
              config: dict[str, dict[str, object]]) -> WorkerHandle:
        gen = self.generations.get(worker_id, -1) + 1
        self.generations[worker_id] = gen
        cpus, threads = self._cpus(worker_id)
        h = spawn_worker(worker_id, role, gen, self.run_id, config, cpus, threads,
                         self._device(worker_id), self._on_message, self._on_exit,
                         self.pool_blocks.get(worker_id, 0))
        h.on_undeliverable = self._on_undeliverable
        self.workers[worker_id] = h
        return h

    def on_ready(self, h: WorkerHandle) -> None:
        self.restarts.on_ready(h.worker_id, time.monotonic())
        if h.pool is not None:  # a restart asks for the same pool (see cpu_kv_budget)
            self.pool_blocks.setdefault(h.worker_id, h.pool.num_blocks)

    def _on_exit(self, h: WorkerHandle, wait_s: float = REAP_WAIT_S) -> None:
        code = reap(h, wait_s)
        if self.stopping or not self.started:
            return  # start() reports a worker that dies before it is ready
        log.error("worker %d (%s) exited with code %s", h.worker_id, h.role, code)
        self._on_death(h, code)
        if not self.cfg.cluster.restart_workers:
            return
        if h.proc.poll() is None:  # left behind: its memory (a GPU's) is still its own
            self._left_behind.append(h)
        else:
            self._schedule_restart(h.worker_id, h.role)

    def abandon_stuck(self, now_s: float) -> None:
        """A worker killed as stalled ``REAP_WAIT_S`` ago that still has not exited (stuck in
        the kernel: a GPU driver call may hold it for minutes) is taken for dead now, without
        its exit: its requests run again elsewhere, instead of all of them waiting for its exit
        (or their timeout). It restarts once it has really exited: until then its weights and
        KV pool still hold their memory, and a restart beside them would not fit, or would
        size its pool from what they leave."""
        for h in list(self._left_behind):
            if h.proc.poll() is not None:
                log.warning("worker %d (pid %d) exited at last; restarting it", h.worker_id,
                            h.proc.pid)
                self._left_behind.remove(h)
                self._schedule_restart(h.worker_id, h.role)
        for h in list(self.workers.values()):
            if h.alive and h.killed_s and now_s - h.killed_s > REAP_WAIT_S:
                log.error("worker %d (pid %d) has not exited %.0f s after it was killed: "
                          "taken for dead; it restarts once it exits", h.worker_id,
                          h.proc.pid, now_s - h.killed_s)
                self._on_exit(h, wait_s=0.0)

    def _schedule_restart(self, worker_id: int, role: str) -> None:
        """After a death, or a restart that could not even spawn: back off and try again, or
        give up (the server exits) after too many in a row."""
        delay = self.restarts.on_death(worker_id, time.monotonic())
        if delay is None:
            n = self.restarts.deaths_in_a_row(worker_id)
            msg = f"worker {worker_id} died {n} times in a row; giving up"
            log.critical("%s: the server exits", msg)
            if self.fatal is not None and not self.fatal.done():
                self.fatal.set_result(msg)
            return
        log.warning("restarting worker %d (%s) in %.1f s", worker_id, role, delay)
        self.num_restarts += 1
        self.metrics.inc_restarts(worker_id)
        asyncio.get_running_loop().call_later(delay, self._restart, worker_id, role)

    def _restart(self, worker_id: int, role: str) -> None:
        if self.stopping:
            return
        try:
            new = self.spawn(worker_id, role, self.cfg.to_dict(redact=True))
        except Exception as e:  # counts as a death: never a worker id left dead for good
            log.error("restarting worker %d failed: %s", worker_id, e)
            self._schedule_restart(worker_id, role)
            return
        new.ready.add_done_callback(_log_ready_failure)
        asyncio.get_running_loop().call_later(self.cfg.cluster.worker_start_timeout_s,
                                              self._start_timed_out, new)

    def _start_timed_out(self, h: WorkerHandle) -> None:
        if h.alive and not h.ready.done():
            log.error("restarted worker %d not ready after %.0f s; killing it", h.worker_id,
                      self.cfg.cluster.worker_start_timeout_s)
            h.proc.kill()  # its exit counts as one more death in a row

    async def shutdown(self) -> None:
        """Shutdown to every worker, wait for them all (``SHUTDOWN_WAIT_S`` in all: a worker
        still loading its model reads no message until it has, and a wait per worker made a
        stop during start-up take that long times the workers), kill the rest, reap them."""
        self.stopping = True
        for h in self.workers.values():
            h.post(Shutdown())
        live = [h for h in self.workers.values() if h.alive]
        deadline = time.monotonic() + SHUTDOWN_WAIT_S
        # polled, not a thread per worker: more workers than the default executor's threads
        # would queue their waits (and block other to_thread users) until the kill
        while any(h.proc.poll() is None for h in live) and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        for h in live:
            if h.proc.poll() is None:
                h.proc.kill()
            if h.alive:
                reap(h)


def _log_ready_failure(fut: asyncio.Future[None]) -> None:
    if not fut.cancelled() and fut.exception() is not None:
        log.error("restarted worker failed: %s", fut.exception())


def _gpus_without_peer_access(ids: list[int]) -> list[tuple[int, int]]:
    """(owner, mapper) pairs of these GPUs where the mapper cannot map the owner's memory.
    Asked in a child process: the query sets CUDA up, which in this process could leave a
    context (GPU memory the workers' pools are sized without)."""
    code = ("import json, sys, torch; ids = json.loads(sys.argv[1]); print(json.dumps("
            "[[a, b] for a in ids for b in ids if a != b "
            "and not torch.cuda.can_device_access_peer(b, a)]))")
    try:
        out = subprocess.run([sys.executable, "-c", code, json.dumps(ids)],
                             capture_output=True, text=True, timeout=PEER_CHECK_TIMEOUT_S,
                             check=True)
        return [(a, b) for a, b in json.loads(out.stdout.strip().splitlines()[-1])]
    except (subprocess.SubprocessError, OSError, ValueError, IndexError) as e:
        # the workers' own CUDA start says what is wrong with the devices; this check only
        # names a pair without peer access up front
        log.warning("could not ask the GPUs for peer access (%s: %s); not checked",
                    type(e).__name__, str(getattr(e, "stderr", "") or e)[-300:])
        return []


def _num_cuda_devices() -> int:
    import torch  # only with cluster.device = cuda: the control process stays torch-free

    return torch.cuda.device_count()
