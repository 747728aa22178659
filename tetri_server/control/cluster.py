"""The control process's core, and the ``Backend`` of the HTTP layer: it routes requests to
workers and turns worker messages into request state. The parts it is made of:

- ``RequestTable`` (``table.py``): the live requests, fail/abort, requests waiting for a worker;
- ``Monitor`` (``monitor.py``): load reports, the global pick, the decode view, stall checks;
- ``Supervisor`` (``supervisor.py``): worker processes, pidfd exits, restarts, the give-up;
- ``FlipController`` (``flip.py``): the flip procedure around the pure ``FlipPolicy``.

Everything runs on one asyncio loop and never blocks: worker messages arrive through
``AsyncReceiver`` callbacks, worker deaths through pidfds, the monitor tick on ``call_later``.
Every wait (start-up, tokens, restarts, drain) has a bound.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tetri_server.channel import MessageTooLarge, cleanup_stale_segments, new_run_id
from tetri_server.config import Config
from tetri_server.control.accounting import RequestAccounting
from tetri_server.control.flip import FlipController
from tetri_server.control.monitor import Monitor, NullMetrics
from tetri_server.control.protocol import (
    GenerationError,
    InvalidRequestError,
    RequestTooLargeError,
    WorkerUnavailableError,
    join_prompt_part,
)
from tetri_server.control.requests import DONE, ReqState, Request, Stream
from tetri_server.control.routing import Router
from tetri_server.control.supervisor import Supervisor, WorkerHandle
from tetri_server.control.table import RequestTable
from tetri_server.messages import (
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
    StartFailed,
    StepFailed,
    StepOutput,
)
from tetri_server.modelinfo import load_tokenizer, read_limits, resolve_model_path

log = logging.getLogger("tetri.control")


def predictor_tokenizer_mismatch(folder: Path, artifact: str | None) -> str | None:
    """Why the length predictor's buckets are in other tokens than the model's (the artifact
    counted its training lengths with another tokenizer.json), or None. Not checked: an
    artifact trained on served lengths (no sha recorded), a model without tokenizer.json."""
    from tetri_server.predictor import artifact as artifact_io

    recorded = artifact_io.read_meta(artifact_io.resolve(artifact)).get("tokenizer", {})
    sha, model_file = recorded.get("sha256"), folder / "tokenizer.json"
    if not sha or not model_file.is_file():
        return None
    if hashlib.sha256(model_file.read_bytes()).hexdigest() == sha:
        return None
    return (f"the length predictor ({artifact or 'the shipped default'}) learned its buckets "
            f"in tokens of {recorded.get('name')}, not of this model's tokenizer: its "
            f"predictions are off by the ratio of the two (retrain it on this model: "
            f"docs/predictor.md)")


class Cluster:
    def __init__(self, cfg: Config, metrics: Any = None) -> None:
        folder = resolve_model_path(cfg.model.path)  # makes builtin:tiny once, here
        limits = read_limits(folder)
        self.model_name = cfg.model.served_name or folder.name
        self.max_model_len = limits.max_model_len(cfg.model.max_model_len)
        # the workers serve the context the API accepts; one whose transformers reads a smaller
        # one from config.json fails to start, naming both, instead of cutting outputs short
        self.cfg = dataclasses.replace(cfg, model=dataclasses.replace(
            cfg.model, path=str(folder), max_model_len=self.max_model_len))
        self.eos_token_ids = limits.eos_token_ids
        self.vocab_size = limits.vocab_size  # rows of the embedding: larger ids are refused
        self.tokenizer = load_tokenizer(folder)
        self.metrics = metrics if metrics is not None else NullMetrics()
        self.disaggregated = cfg.cluster.mode == "disaggregated"
        if self.disaggregated and cfg.predictor.kind == "classifier":
            why = predictor_tokenizer_mismatch(folder, cfg.predictor.artifact or None)
            if why:
                log.warning("%s", why)
        # a decode worker's mapping of a dead prefill worker's pool: shm keeps the memory
        # until the last mapping goes; CUDA IPC does not (the owner's death frees it, and an
        # importer reading it is undefined behaviour), so a hand-off from it runs again
        self.kv_outlives_owner = cfg.cluster.device != "cuda"
        self.draining: set[int] = set()  # flipping: no new requests, out of the decode view
        self.supervisor = Supervisor(self.cfg, self._on_message, self._on_death,
                                     self._undeliverable, self.metrics)
        if self.disaggregated and cfg.cluster.device == "cuda":
            self.supervisor.check_peer_access(len(self.roles()))
        self.workers = self.supervisor.workers
        self.table = RequestTable(self.workers, self.cfg.server.max_queued_requests)
        self.requests = self.table.requests
        self.monitor = Monitor(self.cfg, self.workers, self.draining, self.metrics)
        self.reports = self.monitor.reports
        self.accounting = RequestAccounting(self.cfg, self.metrics)
        self.router = Router(self.cfg, self.workers, self.draining, self.table, self.monitor,
                             self.accounting, self.broadcast_view)
        self.flipper = FlipController(self)
        self._tick: asyncio.TimerHandle | None = None
        self._handlers: dict[type, Callable[[WorkerHandle, Any], None]] = {
            StepOutput: self._on_step_output, Handoff: self.router.forward_handoff,
            KVPulled: self.router.on_kv_pulled, HandoffRejected: self.router.on_handoff_rejected,
            StepFailed: self._on_step_failed, LoadReport: self._on_report,
            RequestFailed: self._on_request_failed, Ready: self._on_ready,
            StartFailed: self._on_start_failed,
        }

    @property
    def run_id(self) -> str:
        return self.supervisor.run_id

    @property
    def num_restarts(self) -> int:
        return self.supervisor.num_restarts

    @property
    def fatal(self) -> asyncio.Future[str] | None:
        return self.supervisor.fatal

    # ------------------------------------------------------------------ life cycle

    def roles(self) -> dict[int, str]:
        c = self.cfg.cluster
        if self.disaggregated:
            return {i: "prefill" if i < c.prefill_workers else "decode"
                    for i in range(c.prefill_workers + c.decode_workers)}
        return {i: "coupled" for i in range(c.workers)}

    async def start(self) -> None:
        removed = cleanup_stale_segments()
        if removed:
            log.warning("removed %d stale shared-memory segments of dead runs", len(removed))
        self.supervisor.begin(new_run_id())
        # Workers never need the API key, and argv is visible to every user of the machine.
        config = self.cfg.to_dict(redact=True)
        timeout = self.cfg.cluster.worker_start_timeout_s
        try:  # a spawn that fails (/dev/shm full) stops the workers spawned before it too
            handles = [self.supervisor.spawn(wid, role, config)
                       for wid, role in self.roles().items()]
            await asyncio.wait_for(asyncio.gather(*(h.ready for h in handles)), timeout)
        except BaseException:
            await self.stop(drain_timeout_s=0)
            raise
        self.supervisor.started = True
        self.monitor.start(time.monotonic())
        self._broadcast_pools()
        self._schedule_tick()
        log.info("cluster ready: %s", ", ".join(f"worker{h.worker_id}={h.role}"
                                                 for h in handles))

    async def stop(self, drain_timeout_s: float | None = None) -> None:
        """Let in-flight requests finish (bounded), then shut every worker down."""
        bound = self.cfg.server.drain_timeout_s if drain_timeout_s is None else drain_timeout_s
        if not await self.table.drained(bound):
            log.warning("drain bound of %.0f s reached with %d requests in flight", bound,
                        len(self.table))
        self.supervisor.stopping = True
        if self._tick is not None:
            self._tick.cancel()
        for req in self.table:
            self.fail(req, "server is shutting down", retry_after_s=1.0)  # another may serve
        await self.supervisor.shutdown()

    def is_ready(self) -> bool:
        """Every worker up and serving (``GET /health``)."""
        return (not self.supervisor.stopping and bool(self.workers)
                and all(h.is_ready for h in self.workers.values()))

    # ------------------------------------------------------------------ requests

    def submit(self, prompt_ids: list[int], params: SamplingParams, *, prompt_text: str = "",
               true_output_len: int | None = None) -> Stream:
        if self.supervisor.stopping or not self.supervisor.started:
            raise WorkerUnavailableError("server is not ready (starting or shutting down)")
        req = self.table.add(prompt_ids, params, prompt_text, true_output_len)
        self.router.route(req)
        return Stream(self, req, self.cfg.server.request_timeout_s)

    def abort(self, req_id: int, *, stopped: bool = False) -> None:
        """Free ``req_id`` everywhere: its client went away, or (``stopped``) a stop string
        matched, which finishes it with "stop" in the request metrics."""
        if stopped and (req := self.table.requests.get(req_id)) is not None:
            self.accounting.on_finished(req, "stop", time.monotonic())
        self.table.abort(req_id)

    def fail(self, req: Request, error: str | GenerationError,
             retry_after_s: float | None = None) -> None:
        self.table.fail(req, error, retry_after_s)

    # ------------------------------------------------------------------ admin

    async def flip(self, worker_id: int, role: str) -> Any:
        """Flip one worker by hand (``POST /admin/flip``); FlipRefused with the reason."""
        return await self.flipper.flip(worker_id, role)

    def workers_info(self) -> list[dict[str, Any]]:
        return self.monitor.workers_info()

    # ------------------------------------------------------------------ worker messages

    def _on_message(self, h: WorkerHandle, msg: FromWorker) -> None:
        if not h.alive:
            return
        h.last_heard_s = time.monotonic()
        self._handlers[type(msg)](h, msg)

    def _on_step_output(self, h: WorkerHandle, msg: StepOutput) -> None:
        now = time.monotonic()
        for d in msg.deltas:
            req = self.table.of(d.req_id)
            if req is None or req.owner != h.worker_id:
                continue  # gone, or re-run elsewhere: a stale owner's tokens are not its
            if d.prompt_logprobs is not None:
                req.prompt_part, forward = join_prompt_part(req.prompt_part, d)
                if not forward:
                    continue
            req.output_ids.extend(d.token_ids)
            if req.wait_deadline_s is not None and d.token_ids:  # not stuck: it streams
                req.wait_deadline_s = now + self.cfg.cluster.worker_wait_s
            if req.suspect and len(req.output_ids) >= req.suspect_clear_at:
                req.suspect = False  # it ran a prefill and a decode step since its crash
                self.router.next_suspect()
            self.accounting.on_delta(req, d, now)
            req.queue.put_nowait(d)
            if d.finish_reason is not None:
                self.table.finish(req)

    def _on_start_failed(self, h: WorkerHandle, msg: StartFailed) -> None:
        h.start_error = msg.error  # reap() names it when the worker's exit fails h.ready

    def _on_request_failed(self, h: WorkerHandle, msg: RequestFailed) -> None:
        req = self.table.of(msg.req_id)
        if req is None or h.worker_id not in (req.owner, req.src):  # a stale owner's
            return
        if msg.misrouted and h.worker_id == req.owner:
            log.info("request %d reached worker %d as a %s: routed again", req.req_id,
                     h.worker_id, h.role)
            self.router.rerun(req)
            return
        self.fail(req, InvalidRequestError(msg.error) if msg.invalid else msg.error)

    def _on_step_failed(self, h: WorkerHandle, msg: StepFailed) -> None:
        """A step raised on ``h`` (it exits next). Requests of a step of one, or of a second
        crashed step, fail alone; the others are re-run when the worker's exit is seen, one at
        a time (``Router.next_suspect``), so a second crash names the one to blame."""
        for req_id in msg.req_ids:
            req = self.table.of(req_id)
            if req is None:
                continue
            if len(msg.req_ids) == 1 or req.suspect:
                log.error("request %d crashed worker %d: %s", req.req_id, h.worker_id, msg.error)
                self.fail(req, f"this request crashed a worker ({msg.error})")
            else:
                req.suspect = True

    def _on_ready(self, h: WorkerHandle, msg: Ready) -> None:
        flipped = h.ready.done() and msg.role != h.role
        h.pool, h.chunk_size, h.role = msg.pool, msg.chunk_size, msg.role
        self.monitor.on_ready(h, msg)
        if not h.ready.done():
            h.ready.set_result(None)
            self.supervisor.on_ready(h)
        if flipped:
            self.flipper.on_ready(h.worker_id, msg.switch_s)
        elif h.generation > 0:
            self._broadcast_pools()  # a restarted worker: peers map its new pool
        # a prefill worker: the view before the prompts (without one it keeps every request
        # it prefills, elastic, for good); a decode worker: in the prefill workers' views at
        # once (at start, or restarted, it was left out until the next tick)
        self.broadcast_view()
        self.route_parked()

    def route_parked(self) -> None:
        """A worker serves (again): the parked requests are routed; parked again if none can
        take them (the deadline of their first park stands)."""
        for req in self.table.take_parked():
            self.router.route(req)

    def _undeliverable(self, msg: object, error: Exception) -> None:
        req = self.table.of(getattr(msg, "req_id", -1))
        if req is None:
            return
        if isinstance(error, MessageTooLarge):
            self.fail(req, RequestTooLargeError(f"request too large for the worker channel "
                                                f"({error})"))
        else:  # the API's checks let through what the channel cannot encode: a bug of ours
            self.fail(req, GenerationError(f"the request could not be sent to a worker "
                                           f"({type(error).__name__}: {error})"))

    # ------------------------------------------------------------------ deaths

    def _on_death(self, h: WorkerHandle, code: int | None) -> None:
        """Re-run what the dead worker owned on a live one; with none, the request waits,
        bounded, for the restart (a few seconds of model loading) and then gets 503."""
        self.flipper.on_worker_exit(h.worker_id)
        self.draining.discard(h.worker_id)
        self.monitor.remove(h.worker_id)
        for req in self.table:
            if req.src == h.worker_id and req.state not in DONE:
                if not self.kv_outlives_owner and req.state is ReqState.HANDOFF:
                    self.router.withdraw(req)  # the decode worker may not have pulled it
                    continue
                req.src = -1  # the decode worker's mapping of the dead pool stays valid
            if req.owner == h.worker_id and req.state not in DONE:
                self.router.rerun(req)
        if h.role == "decode":
            self.router.bound_waits()
        self._broadcast_pools()

    # ------------------------------------------------------------------ the monitor tick

    def _schedule_tick(self) -> None:
        loop = asyncio.get_running_loop()
        self._tick = loop.call_later(self.cfg.monitor.interval_ms / 1000, self._on_tick)

    def _on_tick(self) -> None:
        """Every monitor.interval_ms: stalled workers, requests past their wait, the decode
        view to every prefill worker, the flip policy."""
        now = time.monotonic()
        self.monitor.check_stalls(now)
        self.supervisor.abandon_stuck(now)
        if self.table.parked:  # elastic: a decode worker may have room for them now
            self.route_parked()
        wait = self.cfg.cluster.worker_wait_s
        for req in self.table.expired(now, self.router.has_live("decode")):
            self.fail(req, f"no worker could take the request within {wait:g} s "
                      "(workers restarting); retry", retry_after_s=max(1.0, wait / 2))
        self.router.next_suspect()  # the suspect on trial may have ended meanwhile
        self.broadcast_view()
        self.monitor.count_requests(len(self.table), sum(r.owner == -1 for r in self.table))
        self.flipper.on_tick()
        if not self.supervisor.stopping:
            self._schedule_tick()

    def _on_report(self, h: WorkerHandle, msg: LoadReport) -> None:
        if self.monitor.on_report(h, msg):
            self.broadcast_view()  # a decode worker's routed prompts are all prefilled

    def broadcast_view(self) -> None:
        """The decode view to every prefill worker: each tick, and when a prompt went to a
        decode worker."""
        if not self.disaggregated:
            return
        view: DecodeView = self.monitor.decode_view()
        for h in self.workers.values():
            if h.role == "prefill" and h.is_ready:
                h.post(view)

    def _broadcast_pools(self) -> None:
        pools = [h.pool for h in self.workers.values() if h.is_ready and h.pool is not None]
        for h in self.workers.values():
            if h.is_ready:
                h.post(PeerPools(pools))
