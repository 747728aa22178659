"""The cluster monitor: load reports in, the decode view out, stalled workers noticed, the
gauges kept. Runs on the control loop; the cluster calls ``tick`` every monitor.interval_ms."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from tetri_server.config import Config
from tetri_server.control.supervisor import WorkerHandle
from tetri_server.messages import DecodeInstanceView, DecodeView, LoadReport, Ready
from tetri_server.policy import LeastLoadedPicker, LocalPrefill, mixed_chunk

log = logging.getLogger("tetri.monitor")


class NullMetrics:
    """What the control process reports when nobody collects metrics (tests, tools)."""

    def set_worker(self, *args: Any, **kwargs: Any) -> None: ...
    def set_requests(self, *args: Any, **kwargs: Any) -> None: ...
    def set_chunk_size(self, *args: Any, **kwargs: Any) -> None: ...
    def set_up(self, *args: Any, **kwargs: Any) -> None: ...
    def observe_phase(self, *args: Any, **kwargs: Any) -> None: ...
    def inc_restarts(self, *args: Any, **kwargs: Any) -> None: ...
    def inc_stalls(self, *args: Any, **kwargs: Any) -> None: ...
    def set_role(self, *args: Any, **kwargs: Any) -> None: ...
    def observe_flip(self, *args: Any, **kwargs: Any) -> None: ...
    def observe_handoff_bytes(self, *args: Any, **kwargs: Any) -> None: ...
    def observe_request_times(self, *args: Any, **kwargs: Any) -> None: ...
    def observe_prediction(self, *args: Any, **kwargs: Any) -> None: ...


class Monitor:
    """Owns the latest ``LoadReport`` of each worker and the global picker fed by them."""

    def __init__(self, cfg: Config, workers: Mapping[int, WorkerHandle], draining: set[int],
                 metrics: Any) -> None:
        self.cfg = cfg
        self.workers = workers
        self.draining = draining
        self.metrics = metrics
        self.reports: dict[int, LoadReport] = {}
        local = (LocalPrefill(cfg.kv.block_size, cfg.decode.local_prefill_margin,
                              cfg.decode.local_prefill_max_gap_x)
                 if cfg.decode.local_prefill_tokens > 0 else None)
        self.picker = LeastLoadedPicker(coupled=cfg.cluster.mode != "disaggregated",
                                        local_prefill=local)
        self._view_seq = 0
        self._view_generation = 0  # moves with each decode report, (re)start and removal
        # decode worker -> the generation of its last report (DecodeInstanceView.report_seq)
        self._report_seq: dict[int, int] = {}
        # decode worker -> its (re)starts and flips (DecodeInstanceView.incarnation)
        self._incarnation: dict[int, int] = {}
        self._last_tick_s = 0.0

    @property
    def view_seq(self) -> int:
        """Decode views built so far (each is posted to the prefill workers as it is built)."""
        return self._view_seq

    def start(self, now_s: float) -> None:
        self._last_tick_s = now_s
        for h in self.workers.values():
            h.last_heard_s = now_s

    def on_report(self, h: WorkerHandle, msg: LoadReport) -> bool:
        """Adopt a report; True when it says a decode worker has no prompt left to prefill
        after having some (the cluster re-sends the decode view: prefill workers stop keeping
        requests for it)."""
        self.reports[h.worker_id] = msg
        emptied = self.picker.on_report(msg)
        if msg.role == "decode":
            self._view_generation += 1
            self._report_seq[h.worker_id] = self._view_generation
        self.metrics.set_worker(
            h.worker_id, h.role, blocks_used=msg.num_total_blocks - msg.num_free_blocks,
            blocks_total=msg.num_total_blocks, busy_s=msg.busy_s,
            num_preemptions=msg.num_preemptions, num_kv_drops=msg.num_kv_drops,
            step_s=msg.step_s if msg.role == "decode" else None)
        return emptied

    def on_ready(self, h: WorkerHandle, msg: Ready) -> None:
        """A worker (re)started or flipped: an empty report in its role until its first one;
        a flipped one (the same process) keeps its busy total, which its reports go on
        counting (at 0, the flip rule read its whole past as its new role's first window)."""
        n = msg.pool.num_blocks
        before = self.reports.get(h.worker_id)  # none after a death (``remove``)
        empty = LoadReport(worker_id=h.worker_id, role=msg.role, num_waiting=0, num_running=0,
                           num_queued_prompt_tokens=0, num_free_blocks=n, num_total_blocks=n,
                           num_heavy=0, num_light=0, predicted_demand_blocks=0,
                           busy_s=before.busy_s if before is not None else 0.0)
        self.reports[h.worker_id] = empty
        self.picker.on_report(empty)
        self._view_generation += 1
        self._report_seq[h.worker_id] = self._view_generation
        self._incarnation[h.worker_id] = self._incarnation.get(h.worker_id, 0) + 1
        self.metrics.set_up(h.worker_id, True)
        self.metrics.set_role(h.worker_id, msg.role)
        if msg.chunk_size:
            self.metrics.set_chunk_size(h.worker_id, msg.chunk_size)

    def remove(self, worker_id: int) -> None:
        self.picker.remove_worker(worker_id)
        self._view_generation += 1
        self._report_seq.pop(worker_id, None)
        self.reports.pop(worker_id, None)
        self.metrics.set_up(worker_id, False)

    def serving(self, worker_id: int) -> bool:
        """Ready and not draining (flipping): control may send it work."""
        return self.workers[worker_id].is_ready and worker_id not in self.draining

    def pick(self, num_prompt_tokens: int) -> int | None:
        """The least-loaded serving entry worker (prefill, or coupled; elastic: or a decode
        worker that prefills it sooner), or None."""
        down = [w for w in self.workers if not self.serving(w)]
        chunks = {w: h.chunk_size for w, h in self.workers.items() if h.chunk_size}
        return self.picker.pick(num_prompt_tokens, exclude=down, chunk_sizes=chunks)

    def prefill_chunk(self) -> int:
        """The smallest chunk of the serving prefill workers, at most
        ``prefill.local_decode_chunk`` (``mixed_chunk``; 0: none serving): the most prompt
        tokens a decode worker prefills a step with ``decode.local_prefill_slice = "chunk"``,
        as many as a prefill worker's step with kept requests' rows takes."""
        chunks = [h.chunk_size for w, h in self.workers.items()
                  if h.role == "prefill" and self.serving(w) and h.chunk_size]
        return mixed_chunk(min(chunks), self.cfg.prefill.local_decode_chunk) if chunks else 0

    def decode_view(self) -> DecodeView:
        """The decode workers that may receive hand-offs, from their latest reports; their
        queued prompt tokens count the prompts routed since (a decode worker prefilling one in
        a long step cannot report until it ends)."""
        self._view_seq += 1
        decodes = [DecodeInstanceView.of(r, self.picker.queued_tokens(wid),
                                         self._report_seq.get(wid, -1),
                                         self._incarnation.get(wid, 0))
                   for wid, r in sorted(self.reports.items())
                   if r.role == "decode" and wid in self.workers and self.serving(wid)]
        return DecodeView(self._view_seq, decodes, self._view_generation)

    def count_requests(self, num_requests: int, num_unplaced: int = 0) -> None:
        """Running and waiting of the ``num_requests`` live ones, ``num_unplaced`` of which are
        on no worker (parked for a worker of a role that has none serving, suspects waiting
        for their re-run): those wait, whatever the reports say. The reports are up to one
        interval old: a request they count as waiting may have finished since, so waiting is
        capped at the live count (running never goes below 0)."""
        queued = sum(r.num_waiting for r in self.reports.values())
        waiting = min(num_requests, num_unplaced + queued)
        self.metrics.set_requests(running=num_requests - waiting, waiting=waiting)

    def check_stalls(self, now_s: float) -> None:
        """A ready worker silent for monitor.stall_timeout_s, with no heartbeat stamped
        (SIGSTOP, a frozen process; a stuck kernel or an endless loop once its turn passed
        monitor.max_step_s: ``workers.heartbeat``) gets no new work and is killed: its exit
        re-runs its requests and restarts it. If this loop itself was blocked, nobody was
        listening: no verdicts."""
        bound = self.cfg.monitor.stall_timeout_s
        late = now_s - self._last_tick_s - self.cfg.monitor.interval_ms / 1000
        self._last_tick_s = now_s
        if late > bound / 2:
            log.warning("control loop was blocked for %.1f s; stall checks restart", late)
            for h in self.workers.values():
                h.last_heard_s = now_s
            return
        for h in self.workers.values():
            if not h.is_ready:
                continue
            silent = now_s - max(h.last_heard_s, h.outbox.last_beat_s())
            if silent > bound:
                log.error("worker %d (%s) sent nothing and stamped no heartbeat for %.1f s: "
                          "stalled; killing it", h.worker_id, h.role, silent)
                h.stalled, h.killed_s = True, now_s
                self.metrics.inc_stalls()
                self.metrics.set_up(h.worker_id, False)
                h.proc.kill()

    def workers_info(self) -> list[dict[str, Any]]:
        """``GET /admin/workers``: each worker's role, state and latest load."""
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
