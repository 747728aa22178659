"""Decode admission on a decode (or coupled) worker: TetriInfer's level-2 scheduler.

Lifecycle: ``add`` a request once its prompt KV is in this worker's pool (pulled after a
hand-off, or prefilled locally in coupled mode); every step ``plan = admission.plan(free)``,
the runtime executes it, then ``admission.on_done(plan, finished)``. ``plan`` is pure.

Block invariant (the runtime keeps it): a request holds exactly ``ceil(kv_tokens / block_size)``
blocks, where ``kv_tokens`` are the tokens whose KV is computed. ``num_tokens`` counts prompt +
generated tokens; the last generated token's KV is computed by the next step, so one step of a
request needs ``blocks(num_tokens)`` blocks in all. A preempted request holds nothing and is
recomputed (prefill over all its ``num_tokens``) when it is admitted again: it takes the blocks
of its whole context at once, and with ``recompute_chunk`` (or a step's ``recompute_room``) its
tokens are computed over several steps, at most that many a step across the batch
(``DecodeStepPlan.recompute``), so the other rows' inter-token gap does not take a whole
prefill; it samples its next token in the step that computes its last one. A request part-way
through its recompute is preempted only when no other running request is left.

Estimates (``tail``): without one (``decode.estimate = "bucket"``) a request's predicted output
is the lower end of its bucket (``bucket * granularity``, capped at ``max_tokens``), as in the
paper. The paper leaves mispredictions open; here a request that reaches its estimate and keeps
going gets the estimate raised one bucket at a time, and when blocks run out anyway the KV of
requests waiting for admission is dropped instead where it covers the shortfall (the newest
first), else the most recently admitted request is preempted. With a ``LengthTail``
(``"refined"``) the estimate is the expected output given the bucket and the tokens generated
so far, updated every step
(``policy/remaining.py``), and the preempted request is the one expected to run longest (the
newest on ties): it would hold and grow its blocks longest, while one about to finish frees
its own soon.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable
from dataclasses import dataclass, replace
from typing import Literal

from tetri_server.policy.chunker import num_blocks_for
from tetri_server.policy.decode_state import DecodeSeq, fits_reserved
from tetri_server.policy.remaining import LengthTail

DecodePolicyName = Literal["greedy", "reserve-static", "reserve-dynamic"]
DECODE_POLICIES: tuple[DecodePolicyName, ...] = ("greedy", "reserve-static", "reserve-dynamic")
EstimateName = Literal["bucket", "refined"]
ESTIMATES: tuple[EstimateName, ...] = ("bucket", "refined")


@dataclass(frozen=True)
class PreemptPlan:
    """Requests to evict (running ones the newest admission first, or waiting ones the newest
    first): the runtime frees their KV blocks and keeps their tokens; running ones return to
    the head of the waiting queue, waiting ones keep their place; all are recomputed (their
    prompt and every token generated) when admitted."""

    req_ids: tuple[int, ...] = ()


@dataclass(frozen=True)
class AdmitPlan:
    """Waiting requests that join the batch this step, in order. ``recompute_ids`` (a subset)
    lost their KV to a preemption: the runtime takes blocks for their whole context and
    computes the tokens ``DecodeStepPlan.recompute`` gives them this step."""

    req_ids: tuple[int, ...] = ()
    recompute_ids: tuple[int, ...] = ()


@dataclass(frozen=True)
class DecodeStepPlan:
    """One decode step. ``run_ids``: the batch (surviving running requests, then admitted
    ones); each computes one token and samples the next, but for the rows in ``recompute``:
    (request, tokens, tokens it lacks) of those recomputing their KV after a preemption, which
    compute that many tokens and sample only if those are all they lacked. ``fail_ids``: waiting
    requests whose context can never fit this pool; the runtime reports them failed and frees
    their blocks."""

    preempt: PreemptPlan
    admit: AdmitPlan
    run_ids: tuple[int, ...]
    fail_ids: tuple[int, ...] = ()
    recompute: tuple[tuple[int, int, int], ...] = ()

    def row_tokens(self, req_id: int) -> int:
        """Tokens the row of ``req_id`` computes this step."""
        return next((n for r, n, _ in self.recompute if r == req_id), 1)

    def lacking(self, req_id: int) -> int:
        """Tokens whose KV the row of ``req_id`` lacks before this step (1 but in a
        recompute): the runtime's sequence must lack as many."""
        return next((k for r, _, k in self.recompute if r == req_id), 1)

    @property
    def recompute_tokens(self) -> list[list[int]]:
        """[request, tokens] of each recomputing row (the decision logs)."""
        return [[r, n] for r, n, _ in self.recompute]

    @property
    def recompute_log(self) -> dict[str, list[list[int]]]:
        """The decision logs' ``recompute_tokens`` field, or nothing without a recompute."""
        return {"recompute_tokens": self.recompute_tokens} if self.recompute else {}

    @property
    def num_recompute_tokens(self) -> int:
        """Tokens the recomputing rows compute beyond one a row: what they take of a step's
        prompt budget."""
        return sum(n - 1 for _, n, _ in self.recompute)

    @property
    def num_tokens(self) -> int:
        """Tokens the batch's rows compute this step."""
        return len(self.run_ids) + self.num_recompute_tokens

    def without(self, req_ids: Collection[int]) -> DecodeStepPlan:
        """The plan with ``req_ids`` neither run nor admitted this step (a running one keeps
        its tokens, a waiting one its place; their preemptions still happen)."""
        if not req_ids:
            return self
        return replace(self, run_ids=tuple(r for r in self.run_ids if r not in req_ids),
                       admit=AdmitPlan(
                           tuple(r for r in self.admit.req_ids if r not in req_ids),
                           tuple(r for r in self.admit.recompute_ids if r not in req_ids)),
                       recompute=tuple(p for p in self.recompute if p[0] not in req_ids))


