"""Instance flip: the procedure around the pure ``policy.FlipPolicy`` decision.

decide (policy on a monitor tick, or ``POST /admin/flip``) -> stop routing to the worker (a
decode worker also leaves the dispatchers' view, and hand-offs to it are rejected) -> the
worker drains (a prefill worker finishes and dispatches its queue; a decode worker finishes its
batch) -> it switches its role in place on ``SetRole`` (same process, same weights, same pool)
and answers ``Ready`` with the new role -> routing resumes. At least one prefill and one decode
worker always remain; one flip at a time.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from tetri_server.config import Config
from tetri_server.control.supervisor import WorkerHandle
from tetri_server.messages import FLIP_ROLES as ROLES
from tetri_server.messages import LoadReport, SetRole
from tetri_server.policy import FlipPlan, FlipPolicy


class FlipHost(Protocol):
    """What the flip procedure sees of the cluster."""

    cfg: Config
    disaggregated: bool
    workers: Mapping[int, WorkerHandle]
    draining: set[int]  # the controller adds a flipping worker, and removes it when done
    reports: Mapping[int, LoadReport]
    metrics: Any  # Metrics or NullMetrics

    def route_parked(self) -> None: ...

    def broadcast_view(self) -> None: ...

log = logging.getLogger("tetri.flip")


class FlipRefused(Exception):
    """The flip cannot be done (``POST /admin/flip`` answers 4xx with this reason)."""


@dataclass(frozen=True)
class FlipResult:
    worker_id: int
    from_role: str
    to_role: str
    total_s: float  # decision -> serving in the new role
    switch_s: float  # drained -> serving in the new role (the flip itself, excluding drain)


class FlipController:
    def __init__(self, cluster: FlipHost) -> None:
        f = cluster.cfg.flip
        self.cluster = cluster
        self.enabled = f.enabled
        self.policy = FlipPolicy(window_s=f.window_s, idle_window_s=f.idle_s,
                                 low_util=f.low_load, cooldown_s=f.min_interval_s)
        self.timeout_s = cluster.cfg.server.drain_timeout_s + 60.0
        # worker id -> (Ready's switch_s, the role it flips from)
        self._pending: dict[int, tuple[asyncio.Future[float], str]] = {}
        self.history: list[FlipResult] = []

    def check(self, worker_id: int, role: str) -> str:
        """The worker's current role, or FlipRefused with the reason."""
        c = self.cluster
        if not c.disaggregated:
            raise FlipRefused("flips need cluster.mode = disaggregated")
        if role not in ROLES:
            raise FlipRefused(f"role must be one of {ROLES}, got {role!r}")
        h = c.workers.get(worker_id)
        if h is None:
            raise FlipRefused(f"no worker {worker_id}; workers are {sorted(c.workers)}")
        if not h.is_ready or worker_id in c.draining:
            raise FlipRefused(f"worker {worker_id} is not serving (starting, draining or down)")
        if h.role == role:
            raise FlipRefused(f"worker {worker_id} is already {role}")
        if self._pending:
            raise FlipRefused("another flip is in progress")
        reason = self.policy.refusal(h.role, self._num_serving(h.role), time.monotonic())
        if reason is not None:
            raise FlipRefused(f"worker {worker_id} cannot flip: {reason}")
        return h.role

    def _num_serving(self, role: str) -> int:
        """Workers serving as ``role`` now (ready, not draining)."""
        c = self.cluster
        return sum(x.role == role and x.is_ready and w not in c.draining
                   for w, x in c.workers.items())

    async def flip(self, worker_id: int, role: str) -> FlipResult:
        """A manual flip (the policy's own go through ``_auto``)."""
        from_role = self.check(worker_id, role)
        plan = FlipPlan(worker_id, from_role, role, 0.0)
        self.policy.begin(plan)
        try:
            return await self._run(worker_id, from_role, role)
        finally:
            self.policy.on_done(plan, time.monotonic())

    async def _run(self, worker_id: int, from_role: str, role: str) -> FlipResult:
        """Drain, switch, resume. On a timeout the worker is told to cancel (``SetRole`` with
        ``cancel``), so it never switches later behind control's back; if it switched just
        before, its ``Ready`` still tells control its new role."""
        c = self.cluster
        t0 = time.monotonic()
        fut: asyncio.Future[float] = asyncio.get_running_loop().create_future()
        self._pending[worker_id] = (fut, from_role)
        c.draining.add(worker_id)
        if from_role == "decode":  # out of the dispatchers' view now, not at the next tick:
            c.broadcast_view()  # a hand-off sent to it is refused and stalls its sender's
        c.workers[worker_id].post(SetRole(role))
        log.info("flip: worker %d %s -> %s: draining", worker_id, from_role, role)
        try:
            switch_s = await asyncio.wait_for(fut, self.timeout_s)
        except BaseException as e:  # a timeout, or the caller cancelled (an HTTP client gone)
            h = c.workers.get(worker_id)
            if h is not None:  # else it would flip later, behind control's back
                h.post(SetRole(role, cancel=True))
            if isinstance(e, TimeoutError):
                log.error("flip: worker %d did not drain within %.0f s; cancelled", worker_id,
                          self.timeout_s)
            raise
        finally:
            self._pending.pop(worker_id, None)
            c.draining.discard(worker_id)
            c.route_parked()  # cancelled: it serves in its old role again (Ready: done there)
        result = FlipResult(worker_id, from_role, role, time.monotonic() - t0, switch_s)
        self.history.append(result)
        c.metrics.observe_flip(from_role, role, total_s=result.total_s, switch_s=switch_s)
        log.warning("flip: worker %d is now %s (%.3f s in all, %.3f s after drain)",
                    worker_id, role, result.total_s, switch_s)
        return result

    def on_ready(self, worker_id: int, switch_s: float) -> None:
        """The worker answered SetRole with Ready in its new role: it serves from now on (the
        requests parked for a worker of its role are routed right after, and may go to it)."""
        pending = self._pending.get(worker_id)
        if pending is not None and not pending[0].done():
            self.cluster.draining.discard(worker_id)
            pending[0].set_result(switch_s)

    def on_worker_exit(self, worker_id: int) -> None:
        """A worker died: a flip of it ends; so does a flip away from its role that would
        leave no worker of that role serving (the other one of it was this one)."""
        c = self.cluster
        for wid, (fut, from_role) in list(self._pending.items()):
            if fut.done():
                continue
            if wid == worker_id:
                fut.set_exception(FlipRefused(f"worker {worker_id} died while flipping"))
            elif not any(x.role == from_role and x.is_ready and w not in c.draining
                         for w, x in c.workers.items() if w not in (wid, worker_id)):
                fut.set_exception(FlipRefused(
                    f"worker {worker_id} died: worker {wid} stays {from_role}, the last one"))

    def on_tick(self) -> None:
        """Monitor tick: let the policy decide an automatic flip."""
        if not self.enabled or not self.cluster.disaggregated:
            return
        c = self.cluster
        reports = [r for w, r in c.reports.items()
                   if w in c.workers and c.workers[w].is_ready and w not in c.draining]
        plan = self.policy.plan(reports, time.monotonic())
        if plan is not None:
            asyncio.get_running_loop().create_task(self._auto(plan))

    async def _auto(self, plan: FlipPlan) -> None:
        try:
            h = self.cluster.workers.get(plan.worker_id)
            if h is None or not h.is_ready or h.role != plan.from_role:
                raise FlipRefused(f"worker {plan.worker_id} is not serving as {plan.from_role}")
            # the other worker of its role may have died since the tick that planned it (the
            # death's on_worker_exit saw no flip pending yet); _run registers it in this turn
            if self._num_serving(plan.from_role) <= 1:
                raise FlipRefused(f"worker {plan.worker_id} is the last {plan.from_role} worker")
            await self._run(plan.worker_id, plan.from_role, plan.to_role)
        except (FlipRefused, TimeoutError) as e:
            log.warning("flip of worker %d abandoned: %s", plan.worker_id, e)
        finally:
            self.policy.on_done(plan, time.monotonic())
