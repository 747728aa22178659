"""What every worker process has: one device, one model copy, one KV pool, two channels, and the
loop  drain inbox -> plan -> execute -> update -> report.  Role logic lives in subclasses."""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import time
from typing import Any

import msgspec
import torch

from tetri_server.channel import Channel
from tetri_server.config import Config
from tetri_server.engine.cuda_graphs import decode_graphs, scratch_blocks
from tetri_server.engine.grammar import Grammars
from tetri_server.engine.loader import load_model
from tetri_server.engine.ops import set_batch_invariant
from tetri_server.engine.runner import ModelRunner
from tetri_server.engine.stops import split_prompt_parts
from tetri_server.kv.blocks import BlockAllocator, blocks_for, check_pool_holds
from tetri_server.kv.manager import KVCacheManager
from tetri_server.kv.transport import PoolGeometry, make_transport, open_peers, pool_layout
from tetri_server.messages import (
    Abort,
    AddRequest,
    DecodeView,
    FromWorker,
    Handoff,
    HandoffRejected,
    KVPulled,
    LoadReport,
    PeerPools,
    Ready,
    RequestFailed,
    SetRole,
    Shutdown,
    StartFailed,
    StepFailed,
    StepOutput,
    TokenDelta,
    ToWorker,
    WorkerSpec,
)
from tetri_server.policy import LengthTail
from tetri_server.workers.heartbeat import Heartbeat
from tetri_server.workers.trace import DecisionLog

log = logging.getLogger("tetri.worker")
SEND_TIMEOUT_S = 30.0
START_ERROR_CHARS = 2000  # of a start failure's message sent to the control process


def length_tail(cfg: Config, kind: str) -> LengthTail | None:
    """The refined estimate's length distribution for predictor ``kind`` (``none`` for a role
    that predicts nothing), or None under ``decode.estimate = "bucket"``. Read from the predictor
    artifact when a role is made, so a missing one fails the worker's start."""
    if cfg.decode.estimate == "bucket":
        return None
    from tetri_server.predictor import tails

    return tails.load(kind, cfg.predictor.artifact or None)


def workers_on_device(index: int, num_workers: int, num_devices: int) -> int:
    """Workers the supervisor puts on ``cuda:index`` (worker i on ``cuda:(i mod devices)``)."""
    return max(1, len(range(index, num_workers, max(1, num_devices))))


def cuda_kv_budget(free: float, total: float, weights: float, sharing: int,
                   fraction: float) -> float:
    """Bytes of a worker's KV pool on a GPU that ``sharing`` workers share, each with its own
    copy of the ``weights``: ``fraction`` of the memory the weights leave, split evenly, and at
    most ``fraction`` of what is free now. Sized from free memory alone, two workers starting
    together each took half of all of it (nothing left for activations), and one sizing after
    the other got half the first's pool."""
    even = max(0.0, total - sharing * weights) * fraction / max(1, sharing)
    return min(free * fraction, even)


def cpu_kv_budget(avail: float, shm_free: float, fraction: float, num_workers: int, *,
                  restart: bool = False) -> tuple[float, bool]:
    """Bytes of a worker's KV pool on the CPU, and whether /dev/shm's free space set it. At
    the first start, the workers start together: each takes ``fraction`` of the memory
    available now, split evenly, and at most 90% of its share of /dev/shm's free space. A
    restarted worker sizes beside its peers' pools, which already count as used (and the dead
    one's while a peer still maps it): split again, it got 14-37% fewer blocks than before.
    It takes at most ``fraction`` of what is available, and 90% of /dev/shm's free space,
    whole (the caller caps it at its predecessor's pool)."""
    share = 1 if restart else max(1, num_workers)
    budget = avail * fraction / share
    shm_cap = 0.9 * shm_free / share
    return min(budget, shm_cap), shm_cap < budget


def bind_device(device: torch.device) -> None:
    """Make ``device`` this process's current CUDA device. Triton launches its kernels on the
    current device and stream, not on their tensors' device: a worker on ``cuda:1`` would
    launch on ``cuda:0`` ("Pointer argument cannot be accessed from Triton", or with peer
    access a race with its own stream), and make a context there that no pool size counted."""
    if device.type == "cuda":
        torch.cuda.set_device(device)