@dataclass(frozen=True)
class DecodeLoad:
    """What the decode side reports to the cluster monitor (``LoadReport`` fields)."""

    num_waiting: int
    num_running: int
    num_heavy: int
    num_light: int
    predicted_demand_blocks: int  # blocks still to be taken by known requests, by estimate
    num_preemptions: int  # cumulative: running requests whose KV was dropped
    num_kv_drops: int = 0  # cumulative: waiting requests whose KV was dropped (not running)


class DecodeAdmission:
    """Continuous-batching admission by ``policy``:

    - ``greedy`` (vLLM): admit while the next step's blocks fit (above a small watermark).
    - ``reserve-static``: also require prompt + predicted output to fit now, counting what
      the running requests still reserve by their own estimates.
    - ``reserve-dynamic``: like reserve-static, but also admit when it will fit once the running
      request with the shortest predicted remaining output finishes.

    Reserve policies always admit into an empty batch, so a request predicted larger than the
    pool still runs (and is preempted or finishes).

    ``recompute_chunk``: the most tokens the batch's recomputing rows compute in one step (the
    oldest admission first; a running one computes at least one, and a waiting request that must
    recompute does not start in a step with none left); 0: a whole context in one step.
    ``plan``'s ``recompute_room`` lowers it for one step (the room a step's token cap leaves).
    ``waiting_kv_first``: the KV of waiting requests goes before a running request is
    preempted, where it covers the shortfall (off on a prefill worker, whose waiting kept
    requests go to a decode worker with their KV instead).
    """

    def __init__(
        self,
        policy: DecodePolicyName,
        *,
        block_size: int,
        num_total_blocks: int,
        granularity: int = 200,
        max_batch: int = 256,
        heavy_threshold: int = 128,
        watermark: float = 0.01,
        tail: LengthTail | None = None,
        recompute_chunk: int = 0,
        waiting_kv_first: bool = True,
    ) -> None:
        if policy not in DECODE_POLICIES:
            raise ValueError(f"decode policy must be one of {DECODE_POLICIES}, got {policy!r}")
        if min(block_size, num_total_blocks, granularity, max_batch) < 1:
            raise ValueError("block_size, num_total_blocks, granularity, max_batch must be >= 1")
        if recompute_chunk < 0:
            raise ValueError(f"recompute_chunk must be >= 0, got {recompute_chunk}")
        self.policy: DecodePolicyName = policy
        self.block_size = block_size
        self.num_total_blocks = num_total_blocks
        self.granularity = granularity
        self.max_batch = max_batch
        self.heavy_threshold = heavy_threshold
        self.num_watermark_blocks = int(watermark * num_total_blocks)
        self.tail = tail  # None: the bucket estimate; else the refined one
        self.recompute_chunk = recompute_chunk
        self.waiting_kv_first = waiting_kv_first
        self._waiting: list[DecodeSeq] = []  # FCFS; preempted requests go back to the head
        self._running: dict[int, DecodeSeq] = {}  # insertion order == admission order
        self._num_preemptions = 0
        self._num_kv_drops = 0

    # ------------------------------------------------------------------ requests in and out

    def add(
        self, req_id: int, num_prompt_tokens: int, num_tokens: int, bucket: int, max_tokens: int
    ) -> None:
        """A request whose prompt KV is in the pool waits for admission. ``num_tokens`` =
        prompt + tokens generated so far (>= prompt + 1: prefill sampled the first one)."""
        if req_id in self:
            raise ValueError(f"request {req_id} is already known")
        self._waiting.append(self._new_seq(req_id, num_prompt_tokens, num_tokens, bucket,
                                           max_tokens))

    def _new_seq(self, req_id: int, num_prompt_tokens: int, num_tokens: int, bucket: int,
                 max_tokens: int) -> DecodeSeq:
        if num_tokens <= num_prompt_tokens:
            raise ValueError(f"request {req_id}: num_tokens must include the first output token")
        seq = DecodeSeq(
            req_id,
            num_prompt_tokens,
            num_tokens,
            predicted_bucket=bucket,
            max_tokens=max_tokens,
            bucket=bucket,
            est_output_tokens=min(bucket * self.granularity, max_tokens),
            num_held_blocks=num_blocks_for(num_tokens - 1, self.block_size),
            num_kv_tokens=num_tokens - 1,
        )
        if self.tail is not None:
            seq.refine_estimate(self.tail, self.granularity)
        else:  # it has generated its first token(s): bucket 0's estimate (0) is already passed
            seq.raise_estimate(self.granularity)
        return seq

    def remove(self, req_id: int) -> bool:
        """Forget a request (abort or finish outside a step). Its blocks are the runtime's."""
        if self._running.pop(req_id, None) is not None:
            return True
        for i, seq in enumerate(self._waiting):
            if seq.req_id == req_id:
                del self._waiting[i]
                return True
        return False

    def __len__(self) -> int:
        """Requests known here: running and waiting for admission."""
        return len(self._running) + len(self._waiting)

    def __contains__(self, req_id: object) -> bool:
        return req_id in self._running or any(s.req_id == req_id for s in self._waiting)

    @property
    def running_ids(self) -> tuple[int, ...]:
        return tuple(self._running)

    def predicted_len(self, req_id: int) -> int:
        """Current output-length estimate of a known request (tokens)."""
        for seq in (*self._running.values(), *self._waiting):
            if seq.req_id == req_id:
                return seq.est_output_tokens
        raise KeyError(req_id)

    # ------------------------------------------------------------------ the step

    def plan(self, num_free_blocks: int, *, recompute_room: int | None = None) -> DecodeStepPlan:
        """Decide this step's preemptions and admissions. Pure. ``recompute_room``: at most this
        many recompute tokens this step (at least 1), below ``recompute_chunk``."""
        running = list(self._running.values())
        step_need = self._step_need(running)
        free = num_free_blocks
        evicted = self._evict_for_batch(step_need, free)
        free += sum(s.num_held_blocks for s in self._waiting if s.req_id in evicted)
        victims: list[int] = []
        while running and step_need > free:
            victim = running.pop(self._victim_index(running))
            step_need -= victim.num_step_blocks(self.block_size)
            free += victim.num_held_blocks
            victims.append(victim.req_id)
        free -= step_need
        head_evicted = self._evict_waiting(running, victims, free)
        free += sum(s.num_held_blocks for s in self._waiting if s.req_id in head_evicted)
        evicted += head_evicted
        limit = self.recompute_chunk or None
        if recompute_room is not None:
            limit = max(1, recompute_room if limit is None else min(limit, recompute_room))
        chunk = _RecomputeChunk(limit)
        for seq in running:
            chunk.take(seq.req_id, seq.num_uncomputed, running=True)
        admitted: list[DecodeSeq] = []
        failed: list[int] = []
        for seq in self._waiting if not victims else ():
            if num_blocks_for(seq.num_tokens, self.block_size) > self.num_total_blocks:
                failed.append(seq.req_id)
                continue
            if len(running) + len(admitted) >= self.max_batch:
                break
            step = (num_blocks_for(seq.num_tokens, self.block_size) if seq.req_id in evicted
                    else seq.num_step_blocks(self.block_size))
            # The watermark keeps room for a running batch's growth; an empty batch has none
            # to keep, so a request that fits the free blocks always starts (no stall).
            watermark = self.num_watermark_blocks if running or admitted else 0
            if step > free - watermark:
                break
            batch = running + admitted
            if self.policy != "greedy" and batch:
                dynamic = self.policy == "reserve-dynamic"
                if not fits_reserved(seq, batch, num_free_blocks, self.block_size, dynamic):
                    break
            if not chunk.take(seq.req_id, seq.num_tokens if seq.req_id in evicted
                              else seq.num_uncomputed, running=False):
                break
            admitted.append(seq)
            free -= step
        return DecodeStepPlan(
            preempt=PreemptPlan(tuple(victims) + tuple(evicted)),
            admit=AdmitPlan(
                tuple(s.req_id for s in admitted),
                tuple(s.req_id for s in admitted
                      if s.num_held_blocks == 0 or s.req_id in evicted),
            ),
            run_ids=tuple(s.req_id for s in running + admitted),
            fail_ids=tuple(failed),
            recompute=tuple(chunk.rows),
        )

    def _victim_index(self, running: list[DecodeSeq]) -> int:
        """The request to preempt: the most recently admitted, or with a tail the one expected
        to run longest (the most recent among equals); one part-way through its recompute
        (which would lose that work and gain no token) only when none other is left."""
        whole = [i for i, s in enumerate(running) if s.num_uncomputed <= 1]
        candidates = whole or list(range(len(running)))
        if self.tail is None:
            return candidates[-1]
        return max(candidates, key=lambda i: (running[i].num_remaining_tokens, i))

    def free_after(self, plan: DecodeStepPlan, num_free_blocks: int) -> int:
        """Free blocks once ``plan`` is carried out: preempted requests give back what they
        hold, the batch takes what its step needs (a recomputed request its whole context)."""
        seqs = {s.req_id: s for s in (*self._running.values(), *self._waiting)}
        dropped = set(plan.preempt.req_ids) | set(plan.fail_ids)
        free = num_free_blocks + sum(seqs[r].num_held_blocks for r in dropped if r in seqs)
        for r in plan.run_ids:
            held = 0 if r in dropped else seqs[r].num_held_blocks
            free -= num_blocks_for(seqs[r].num_tokens, self.block_size) - held
        return free

    def has_room_for(self, num_blocks: int, num_free_blocks: int) -> bool:
        """Whether a request arriving with ``num_blocks`` of KV (a hand-off) may take them: the
        blocks the running batch's next step needs and those the waiting head needs to start
        (``head_need``) stay free. Otherwise the newcomer would be the first waiting request
        whose KV goes when the batch grows (``_evict_for_batch``), its transfer wasted."""
        return num_free_blocks - num_blocks >= self.next_step_need() + self.head_need()

    def next_step_need(self) -> int:
        """New blocks the running batch's next step needs."""
        return self._step_need(self._running.values())

    def _step_need(self, running: Iterable[DecodeSeq]) -> int:
        """New blocks the next step of ``running`` needs."""
        return sum(s.num_step_blocks(self.block_size) for s in running)

    def head_need(self, plan: DecodeStepPlan | None = None) -> int:
        """Blocks the request at the head of the waiting queue after ``plan`` (None: with no
        plan yet) needs to start: a request preempted by the plan (the oldest admitted), else
        the first waiting one the plan does not start. Prompts planned beside the batch leave
        them (``prompt_room``): else a preempted request waits behind new prompts that took its
        blocks, and they hold their KV idle behind it while the batch shrinks (vLLM, too,
        starts no new prompt ahead of a preempted request)."""
        bs = self.block_size
        dropped = set() if plan is None else set(plan.preempt.req_ids)
        victims = [s for r, s in self._running.items() if r in dropped]
        if victims:
            return num_blocks_for(victims[0].num_tokens, bs)
        started = set() if plan is None else set(plan.admit.req_ids) | set(plan.fail_ids)
        for seq in self._waiting:
            if seq.req_id not in started:
                return (num_blocks_for(seq.num_tokens, bs) if seq.req_id in dropped
                        else seq.num_step_blocks(bs))
        return 0

    def prompt_room(self, plan: DecodeStepPlan | None, num_free_blocks: int, *,
                    hold_head: bool = True) -> int:
        """Free blocks for prompt slices beside ``plan`` (None: a step without this admission's
        rows): what ``free_after`` leaves, less the waiting head's ``head_need`` if
        ``hold_head``."""
        free = num_free_blocks if plan is None else self.free_after(plan, num_free_blocks)
        return max(0, free - (self.head_need(plan) if hold_head else 0))

    def _evict_for_batch(self, step_need: int, free: int) -> list[int]:
        """When the running batch's next step needs more blocks than are free and the KV of
        requests waiting for admission covers the shortfall, that KV goes instead of a running
        request, the newest first: a running request's stream would stall, and vLLM's waiting
        requests hold no KV at all. When it does not cover it, running requests are preempted
        as before and the waiting keep theirs. Off with ``waiting_kv_first=False``."""
        if not self.waiting_kv_first or step_need <= free or (
                free + sum(s.num_held_blocks for s in self._waiting) < step_need):
            return []
        return _drop_newest_kv(self._waiting, step_need, free)

    def _evict_waiting(self, running: list[DecodeSeq], victims: list[int],
                       free: int) -> list[int]:
        """With nothing running, a head of the queue that does not fit would wait forever
        when the blocks it needs are held by requests waiting behind it (their KV is in the
        pool): drop theirs, newest first, until the head fits (they are recomputed later)."""
        if running or victims or not self._waiting:
            return []
        head = self._waiting[0]
        need = head.num_step_blocks(self.block_size)
        if need <= free or num_blocks_for(head.num_tokens, self.block_size) > self.num_total_blocks:
            return []
        return _drop_newest_kv(self._waiting[1:], need, free)

    def on_done(self, plan: DecodeStepPlan, finished: Collection[int]) -> None:
        """The step ran. ``finished``: ids that stopped (stop token, length, abort); every other
        id in ``plan.run_ids`` gained one token, but a recompute that has more tokens to
        compute. Ids removed meanwhile are ignored."""
        for req_id in plan.fail_ids:
            self.remove(req_id)
        waiting = {s.req_id: s for s in self._waiting}
        preempted = set(plan.preempt.req_ids)
        victims = [s for r, s in self._running.items() if r in preempted]  # admission order
        for victim in victims:
            del self._running[victim.req_id]
            victim.num_held_blocks = victim.num_kv_tokens = 0
        self._waiting[:0] = victims  # back at the head, the oldest admission first
        self._num_preemptions += len(victims)
        for req_id in plan.preempt.req_ids:
            if req_id in waiting:  # evicted while waiting: keeps its place, loses its KV
                waiting[req_id].num_held_blocks = waiting[req_id].num_kv_tokens = 0
                self._num_kv_drops += 1
        waiting = {s.req_id: s for s in self._waiting}
        for req_id in plan.admit.req_ids:
            seq = waiting.get(req_id)
            if seq is not None:
                self._waiting.remove(seq)
                self._running[req_id] = seq
        for req_id in plan.run_ids:
            seq = self._running.get(req_id)
            if seq is None:
                continue
            if req_id in finished:
                del self._running[req_id]
                continue
            seq.num_held_blocks = num_blocks_for(seq.num_tokens, self.block_size)
            seq.num_kv_tokens += plan.row_tokens(req_id)
            if seq.num_kv_tokens < seq.num_tokens:  # a recompute with more to go: no token
                continue
            seq.num_kv_tokens = seq.num_tokens
            seq.num_tokens += 1
            if self.tail is None:
                seq.raise_estimate(self.granularity)
            else:
                seq.refine_estimate(self.tail, self.granularity)

    def load(self, arriving: Iterable[tuple[int, int, int, int, int]] = ()) -> DecodeLoad:
        """Counts for the load report. Heavy: predicted (lower end) or generated output above
        ``heavy_threshold`` tokens. ``arriving``: ``add``'s arguments of requests counted as
        waiting, not added yet (the simulator's hand-offs whose KV is still on the link)."""
        new = [self._new_seq(*a) for a in arriving]
        seqs = [*self._running.values(), *self._waiting, *new]
        num_heavy = sum(s.is_heavy(self.granularity, self.heavy_threshold) for s in seqs)
        demand = sum(s.num_reserved_blocks(self.block_size) for s in seqs)
        return DecodeLoad(
            num_waiting=len(self._waiting) + len(new),
            num_running=len(self._running),
            num_heavy=num_heavy,
            num_light=len(seqs) - num_heavy,
            predicted_demand_blocks=demand,
            num_preemptions=self._num_preemptions,
            num_kv_drops=self._num_kv_drops,
        )


