"""Level-1 scheduling on a prefill worker: which decode worker receives a prefilled request.

Contract: the worker feeds every decode view (a ``views.DecodeSnapshot``: the monitor's
``DecodeView`` broadcast) to ``on_view``; when a request's prompt is done it calls
``plan(req_id, num_prompt_tokens, bucket, max_tokens, min_output)`` (``min_output``: the output
tokens it holds already, a kept request handed back). A ``DispatchPlan`` names the decode
worker;
``None`` means no decode worker has room: hold the request (its KV stays in this pool) and ask
again after the next view. ``on_rejected(plan)`` undoes a plan whose hand-off the decode worker
refused. The view is up to one broadcast interval stale, so every dispatcher counts its own
dispatches since the view against it, each until a view has a report of its decode worker
that had read it (``handoffs_read`` reaches the plan's ``seq``; where not tracked, a newer
report: ``report_seq``) or a restart of that worker since (``incarnation``). Draining
(flipping) decode workers must be left out of the view by the cluster monitor.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Protocol

from tetri_server.policy.chunker import num_blocks_for
from tetri_server.policy.decode_state import is_heavy, raised_estimate
from tetri_server.policy.views import DecodeInstance, DecodeInstanceLoad, DecodeSnapshot

NO_CAP = 1 << 62  # output tokens: a request without max_tokens


@dataclass(frozen=True)
class DispatchPlan:
    """Send ``req_id`` to ``decode_worker``. ``num_blocks``: its predicted footprint (prompt +
    the output the decode worker will first reserve for it, ``predicted_output``; round-robin:
    its bucket's lower end), counted against that worker until a view has a newer report of
    it."""

    req_id: int
    decode_worker: int
    num_blocks: int
    heavy: bool
    seq: int = 0  # this dispatcher's plans so far, this one included (Handoff.dispatch_seq)
    incarnation: int = 0  # of the decode worker's view entry it was planned against


class Dispatcher(Protocol):
    def on_view(self, view: DecodeSnapshot) -> bool: ...

    def plan(self, req_id: int, num_prompt_tokens: int, bucket: int,
             max_tokens: int | None = None, min_output: int = 1) -> DispatchPlan | None: ...

    def on_rejected(self, plan: DispatchPlan) -> None: ...


class _ViewTracker:
    """The last view plus this worker's own dispatches since it."""

    def __init__(self, *, block_size: int, granularity: int, heavy_threshold: int,
                 source: int = -1, first_seq: int = 1) -> None:
        self.block_size = block_size
        self.granularity = granularity
        self.heavy_threshold = heavy_threshold
        self.source = source  # the prefill worker's id: the key of ``handoffs_read``
        self.view: DecodeSnapshot | None = None
        self._since_view: dict[int, DispatchPlan] = {}  # req_id -> plan
        # the first plan's seq, less one: above every seq an earlier dispatcher of this
        # source sent (a restart, a flip), whose last read the decode workers still report
        self._num_plans = first_seq - 1

    def on_view(self, view: DecodeSnapshot) -> bool:
        """Adopt ``view`` if newer than the current one; returns whether it was adopted. An
        own dispatch is forgotten only when the view's report of its decode worker counts it:
        the report says it had read the hand-off (``handoffs_read``: a report built during the
        step in which the hand-off arrived does not); or, where that is not tracked, the
        report is newer (its ``report_seq`` moved: one re-sent from the same reports, or newer
        only by another worker's report, does not count it yet; where the view tracks no
        report (-1), a new ``generation`` forgets them all). It is forgotten too when that
        worker left the view or restarted (``incarnation``)."""
        if self.view is not None and view.seq <= self.view.seq:
            return False
        old, self.view = self.view, view
        if old is None:
            self._since_view.clear()
            return True
        before = {d.worker_id: d.report_seq for d in old.decodes}
        entries = {d.worker_id: d for d in view.decodes}
        newer_reports = view.generation < 0 or view.generation != old.generation

        def counted(plan: DispatchPlan) -> bool:  # the view's entry of its worker counts it
            entry = entries.get(plan.decode_worker)
            if entry is None or entry.incarnation != plan.incarnation:
                return True  # gone from the view, or restarted: nothing holds it there
            if entry.handoffs_read is not None:
                return entry.handoffs_read.get(self.source, 0) >= plan.seq
            seq = entry.report_seq
            if seq >= 0:
                return seq != before.get(plan.decode_worker)
            return newer_reports

        self._since_view = {r: p for r, p in self._since_view.items() if not counted(p)}
        return True

    def on_rejected(self, plan: DispatchPlan) -> None:
        """Undo ``plan``: refused, or its request aborted (its hand-off may never be read)."""
        self._since_view.pop(plan.req_id, None)

    def instances(self) -> list[DecodeInstance]:
        """The view with own dispatches applied, by worker id."""
        if self.view is None:
            return []
        out = []
        for inst in sorted(self.view.decodes, key=lambda d: d.worker_id):
            mine = [p for p in self._since_view.values() if p.decode_worker == inst.worker_id]
            num_heavy = sum(p.heavy for p in mine)
            out.append(
                DecodeInstance(
                    worker_id=inst.worker_id,
                    num_free_blocks=inst.num_free_blocks - sum(p.num_blocks for p in mine),
                    num_total_blocks=inst.num_total_blocks,
                    num_heavy=inst.num_heavy + num_heavy,
                    num_light=inst.num_light + len(mine) - num_heavy,
                    predicted_demand_blocks=inst.predicted_demand_blocks,
                    num_queued_prompt_tokens=inst.num_queued_prompt_tokens,
                    step_s=inst.step_s,
                    fastest_step_s=inst.fastest_step_s,
                    report_seq=inst.report_seq,
                    incarnation=inst.incarnation,
                )
            )
        return out

    def lower_end(self, bucket: int, max_tokens: int | None) -> int:
        """The bucket's lower end, at most ``max_tokens`` (``None``: no cap)."""
        return min(bucket * self.granularity, _cap(max_tokens))

    def is_heavy(self, bucket: int, max_tokens: int | None, min_output: int = 1) -> bool:
        """Heavy as the decode worker counts it (``decode_state.is_heavy``)."""
        return is_heavy(bucket, self.granularity, _cap(max_tokens), min_output,
                        self.heavy_threshold)

    def predicted_output(self, bucket: int, max_tokens: int | None, min_output: int = 1) -> int:
        """The output the decode worker's admission first reserves for a request
        (``decode_state.raised_estimate`` as ``DecodeAdmission.add`` runs it): its bucket's
        lower end raised while the ``min_output`` tokens it holds already reach it (bucket 0:
        the next one's lower end; counting one token instead under-counted every short
        request until the next view)."""
        _, est = raised_estimate(bucket, self.lower_end(bucket, max_tokens), min_output,
                                 self.granularity, _cap(max_tokens))
        return max(est, min_output)

    def make_plan(self, req_id: int, inst: DecodeInstance, num_prompt: int, output: int,
                  heavy: bool) -> DispatchPlan:
        """Record a dispatch to ``inst`` of ``num_prompt`` + ``output``
        (``predicted_output``) tokens."""
        num_blocks = num_blocks_for(num_prompt + max(output, 1), self.block_size)
        self._num_plans += 1
        plan = DispatchPlan(req_id, inst.worker_id, num_blocks, heavy, self._num_plans,
                            inst.incarnation)
        self._since_view[req_id] = plan
        return plan


class TetriDispatcher(_ViewTracker):
    """TetriInfer's dispatcher: α = decode workers whose free blocks, less what their running
    requests are still predicted to take and its queued prompts need, hold this request's
    prompt + predicted output (``predicted_output``: as the decode worker will reserve it;
    capped at the worker's pool so an over-long prediction waits for an empty worker rather
    than forever). Two of α are drawn with ``rng``
    (power of two choices); the one with the lower heavy share after adding the request wins
    (ties: fewer requests, more room, lower id). Heavy: predicted output above
    ``heavy_threshold`` tokens."""

    def __init__(
        self,
        rng: random.Random,
        *,
        block_size: int,
        granularity: int = 200,
        heavy_threshold: int = 128,
        source: int = -1,
        first_seq: int = 1,
    ) -> None:
        super().__init__(
            block_size=block_size, granularity=granularity, heavy_threshold=heavy_threshold,
            source=source, first_seq=first_seq,
        )
        self.rng = rng

    def plan(self, req_id: int, num_prompt_tokens: int, bucket: int,
             max_tokens: int | None = None, min_output: int = 1) -> DispatchPlan | None:
        output = self.predicted_output(bucket, max_tokens, min_output)
        need = num_blocks_for(num_prompt_tokens + output, self.block_size)
        heavy = self.is_heavy(bucket, max_tokens, min_output)
        alpha = [d for d in self.instances()
                 if _room(d, self.block_size) >= min(need, d.num_total_blocks)]
        if not alpha:
            return None
        pair = alpha if len(alpha) <= 2 else self.rng.sample(alpha, 2)

        def key(d: DecodeInstance) -> tuple[float, int, int, int]:
            num_heavy = d.num_heavy + heavy
            num_all = d.num_heavy + d.num_light + 1
            return (num_heavy / num_all, num_all, -_room(d, self.block_size), d.worker_id)

        return self.make_plan(req_id, min(pair, key=key), num_prompt_tokens, output, heavy)


class RoundRobinDispatcher(_ViewTracker):
    """Baseline: decode workers in turn by id, skipping those without free blocks for the
    prompt and its first token beside the prompts routed to them (capped at the pool, as
    ``TetriDispatcher``'s: one that can never fit goes to an empty worker and fails there).
    Ignores reservations; its own dispatches since a worker's report count their bucket's
    lower end (at least what they hold)."""

    def __init__(self, *, block_size: int, granularity: int = 200, heavy_threshold: int = 128,
                 source: int = -1, first_seq: int = 1):
        super().__init__(
            block_size=block_size, granularity=granularity, heavy_threshold=heavy_threshold,
            source=source, first_seq=first_seq,
        )
        self._last_worker = -1

    def plan(self, req_id: int, num_prompt_tokens: int, bucket: int,
             max_tokens: int | None = None, min_output: int = 1) -> DispatchPlan | None:
        need = num_blocks_for(num_prompt_tokens + max(min_output, 1), self.block_size)
        fits = [d for d in self.instances()
                if _beside_prompts(d, self.block_size) >= min(need, d.num_total_blocks)]
        if not fits:
            return None
        later = [d for d in fits if d.worker_id > self._last_worker]
        chosen = later[0] if later else fits[0]
        self._last_worker = chosen.worker_id
        return self.make_plan(req_id, chosen, num_prompt_tokens,
                              max(self.lower_end(bucket, max_tokens), min_output),
                              self.is_heavy(bucket, max_tokens, min_output))


def _cap(max_tokens: int | None) -> int:
    """``max_tokens``, or no cap (``None``)."""
    return NO_CAP if max_tokens is None else max_tokens


def _room(d: DecodeInstanceLoad, block_size: int) -> int:
    """Free blocks not spoken for by the predictions of the worker's known requests, nor by
    the prompts routed to it (elastic: the decode worker refuses a hand-off that would take
    the first one's blocks; a started prompt's are counted again, erring on the safe side)."""
    return _beside_prompts(d, block_size) - d.predicted_demand_blocks


def _beside_prompts(d: DecodeInstanceLoad, block_size: int) -> int:
    """Free blocks less those of the prompts routed to the worker."""
    return d.num_free_blocks - num_blocks_for(d.num_queued_prompt_tokens, block_size)