def _die_with_parent(parent_pid: int) -> None:
    """Linux: SIGTERM this process when the control process dies (no orphans). While the
    control process lives, SIGINT and SIGTERM are its to act on: a Ctrl-C in the terminal or
    a SIGTERM to the whole process group (systemd's default ``KillMode``) reaches every worker
    too, and a worker that died of it mid-drain was restarted (the model loaded again) and its
    requests re-run. Control drains, then stops the workers itself."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)

    def on_sigterm(signum: int, frame: object) -> None:
        if os.getppid() == parent_pid:
            log.info("SIGTERM ignored: the control process drains and stops this worker")
            return
        # orphaned: exit through the run loop's cleanup (its KV pool is unlinked there;
        # killed by the signal, the pool stayed in /dev/shm until the next start)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, on_sigterm)
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:
        log.warning("prctl(PR_SET_PDEATHSIG) unavailable; relying on the parent-pid check")
    if os.getppid() != parent_pid:  # it died before the prctl: no signal will come
        signal.raise_signal(signal.SIGTERM)


class Worker:
    """The process-wide runtime. ``role`` (prefill, decode or coupled) decides what a step
    does; it can be replaced in place (instance flip) once drained: same process, weights and
    pool."""

    def __init__(self, spec: WorkerSpec) -> None:
        _die_with_parent(spec.parent_pid)
        self.spec = spec
        self.cfg = Config.from_dict(spec.config)
        self.worker_id = spec.worker_id
        if spec.cpus:
            os.sched_setaffinity(0, spec.cpus)
        torch.set_num_threads(max(1, spec.num_threads))
        self.inbox = Channel.attach(spec.inbox, ToWorker)
        self.outbox = Channel.attach(spec.outbox, FromWorker)
        try:
            self._start(spec)
        except BaseException as e:
            self._report_start_failure(e)
            self.inbox.close()  # so the real error is the last thing printed
            self.outbox.close()
            raise

    def _report_start_failure(self, error: BaseException) -> None:
        """Tell the control process why this worker will not start, so the server's own last
        line names the cause (the traceback goes to stderr as well)."""
        text = f"{type(error).__name__}: {error}" if str(error) else type(error).__name__
        try:
            self.outbox.send(StartFailed(self.worker_id, text[:START_ERROR_CHARS]),
                             timeout_s=1.0)
        except Exception:  # the control process may be gone; the traceback still says it
            log.exception("worker %d: could not report its start failure", self.worker_id)

    def _start(self, spec: WorkerSpec) -> None:
        self.device = torch.device(spec.device)
        bind_device(self.device)  # before anything touches CUDA
        mcfg = self.cfg.model
        self.model, self.model_spec = load_model(mcfg.path, mcfg.dtype, self.device)
        s = self.model_spec
        self.max_model_len = s.max_model_len(mcfg.max_model_len)
        dtype = next(self.model.parameters()).dtype
        set_batch_invariant(mcfg.batch_invariant, self.device.type, dtype)
        bs = self.cfg.kv.block_size
        num_blocks = self.cfg.kv.num_blocks or self._blocks_from_memory(dtype)
        check_pool_holds(num_blocks, scratch_blocks(self.device, mcfg.cuda_graphs),
                         self.max_model_len, bs)
        layout = pool_layout(self.cfg.kv.layout, self.device, dtype, s.num_kv_heads, s.head_dim)
        geometry = PoolGeometry(s.num_layers, num_blocks, bs, s.num_kv_heads, s.head_dim, dtype,
                                layout)
        self.transport = make_transport(self.cfg.kv.transport, self.worker_id, geometry,
                                        self.device, spec.kv_segment)
        self.allocator = BlockAllocator(num_blocks)
        self.kv = KVCacheManager(self.allocator, self.transport.kv, bs)
        self.grammars = Grammars(mcfg.path, s.vocab_size, s.eos_token_ids,
                                 num_threads=spec.num_threads)
        self.runner = ModelRunner(self.model, s, self.transport.kv, bs, self.device,
                                  self.grammars)
        if self.device.type == "cuda" and mcfg.cuda_graphs:
            self.runner.graphs = decode_graphs(self.model, self.transport.kv, self.allocator,
                                               bs, self.cfg.decode.max_batch, self.device)
        self.block_size = bs
        self.busy_s = 0.0
        self.stopping = False
        self.report_interval_s = self.cfg.monitor.interval_ms / 1000.0
        self._predictor: Any = None
        self.pending_role: str | None = None  # SetRole received; switch once drained
        self.last_add_seq = 0  # the highest AddRequest.add_seq handled (the reports say it)
        self.decisions = DecisionLog.open(self.cfg.monitor.decision_log, self.worker_id)
        self.role = make_role(spec.role, self)

    def _blocks_from_memory(self, dtype: torch.dtype) -> int:
        kv = self.cfg.kv
        if kv.memory_gb > 0:
            budget = kv.memory_gb * 2**30
        elif self.device.type == "cuda":
            free, total = torch.cuda.mem_get_info(self.device)
            sharing = workers_on_device(self.device.index or 0, self.cfg.cluster.num_workers,
                                        torch.cuda.device_count())
            weights = sum(t.numel() * t.element_size()
                          for t in (*self.model.parameters(), *self.model.buffers()))
            budget = cuda_kv_budget(free, total, weights, sharing, kv.memory_fraction)
        else:
            avail = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
            st = os.statvfs("/dev/shm")  # the CPU pool lives there: a small tmpfs caps it
            shm_free = st.f_bavail * st.f_frsize
            budget, shm_binds = cpu_kv_budget(avail, shm_free, kv.memory_fraction,
                                              self.cfg.cluster.num_workers,
                                              restart=self.spec.previous_num_blocks > 0)
            if shm_binds:
                log.warning("worker %d: /dev/shm is small (%.0f MiB free): KV pool sized to "
                            "%.0f MiB", self.worker_id, shm_free / 2**20, budget / 2**20)
        # More than max_batch full-length sequences (x2: a prefill worker also holds requests
        # waiting for dispatch) cannot be used; a bigger pool only costs start-up page faults.
        useful = 2 * self.cfg.decode.max_batch * blocks_for(self.max_model_len, kv.block_size)
        fits = self.model_spec.blocks_in_budget(budget, dtype.itemsize, kv.block_size)
        previous = self.spec.previous_num_blocks
        if previous and self.device.type == "cpu":
            if fits < previous:
                log.warning("worker %d: restarted with %d KV blocks, %d before: memory is "
                            "short", self.worker_id, fits, previous)
            return max(1, min(previous, fits))
        return max(1, min(useful, fits))

    def predictor(self) -> Any:
        """The length predictor, loaded once per process (kept across role flips)."""
        if self._predictor is None:
            from tetri_server.predictor import load_predictor

            p = self.cfg.predictor
            self._predictor = load_predictor(p.kind, p.artifact or None)
        return self._predictor

    # ------------------------------------------------------------------ the loop

    def ready_message(self, switch_s: float = 0.0) -> Ready:
        return Ready(self.worker_id, self.role.name, self.transport.export(),
                     self.role.chunk_size(), os.getpid(), switch_s)

    def run(self) -> None:
        self.send(self.ready_message())
        next_report = time.monotonic()
        mon = self.cfg.monitor
        beat = Heartbeat(self.outbox, min(1.0, mon.stall_timeout_s / 4),
                         max(mon.max_step_s, mon.stall_timeout_s))
        try:
            while not self.stopping:
                beat.busy()
                for msg in self.inbox.drain():
                    self.handle(msg)
                if os.getppid() != self.spec.parent_pid:
                    log.warning("control process is gone; worker %d exits", self.worker_id)
                    break
                ran = False
                if self.role.has_work():
                    t0 = time.monotonic()
                    ran = self.step()
                    if ran:  # busy_s feeds the flip rule: waiting steps do not count
                        self.busy_s += time.monotonic() - t0
                elif self.pending_role is not None and self.role.is_drained():
                    self.switch_role(self.pending_role)
                    ran = True
                if not ran:  # idle, or blocked (e.g. no blocks): wait for a message, bounded
                    wait = max(0.0, next_report - time.monotonic())
                    beat.idle()
                    msg = self.inbox.recv(timeout_s=min(wait, 0.5))
                    if msg is not None:
                        beat.busy()
                        self.handle(msg)
                now = time.monotonic()
                if now >= next_report:
                    self.send(self.load_report())
                    next_report = now + self.report_interval_s
        finally:
            beat.close()
            self.decisions.close()
            self.transport.close()
            self.inbox.close()
            self.outbox.close()

    def load_report(self) -> LoadReport:
        """The role's report, with the last prompt stamp this process handled (the global
        pick counts the prompts sent after it on top)."""
        return msgspec.structs.replace(self.role.load_report(), last_add_seq=self.last_add_seq)

    def step(self) -> bool:
        """One step of the role; True if it made progress. If it raises, the requests of the
        forward pass it ran are named to the control process (``StepFailed``) before the worker
        dies: a request that crashes workers must fail alone, not be re-run until every worker
        is dead."""
        self.runner.last_plan = None
        try:
            return self.role.step()
        except Exception as e:
            plan = self.runner.last_plan
            req_ids = [] if plan is None else [item.seq.req_id for item in plan.items]
            log.exception("worker %d: step failed with requests %s", self.worker_id, req_ids)
            self.send(StepFailed(self.worker_id, req_ids, f"{type(e).__name__}: {e}"[:500]))
            raise

    def switch_role(self, role: str) -> None:
        """Instance flip, after the drain: a new role object over the same model and pool."""
        t0 = time.monotonic()
        assert self.allocator.num_free == self.allocator.num_blocks, "flip before drain"
        self.pending_role = None
        if role != self.role.name:
            self.role = make_role(role, self, at_start=False)
        self.send(self.ready_message(switch_s=time.monotonic() - t0))
        self.send(self.load_report())

    def send(self, msg: object) -> None:
        self.outbox.send(msg, timeout_s=SEND_TIMEOUT_S)

    def send_deltas(self, deltas: list[TokenDelta]) -> None:
        """A step's deltas, in as many ``StepOutput`` messages as their prompt logprobs need
        (each at most a quarter of the ring, ``split_prompt_parts``); none if there are none."""
        for group in split_prompt_parts(deltas, self.outbox.capacity // 4):
            self.send(StepOutput(self.worker_id, group))

    def handle(self, msg: object) -> None:
        if isinstance(msg, AddRequest):  # from here on, our reports count it
            self.last_add_seq = max(self.last_add_seq, msg.add_seq)
        if isinstance(msg, Shutdown):
            self.stopping = True
        elif isinstance(msg, PeerPools):
            self.on_peer_pools(msg)
        elif isinstance(msg, Abort):
            self.role.abort(msg.req_id)
        elif isinstance(msg, SetRole):
            self.pending_role = pending_role_after(self.role.name, self.pending_role, msg)
        elif isinstance(msg, AddRequest) and (err := self.grammars.check(msg.sampling.guide)):
            # a guide that does not compile fails its request alone, before any work (a 400)
            self.send(RequestFailed(msg.req_id, err, invalid=True))
        else:
            self.role.handle(msg)

    def on_peer_pools(self, msg: PeerPools) -> None:
        open_peers(self.transport, [p for p in msg.pools if p.worker_id != self.worker_id])


def pending_role_after(current: str, pending: str | None, msg: SetRole) -> str | None:
    """The role a worker is to switch to once drained, after ``msg``. A cancel drops only the
    flip it names: one that already happened (its cancel crossed the ``Ready``) must not turn
    into a flip back behind control's back."""
    if msg.cancel:
        return None if pending == msg.role else pending
    return None if msg.role == current else msg.role


