"""Where requests go: the global pick of an entry worker (least loaded), re-runs after a
worker's death, and the prefill -> decode hand-off that control forwards (the topology is a
star: a restart or flip only touches that worker's rings, and the request table always knows
who holds a request)."""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Mapping

import msgspec

from tetri_server.config import Config
from tetri_server.control.accounting import RequestAccounting
from tetri_server.control.monitor import Monitor
from tetri_server.control.requests import DONE, ReqState, Request
from tetri_server.control.supervisor import WorkerHandle
from tetri_server.control.table import RequestTable
from tetri_server.messages import Abort, AddRequest, Handoff, HandoffRejected, KVPulled

MAX_RERUNS = 3


class Router:
    def __init__(self, cfg: Config, workers: Mapping[int, WorkerHandle], draining: set[int],
                 table: RequestTable, monitor: Monitor, accounting: RequestAccounting,
                 on_decode_prompt: Callable[[], None] = lambda: None) -> None:
        self.cfg = cfg
        # elastic: a prompt went to a decode worker (the cluster re-sends the decode view, so
        # prefill workers stop handing off behind it before the next tick)
        self.on_decode_prompt = on_decode_prompt
        self.disaggregated = cfg.cluster.mode == "disaggregated"
        self.workers = workers
        self.draining = draining
        self.table = table
        self.monitor = monitor
        self.accounting = accounting
        self.metrics = accounting.metrics
        # suspects (requests of a crashed step) re-run one at a time, so a second crash names
        # one of them: the one on trial, and those waiting for their turn
        self._trial: Request | None = None
        self._suspects: deque[Request] = deque()

    def route(self, req: Request) -> None:
        """Send to the least-loaded prefill (or coupled) worker, or (elastic) a decode worker
        that prefills it sooner (``Monitor.pick``); the prompt of a re-run includes the tokens
        already streamed, so the stream continues where it stopped. With no live worker to take
        it, it waits (bounded) for one."""
        prompt = req.prompt_ids + req.output_ids
        wid = self.monitor.pick(len(prompt))
        if wid is None:
            self.table.park(req, self.deadline())
            return
        done = len(req.output_ids)
        p = req.params
        # a re-run after streamed tokens: its prompt holds them, and the client already has
        # the prompt logprobs (first delta)
        params = p if done == 0 else msgspec.structs.replace(
            p, max_tokens=p.max_tokens - done, min_tokens=max(0, p.min_tokens - done),
            prompt_logprobs=None, num_prior_output=done)
        req.owner, req.src, req.state = wid, -1, ReqState.PREFILL
        req.prompt_part = None  # a re-run computes the prompt's logprobs again from the start
        req.wait_deadline_s = None if self.has_live("decode") else self.deadline()
        to_decode = self.disaggregated and self.workers[wid].role == "decode"
        # the oracle's length is of what is left to generate, as max_tokens is
        true_len = (req.true_output_len if req.true_output_len is None or done == 0
                    else max(1, req.true_output_len - done))
        self.workers[wid].post(AddRequest(req.wire_id, prompt, params, req.arrival_s,
                                          true_len, req.prompt_text,
                                          self.monitor.picker.stamp(wid),
                                          self.monitor.prefill_chunk() if to_decode else 0))
        if to_decode:
            self.on_decode_prompt()

    def rerun(self, req: Request) -> None:
        """Re-run a request whose worker died, from its prompt plus what was streamed."""
        src = self.workers.get(req.src)
        if src is not None and src.alive:
            src.post(Abort(req.wire_id))  # free the KV it holds for the hand-off
        req.src = -1
        req.num_reruns += 1
        if req.num_reruns > MAX_RERUNS:
            self.table.fail(req, "worker failed repeatedly while running this request")
            return
        if req.suspect:
            req.suspect_clear_at = len(req.output_ids) + 2
            if req is not self._trial:
                if self._on_trial():
                    req.owner, req.state, req.wait_deadline_s = -1, ReqState.PREFILL, None
                    self._suspects.append(req)  # waits for its turn (``next_suspect``)
                    return
                self._trial = req
        self.route(req)

    def _on_trial(self) -> bool:
        """A suspect is re-running and has neither streamed two tokens since nor ended."""
        t = self._trial
        return (t is not None and t.suspect and t.state not in DONE
                and self.table.get(t.req_id) is t)

    def next_suspect(self) -> None:
        """Once the suspect on trial has streamed two tokens (a prefill step's and a decode
        step's: the caller clears its ``suspect``) or ended, the next waiting one re-runs.
        Called on each such event and each tick."""
        while not self._on_trial() and self._suspects:
            req = self._suspects.popleft()
            if req.state in DONE or self.table.get(req.req_id) is not req:
                continue  # aborted or failed while it waited
            self._trial = req
            self.route(req)

    def withdraw(self, req: Request) -> None:
        """Re-run a request whose hand-off source died where the decode worker's mapping
        does not outlive it (CUDA IPC): that worker drops it, and it runs again from what was
        streamed, possibly on that same worker (what it still sends about the old attempt
        names that attempt's ``wire_id``: control ignores it)."""
        owner = self.workers.get(req.owner)
        if owner is not None and owner.alive:
            owner.post(Abort(req.wire_id))
        self.rerun(req)

    def has_live(self, role: str) -> bool:
        """A worker of ``role`` is serving (always True for decode in the coupled modes)."""
        if role == "decode" and not self.disaggregated:
            return True
        return any(h.role == role and self.monitor.serving(w) for w, h in self.workers.items())

    def deadline(self) -> float:
        return time.monotonic() + self.cfg.cluster.worker_wait_s

    def bound_waits(self) -> None:
        """No decode worker serves any more (the last one died): the requests on prefill
        workers wait for one at most ``cluster.worker_wait_s`` from now, as those routed during
        the outage do (``route``); a token streamed or a decode worker back lifts the bound."""
        if self.has_live("decode"):
            return
        deadline = self.deadline()
        for req in self.table:
            if req.state is ReqState.PREFILL and req.wait_deadline_s is None:
                req.wait_deadline_s = deadline

    def forward_handoff(self, src: WorkerHandle, msg: Handoff) -> None:
        req = self.table.of(msg.req_id)
        if req is None:
            return  # aborted meanwhile: the prefill worker freed its blocks on Abort
        dst = self.workers.get(msg.dst_worker)
        if dst is None or not self.monitor.serving(dst.worker_id) or dst.role != "decode":
            src.post(HandoffRejected(msg.req_id, f"decode worker {msg.dst_worker} is down"))
            return
        first = not req.handoff_s  # not after a refusal (nor in a re-run)
        req.owner, req.src, req.state = dst.worker_id, src.worker_id, ReqState.HANDOFF
        req.handoff_s = time.monotonic()
        req.wait_deadline_s = None
        # once per request (a hand-off the decode worker refused is forwarded again); not a
        # kept request handed back
        if first and len(msg.token_ids) - msg.num_prompt_tokens <= 1:
            self.metrics.observe_phase("prefill", req.handoff_s - req.arrival_s)
        self.accounting.on_handoff(req, msg, src.pool)
        dst.post(msg)

    def on_kv_pulled(self, h: WorkerHandle, msg: KVPulled) -> None:
        """The decode worker holds the KV now: the prefill worker may free its copy. One whose
        source died meanwhile (``src`` reset: its pool outlives it on shm) decodes too."""
        req = self.table.of(msg.req_id)
        if req is None or req.owner != h.worker_id or req.state is not ReqState.HANDOFF:
            return
        if req.src in self.workers:
            self.workers[req.src].post(msg)
        req.src, req.state = -1, ReqState.DECODE
        self.metrics.observe_phase("handoff", time.monotonic() - req.handoff_s)
        self.accounting.on_pulled(req)

    def on_handoff_rejected(self, h: WorkerHandle, msg: HandoffRejected) -> None:
        req = self.table.of(msg.req_id)
        if req is None or req.owner != h.worker_id:
            return  # gone, or withdrawn from this worker and re-run (``withdraw``)
        src = self.workers.get(req.src)
        if src is not None and src.alive:
            src.post(msg)  # it keeps the KV and dispatches again
            req.owner, req.src, req.state = req.src, -1, ReqState.PREFILL
        else:  # the prefill worker died meanwhile: nobody holds its KV any more
            self.rerun(req)

