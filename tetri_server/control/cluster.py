"""The control process's core: workers, request table, global scheduler, cluster monitor,
message forwarding and supervision. Implements the ``Backend`` protocol for the HTTP layer.

Everything here runs on one asyncio loop and never blocks: worker messages arrive through
``AsyncReceiver`` callbacks (eventfd + add_reader), worker deaths through pidfds, the monitor
runs on ``call_later``. Every wait (start-up, tokens, drain) has a bound.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import time
from typing import Any

import msgspec

from tetri_server.channel import cleanup_stale_segments, new_run_id
from tetri_server.config import Config
from tetri_server.control.protocol import GenerationError, QueueFullError, WorkerUnavailableError
from tetri_server.control.requests import DONE, ReqState, Request, Stream
from tetri_server.control.restarts import RestartPolicy
from tetri_server.control.supervisor import WorkerHandle, reap, spawn_worker
from tetri_server.messages import (
    Abort,
    AddRequest,
    DecodeInstanceView,
    DecodeView,
    FromWorker,
    Handoff,
    HandoffRejected,
    KVPulled,
    LoadReport,
    PeerPools,
    Ready,
    RequestFailed,
    SamplingParams,
    Shutdown,
    StepFailed,
    StepOutput,
)
from tetri_server.policy import LeastLoadedPicker

log = logging.getLogger("tetri.control")
MAX_RERUNS = 3
MAX_PROMPT_TEXT_CHARS = 64 * 1024


class Cluster:
    def __init__(self, cfg: Config, metrics: Any = None) -> None:
        from tetri_server.engine.loader import load_hf_config, resolve_model_path
        from tetri_server.engine.spec import spec_from_hf_config

        folder = resolve_model_path(cfg.model.path)  # makes builtin:tiny once, here
        self.cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model,
                                                                      path=str(folder)))
        spec = spec_from_hf_config(load_hf_config(folder))
        self.model_name = cfg.model.served_name or folder.name
        limit = spec.max_position_embeddings
        self.max_model_len = min(cfg.model.max_model_len or limit, limit)
        self.eos_token_ids = spec.eos_token_ids
        self.vocab_size = spec.vocab_size  # rows of the embedding: larger token ids are refused
        from transformers import AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
        self.metrics = metrics
        self.disaggregated = cfg.cluster.mode == "disaggregated"
        self.workers: dict[int, WorkerHandle] = {}
        self.generations: dict[int, int] = {}
        self.requests: dict[int, Request] = {}
        self.picker = LeastLoadedPicker(coupled=not self.disaggregated)
        self.reports: dict[int, LoadReport] = {}
        self.num_restarts = 0
        c = cfg.cluster
        self.restarts = RestartPolicy(c.restart_backoff_s, c.restart_backoff_max_s,
                                      c.max_restarts, c.restart_reset_s)
        self.parked: list[Request] = []  # no live worker of the entry role: waiting for one
        self.fatal: asyncio.Future[str] | None = None  # set: the server must exit non-zero
        self._last_tick_s = 0.0
        self._next_id = 0
        self._view_seq = 0
        self._stopping = False
        self._started = False
        self._monitor: asyncio.TimerHandle | None = None
        self._drained = asyncio.Event()
        self.draining: set[int] = set()  # flipping: no new requests, out of the decode view
        from tetri_server.control.flip import FlipController

        self.flipper = FlipController(self)

    # ------------------------------------------------------------------ life cycle

    def roles(self) -> dict[int, str]:
        c = self.cfg.cluster
        if self.disaggregated:
            return {i: "prefill" if i < c.prefill_workers else "decode"
                    for i in range(c.prefill_workers + c.decode_workers)}
        return {i: "coupled" for i in range(c.workers)}

    def _cpus(self, worker_id: int) -> tuple[list[int], int]:
        cores = sorted(os.sched_getaffinity(0))
        n = max(1, self.cfg.cluster.threads_per_worker)
        if self.cfg.cluster.device != "cpu":
            return [], n
        first = (worker_id * n) % len(cores)
        return [cores[(first + k) % len(cores)] for k in range(min(n, len(cores)))], n

    def _spawn(self, worker_id: int, role: str) -> WorkerHandle:
        gen = self.generations.get(worker_id, -1) + 1
        self.generations[worker_id] = gen
        cpus, threads = self._cpus(worker_id)
        device = "cpu"
        if self.cfg.cluster.device == "cuda":
            device = f"cuda:{worker_id % max(1, _num_cuda_devices())}"
        # Workers never need the API key, and argv is visible to every user of the machine.
        h = spawn_worker(worker_id, role, gen, self.run_id, self.cfg.to_dict(redact=True),
                         cpus, threads, device, self._on_message, self._on_exit)
        h.on_undeliverable = self._undeliverable
        self.workers[worker_id] = h
        return h

    async def start(self) -> None:
        removed = cleanup_stale_segments()
        if removed:
            log.warning("removed %d stale shared-memory segments of dead runs", len(removed))
        self.run_id = new_run_id()
        self.fatal = asyncio.get_running_loop().create_future()
        handles = [self._spawn(wid, role) for wid, role in self.roles().items()]
        timeout = self.cfg.cluster.worker_start_timeout_s
        try:
            await asyncio.wait_for(asyncio.gather(*(h.ready for h in handles)), timeout)
        except BaseException:
            await self.stop(drain_timeout_s=0)
            raise
        self._started = True
        self._last_tick_s = time.monotonic()
        for h in handles:
            h.last_heard_s = self._last_tick_s
        self._broadcast_pools()
        self._schedule_monitor()
        log.info("cluster ready: %s", ", ".join(f"worker{h.worker_id}={h.role}"
                                                 for h in handles))

    async def stop(self, drain_timeout_s: float | None = None) -> None:
        """Let in-flight requests finish (bounded), then shut every worker down."""
        bound = self.cfg.server.drain_timeout_s if drain_timeout_s is None else drain_timeout_s
        if self.requests:
            self._drained.clear()
            try:
                await asyncio.wait_for(self._drained.wait(), bound)
            except TimeoutError:
                log.warning("drain bound of %.0f s reached with %d requests in flight", bound,
                            len(self.requests))
        self._stopping = True
        if self._monitor is not None:
            self._monitor.cancel()
        for req in list(self.requests.values()):
            self.fail(req, "server is shutting down")
        for h in self.workers.values():
            h.post(Shutdown())
        for h in list(self.workers.values()):
            if not h.alive:
                continue
            try:
                await asyncio.wait_for(asyncio.to_thread(h.proc.wait), 10.0)
            except TimeoutError:
                h.proc.kill()
            if h.alive:
                reap(h)

    def is_ready(self) -> bool:
        return (not self._stopping and bool(self.workers)
                and all(h.is_ready for h in self.workers.values()))

    # ------------------------------------------------------------------ requests

    def submit(self, prompt_ids: list[int], params: SamplingParams, *, prompt_text: str = "",
               true_output_len: int | None = None) -> Stream:
        if len(self.requests) >= self.cfg.server.max_queued_requests:
            raise QueueFullError(retry_after_s=1.0)
        if self._stopping or not self._started:
            raise WorkerUnavailableError("server is not ready (starting or shutting down)")
        # The text only feeds the length predictor; bounded, so an AddRequest always fits a ring.
        text = prompt_text[:MAX_PROMPT_TEXT_CHARS]
        req = Request(self._next_id, list(prompt_ids), params, text, true_output_len)
        self._next_id += 1
        self.requests[req.req_id] = req
        self._route(req)
        return Stream(self, req, self.cfg.server.request_timeout_s)

    def _route(self, req: Request) -> None:
        """Send to the least-loaded prefill (or coupled) worker; the prompt of a re-run
        includes the tokens already streamed, so the stream continues where it stopped."""
        down = [w for w, h in self.workers.items() if not h.is_ready or w in self.draining]
        prompt = req.prompt_ids + req.output_ids
        wid = self.picker.pick(len(prompt), exclude=down)
        if wid is None:
            self._park(req)
            return
        done = len(req.output_ids)
        p = req.params
        params = p if done == 0 else msgspec.structs.replace(
            p, max_tokens=p.max_tokens - done, min_tokens=max(0, p.min_tokens - done))
        req.owner, req.src, req.state = wid, -1, ReqState.PREFILL
        req.wait_deadline_s = None if self._has_live("decode") else self._deadline()
        self.workers[wid].post(AddRequest(req.req_id, prompt, params, req.arrival_s,
                                          req.true_output_len, req.prompt_text))

    def _has_live(self, role: str) -> bool:
        """A worker of ``role`` is serving (always True for decode in the coupled modes)."""
        if role == "decode" and not self.disaggregated:
            return True
        return any(h.is_ready and h.role == role and w not in self.draining
                   for w, h in self.workers.items())

    def _deadline(self) -> float:
        return time.monotonic() + self.cfg.cluster.worker_wait_s

    def _park(self, req: Request) -> None:
        """No live worker can start the request (every one of the role is restarting): it
        waits, bounded by cluster.worker_wait_s, and is routed when one is ready."""
        req.owner, req.src, req.state = -1, -1, ReqState.PREFILL
        if req.wait_deadline_s is None:
            req.wait_deadline_s = self._deadline()
        if req not in self.parked:
            self.parked.append(req)

    def _unpark(self) -> None:
        parked, self.parked = self.parked, []
        for req in parked:
            if req.state not in DONE and req.req_id in self.requests:
                req.wait_deadline_s = None
                self._route(req)

    # ------------------------------------------------------------------ admin

    async def flip(self, worker_id: int, role: str) -> Any:
        """Flip one worker by hand (``POST /admin/flip``); FlipRefused with the reason."""
        return await self.flipper.flip(worker_id, role)

    def workers_info(self) -> list[dict[str, Any]]:
        out = []
        for wid, h in sorted(self.workers.items()):
            r = self.reports.get(wid)
            state = ("stalled" if h.stalled and h.alive else "draining" if wid in self.draining
                     else "ready" if h.is_ready else "starting" if h.alive else "dead")
            load = None if r is None else {
                "waiting": r.num_waiting, "running": r.num_running,
                "queued_prompt_tokens": r.num_queued_prompt_tokens,
                "kv_blocks_used": r.num_total_blocks - r.num_free_blocks,
                "kv_blocks_total": r.num_total_blocks, "busy_s": round(r.busy_s, 3)}
            out.append({"id": wid, "role": h.role, "state": state, "pid": h.proc.pid,
                        "generation": h.generation, "chunk_size": h.chunk_size, "load": load})
        return out

    def _forget(self, req_id: int) -> Request | None:
        req = self.requests.pop(req_id, None)
        if not self.requests:
            self._drained.set()
        return req

    def abort(self, req_id: int) -> None:
        req = self._forget(req_id)
        if req is None:
            return
        req.state = ReqState.ABORTED
        for wid in {req.owner, req.src} - {-1}:
            if wid in self.workers:
                self.workers[wid].post(Abort(req_id))

    def fail(self, req: Request, error: str, retry_after_s: float | None = None) -> None:
        """The request ends with an error for its client: 503 + Retry-After when
        ``retry_after_s`` is given (retrying may work), else a generation error."""
        if req.state in DONE:
            return
        req.state = ReqState.FAILED
        self._forget(req.req_id)
        if req in self.parked:
            self.parked.remove(req)
        req.queue.put_nowait(GenerationError(error) if retry_after_s is None
                             else WorkerUnavailableError(error, retry_after_s))
        for wid in {req.owner, req.src} - {-1}:
            h = self.workers.get(wid)
            if h is not None and h.alive:
                h.post(Abort(req.req_id))

    # ------------------------------------------------------------------ worker messages

    def _on_message(self, h: WorkerHandle, msg: FromWorker) -> None:
        if not h.alive:
            return
        h.last_heard_s = time.monotonic()
        if isinstance(msg, StepOutput):
            for d in msg.deltas:
                req = self.requests.get(d.req_id)
                if req is None:
                    continue
                req.output_ids.extend(d.token_ids)
                req.queue.put_nowait(d)
                if d.finish_reason is not None:
                    req.state = ReqState.FINISHED
                    self._forget(d.req_id)
        elif isinstance(msg, Handoff):
            self._forward_handoff(h, msg)
        elif isinstance(msg, KVPulled):
            req = self.requests.get(msg.req_id)
            if req is not None and req.src in self.workers:
                self.workers[req.src].post(msg)
                req.src, req.state = -1, ReqState.DECODE
                if self.metrics is not None:
                    self.metrics.observe_phase("handoff", time.monotonic() - req.handoff_s)
        elif isinstance(msg, HandoffRejected):
            req = self.requests.get(msg.req_id)
            if req is None:
                return
            src = self.workers.get(req.src)
            if src is not None and src.alive:
                src.post(msg)  # it keeps the KV and dispatches again
                req.owner, req.src, req.state = req.src, -1, ReqState.PREFILL
            else:  # the prefill worker died meanwhile: nobody holds its KV any more
                req.src = -1
                self._rerun(req)
        elif isinstance(msg, StepFailed):
            self._on_step_failed(h, msg)
        elif isinstance(msg, LoadReport):
            self.reports[h.worker_id] = msg
            self.picker.on_report(msg)
            if self.metrics is not None:
                self.metrics.set_worker(
                    h.worker_id, h.role, blocks_used=msg.num_total_blocks - msg.num_free_blocks,
                    blocks_total=msg.num_total_blocks, busy_s=msg.busy_s,
                    num_preemptions=msg.num_preemptions)
        elif isinstance(msg, RequestFailed):
            req = self.requests.get(msg.req_id)
            if req is not None:
                self.fail(req, msg.error)
        elif isinstance(msg, Ready):
            flipped = h.ready.done() and msg.role != h.role
            h.pool, h.chunk_size, h.role = msg.pool, msg.chunk_size, msg.role
            empty = LoadReport(h.worker_id, msg.role, 0, 0, 0, msg.pool.num_blocks,
                               msg.pool.num_blocks, 0, 0, 0, 0.0)
            self.reports[h.worker_id] = empty
            self.picker.on_report(empty)
            if not h.ready.done():
                h.ready.set_result(None)
                self.restarts.on_ready(h.worker_id, time.monotonic())
            if self.metrics is not None:
                self.metrics.set_up(h.worker_id, True)
            if self.metrics is not None and msg.chunk_size:
                self.metrics.set_chunk_size(h.worker_id, msg.chunk_size)
            if flipped:
                self.flipper.on_ready(h.worker_id, msg.switch_s)
            elif h.generation > 0:
                self._broadcast_pools()  # a restarted worker: peers map its new pool
            self._unpark()

    def _undeliverable(self, msg: object, error: str) -> None:
        req = self.requests.get(getattr(msg, "req_id", -1))
        if req is not None:
            self.fail(req, f"request too large for the worker channel ({error})")

    def _on_step_failed(self, h: WorkerHandle, msg: StepFailed) -> None:
        """A step raised on ``h`` (it exits next). Requests of a step of one, or of a second
        crashed step, fail alone; the others are re-run when the worker's exit is seen."""
        for req_id in msg.req_ids:
            req = self.requests.get(req_id)
            if req is None:
                continue
            if len(msg.req_ids) == 1 or req.suspect:
                log.error("request %d crashed worker %d: %s", req_id, h.worker_id, msg.error)
                self.fail(req, f"this request crashed a worker ({msg.error})")
            else:
                req.suspect = True

    def _forward_handoff(self, src: WorkerHandle, msg: Handoff) -> None:
        req = self.requests.get(msg.req_id)
        if req is None:
            return  # aborted meanwhile: the prefill worker freed its blocks on Abort
        dst = self.workers.get(msg.dst_worker)
        if (dst is None or not dst.is_ready or dst.worker_id in self.draining
                or dst.role != "decode"):
            src.post(HandoffRejected(msg.req_id, f"decode worker {msg.dst_worker} is down"))
            return
        req.owner, req.src, req.state = dst.worker_id, src.worker_id, ReqState.HANDOFF
        req.handoff_s = time.monotonic()
        req.wait_deadline_s = None
        if self.metrics is not None:
            self.metrics.observe_phase("prefill", req.handoff_s - req.arrival_s)
        dst.post(msg)

    # ------------------------------------------------------------------ monitor

    def _schedule_monitor(self) -> None:
        loop = asyncio.get_running_loop()
        self._monitor = loop.call_later(self.cfg.monitor.interval_ms / 1000, self._broadcast_view)

    def _broadcast_view(self) -> None:
        """Cluster monitor: the decode view, from the latest reports, to every prefill worker;
        stalled workers and requests waiting past their bound are dealt with here."""
        now = time.monotonic()
        self._check_stalls(now)
        self._expire_waits(now)
        self._view_seq += 1
        decodes = [DecodeInstanceView(wid, r.num_free_blocks, r.num_total_blocks, r.num_heavy,
                                      r.num_light, r.predicted_demand_blocks)
                   for wid, r in sorted(self.reports.items())
                   if r.role == "decode" and self.workers[wid].is_ready
                   and wid not in self.draining]
        view = DecodeView(self._view_seq, decodes)
        for h in self.workers.values():
            if self.disaggregated and h.role == "prefill" and h.is_ready:
                h.post(view)
        if self.metrics is not None:
            waiting = sum(r.num_waiting for r in self.reports.values())
            self.metrics.set_requests(running=len(self.requests) - waiting, waiting=waiting)
        self.flipper.on_tick()
        if not self._stopping:
            self._schedule_monitor()

    def _check_stalls(self, now: float) -> None:
        """A ready worker silent for monitor.stall_timeout_s (SIGSTOP, a stuck kernel, an
        endless loop) gets no new work and is killed: its exit re-runs its requests and
        restarts it. If this loop itself was blocked, nobody was listening: no verdicts."""
        bound = self.cfg.monitor.stall_timeout_s
        late = now - self._last_tick_s - self.cfg.monitor.interval_ms / 1000
        self._last_tick_s = now
        if late > bound / 2:
            log.warning("control loop was blocked for %.1f s; stall checks restart", late)
            for h in self.workers.values():
                h.last_heard_s = now
            return
        for h in self.workers.values():
            silent = now - h.last_heard_s
            if h.is_ready and silent > bound:
                log.error("worker %d (%s) sent nothing for %.1f s: stalled; killing it",
                          h.worker_id, h.role, silent)
                h.stalled = True
                if self.metrics is not None:
                    self.metrics.inc_stalls()
                    self.metrics.set_up(h.worker_id, False)
                h.proc.kill()

    def _expire_waits(self, now: float) -> None:
        for req in [r for r in self.requests.values()
                    if r.wait_deadline_s is not None and now > r.wait_deadline_s]:
            wait = self.cfg.cluster.worker_wait_s
            self.fail(req, f"no worker could take the request within {wait:.0f} s "
                      "(workers restarting); retry", retry_after_s=max(1.0, wait / 2))

    def _broadcast_pools(self) -> None:
        pools = [h.pool for h in self.workers.values() if h.is_ready and h.pool is not None]
        for h in self.workers.values():
            if h.is_ready:
                h.post(PeerPools(pools))

    # ------------------------------------------------------------------ supervision

    def _on_exit(self, h: WorkerHandle) -> None:
        code = reap(h)
        self.flipper.on_worker_exit(h.worker_id)
        self.draining.discard(h.worker_id)
        if self.metrics is not None:
            self.metrics.set_up(h.worker_id, False)
        if self._stopping or not self._started:
            return  # start() reports a worker that dies before it is ready
        log.error("worker %d (%s) exited with code %s", h.worker_id, h.role, code)
        self.picker.remove_worker(h.worker_id)
        self.reports.pop(h.worker_id, None)
        # Re-run on a live worker (of the entry role); with none, the request waits, bounded,
        # for the restart (a few seconds of model loading) and then gets 503.
        for req in list(self.requests.values()):
            if req.src == h.worker_id:
                req.src = -1  # the decode worker's mapping of the dead pool stays valid
            if req.owner == h.worker_id and req.state not in DONE:
                self._rerun(req)
        self._broadcast_pools()
        if not self.cfg.cluster.restart_workers:
            return
        delay = self.restarts.on_death(h.worker_id, time.monotonic())
        if delay is None:
            n = self.restarts.deaths_in_a_row(h.worker_id)
            msg = f"worker {h.worker_id} died {n} times in a row; giving up"
            log.critical("%s: the server exits", msg)
            if self.fatal is not None and not self.fatal.done():
                self.fatal.set_result(msg)
            return
        log.warning("restarting worker %d (%s) in %.1f s", h.worker_id, h.role, delay)
        self.num_restarts += 1
        if self.metrics is not None:
            self.metrics.inc_restarts(h.worker_id)
        asyncio.get_running_loop().call_later(delay, self._restart, h.worker_id, h.role)

    def _restart(self, worker_id: int, role: str) -> None:
        if self._stopping:
            return
        new = self._spawn(worker_id, role)
        new.ready.add_done_callback(_log_ready_failure)
        asyncio.get_running_loop().call_later(self.cfg.cluster.worker_start_timeout_s,
                                              self._start_timed_out, new)

    def _start_timed_out(self, h: WorkerHandle) -> None:
        if h.alive and not h.ready.done():
            log.error("restarted worker %d not ready after %.0f s; killing it", h.worker_id,
                      self.cfg.cluster.worker_start_timeout_s)
            h.proc.kill()  # its exit counts as one more death in a row

    def _rerun(self, req: Request) -> None:
        """Re-run a request whose worker died, from its prompt plus what was streamed."""
        for wid in {req.src} - {-1}:
            if wid in self.workers:
                self.workers[wid].post(Abort(req.req_id))  # free KV held for a hand-off
        req.num_reruns += 1
        if req.num_reruns > MAX_RERUNS:
            self.fail(req, "worker failed repeatedly while running this request")
            return
        self._route(req)


def _log_ready_failure(fut: asyncio.Future[None]) -> None:
    if not fut.cancelled() and fut.exception() is not None:
        log.error("restarted worker failed: %s", fut.exception())


def _num_cuda_devices() -> int:
    import torch

    return torch.cuda.device_count()