class Role:
    """What one kind of worker does each step. Owned by a ``Worker`` (``self.w``)."""

    name = "base"

    def __init__(self, w: Worker) -> None:
        self.w = w

    def chunk_size(self) -> int:
        return 0

    def handle(self, msg: object) -> None:
        """Messages meant for another role can arrive just after a flip (sent before control
        learnt of it): a Handoff is refused so the prefill worker re-dispatches it, the rest
        (a DecodeView, a KVPulled for KV this role never held) is dropped."""
        if isinstance(msg, Handoff):
            self.w.send(HandoffRejected(msg.req_id, f"worker {self.w.worker_id} is now "
                                        f"a {self.name} worker"))
        elif isinstance(msg, AddRequest):  # control never routes to a draining worker
            self.w.send(RequestFailed(msg.req_id, f"routed to a {self.name} worker",
                                      misrouted=True))
        elif isinstance(msg, DecodeView | KVPulled | HandoffRejected):
            log.info("%s worker %d dropped a stray %s", self.name, self.w.worker_id,
                     type(msg).__name__)
        else:
            raise TypeError(f"{self.name} worker got {type(msg).__name__}")

    def abort(self, req_id: int) -> None:
        raise NotImplementedError

    def has_work(self) -> bool:
        """Requests are queued or running here (a step may still find nothing it can run)."""
        raise NotImplementedError

    def is_drained(self) -> bool:
        """Nothing in flight any more (no queued, running or handed-off request)."""
        return not self.has_work()

    def step(self) -> bool:
        """Plan, execute, update. True if it made progress (ran a forward, or preempted or
        failed requests); False if nothing could run now (the worker then waits for a message,
        bounded by the report interval, instead of spinning)."""
        raise NotImplementedError

    def load_report(self) -> LoadReport:
        raise NotImplementedError


def make_role(name: str, w: Worker, *, at_start: bool = True) -> Role:
    """``at_start``: False for a flip (the worker serves already)."""
    if name == "prefill":
        from tetri_server.workers.prefill import PrefillRole

        return PrefillRole(w, at_start=at_start)
    if name == "decode":
        from tetri_server.workers.decode import DecodeRole

        return DecodeRole(w)
    if name == "coupled":
        from tetri_server.workers.coupled import CoupledRole

        return CoupledRole(w)
    raise ValueError(f"unknown worker role {name!r}")