def _drop_newest_kv(waiting: list[DecodeSeq], need: int, free: int) -> list[int]:
    """The waiting requests whose KV to drop, the newest first, until ``need`` blocks fit in
    ``free`` (or none holding any is left)."""
    dropped = []
    for seq in reversed(waiting):
        if need <= free:
            break
        if seq.num_held_blocks:
            dropped.append(seq.req_id)
            free += seq.num_held_blocks
    return dropped


class _RecomputeChunk:
    """The tokens a step's recomputing rows take, in batch order, within ``limit`` (None: no
    limit)."""

    def __init__(self, limit: int | None) -> None:
        self.num_left = limit
        self.rows: list[tuple[int, int, int]] = []  # DecodeStepPlan.recompute

    def take(self, req_id: int, num_uncomputed: int, *, running: bool) -> bool:
        """Whether the row runs this step: a decode row (one token) always does; a recompute
        takes what is left of the limit, a running one at least one token (so at most one
        running request is ever part-way through), a waiting one none: it does not start."""
        if num_uncomputed <= 1:
            return True
        n = num_uncomputed if self.num_left is None else min(num_uncomputed, self.num_left)
        if n < 1:
            if not running:
                return False
            n = 1
        if self.num_left is not None:
            self.num_left = max(0, self.num_left - n)
        self.rows.append((req_id, n, num_uncomputed))
        return True
