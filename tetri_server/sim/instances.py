"""Simulated instances, the shared part: requests, the worker loop on the virtual clock and the
carrying out of decode plans. The roles are in ``sim/disaggregated.py`` (the glue of
``workers/prefill.py`` and ``workers/decode.py``) and ``sim/coupled.py`` (``CoupledLoop``),
around the SAME policy objects, with a cost model in place of the model runner and a virtual
clock in place of the wall clock.

Every instance runs the worker loop's shape: handle messages, plan a step with the policies,
"execute" it (the step ends ``cost.step_s(...)`` later), update the policies. Messages that
arrive while a step runs wait in the inbox until it ends, as on a real worker, which drains its
inbox between steps; a report due while a step runs is sent when the step ends, before the
inbox is read (``Worker.run``), and says the last prompt stamp handled (``last_add_seq``), so
the global pick keeps counting a prompt still in the inbox. Blocks come from the real
``BlockAllocator``; the simulator does not model extents (a sequence may hold scattered
blocks, as if compaction were free).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import msgspec

from tetri_server.kv.blocks import BlockAllocator, blocks_for
from tetri_server.messages import LoadReport
from tetri_server.policy import DecodeAdmission, DecodeStepPlan
from tetri_server.policy.chunker import reserved_slices
from tetri_server.policy.prefill import ChunkSlice

if TYPE_CHECKING:
    from tetri_server.sim.cluster import Simulation


@dataclass
class SimRequest:
    """One request and what happened to it (times on the virtual clock, seconds)."""

    req_id: int
    prompt_len: int
    output_len: int  # generated exactly (ignore_eos, as the benchmark sends)
    arrival_s: float
    kind: str = ""
    bucket: int = 0  # predicted output-length bucket
    first_token_s: float | None = None
    end_s: float | None = None
    error: str | None = None


@dataclass
class SimSeq:
    """One instance's state of a request. ``num_tokens`` = prompt + generated; the KV of the
    first ``num_computed`` is in ``blocks``."""

    req: SimRequest
    num_tokens: int
    num_computed: int = 0
    blocks: list[int] = field(default_factory=list)


def reserve(alloc: BlockAllocator, seq: SimSeq, num_tokens: int, block_size: int) -> bool:
    """Make ``seq`` hold blocks for ``num_tokens`` tokens (grow in place, else anywhere)."""
    need = blocks_for(num_tokens, block_size) - len(seq.blocks)
    if need <= 0:
        return True
    if need > alloc.num_free:
        return False
    if seq.blocks and alloc.extend(seq.blocks, need):
        return True
    while need > 0:
        num = min(need, alloc.largest_free_run())
        seq.blocks.extend(alloc.allocate(num))
        need -= num
    return True


def release(alloc: BlockAllocator, seq: SimSeq) -> None:
    alloc.free(seq.blocks)
    seq.blocks = []


def slice_list(slices: tuple[ChunkSlice, ...]) -> list[list[int]]:
    """Prompt slices as a decision record lists them: ``[req_id, start, num_tokens]``."""
    return [[p.req_id, p.start, p.num_tokens] for p in slices]


class Instance:
    """The worker loop on the virtual clock."""

    role = ""

    def __init__(self, sim: Simulation, worker_id: int, num_blocks: int) -> None:
        self.sim = sim
        self.cost = sim.cost
        self.worker_id = worker_id
        self.block_size = sim.cfg.block_size
        self.alloc = BlockAllocator(num_blocks)
        self.busy = False
        self.busy_s = 0.0
        self.num_steps = 0
        self.first_start_s = 0.0  # the first step's start and the last one's end (virtual s)
        self.last_end_s = 0.0
        self.inbox: list[tuple[Any, ...]] = []
        self._kick_pending = False
        self._retry_pending = False
        # the last plan ran nothing but preempted or failed requests: progress, and the worker
        # plans again at once (``last_step_ran``), not at its next report
        self.replan = False
        self.last_add_seq = 0  # the highest prompt stamp handled (Worker.last_add_seq)
        self.report_due = False  # a monitor tick passed during the running step
        # decision log hook: gets the records a worker's DecisionLog writes (workers/trace.py)
        self.decisions: Callable[[dict[str, Any]], None] | None = None
        self.num_planned = 0  # DecisionLog.step: counted where the worker role counts it

    def record(self, kind: str, **fields: Any) -> None:
        """One decision record, as ``DecisionLog.record`` writes it (stamped with the step)."""
        if self.decisions is not None:
            self.decisions({"step": self.num_planned, "kind": kind, **fields})

    def deliver(self, msg: tuple[Any, ...]) -> None:
        """A message arrives: handled now when idle (a step starts once the messages of this
        instant are in), else after the running step."""
        if self.busy:
            self.inbox.append(msg)
            return
        self.take(msg)
        self.kick()

    def take(self, msg: tuple[Any, ...]) -> None:
        """``Worker.handle``: a prompt's stamp (``("add", req, stamp)``) counts from here on."""
        if msg[0] == "add" and len(msg) > 2:
            self.last_add_seq = max(self.last_add_seq, msg[2])
        self.handle(msg)

    def report(self) -> LoadReport:
        """``Worker.load_report``: the role's report with the last prompt stamp handled."""
        return msgspec.structs.replace(self.load_report(), last_add_seq=self.last_add_seq)

    def kick(self) -> None:
        if not (self.busy or self._kick_pending):
            self._kick_pending = True
            self.sim.loop.after(0.0, self._start)

    def _start(self) -> None:
        self._kick_pending = False
        if self.busy:
            return
        self.replan = False
        duration_s = self.start_step()
        if duration_s is None and self.replan:
            self.kick()
            return
        if duration_s is None:
            self.sim.check_drained(self)  # a flip's drain may have ended with this message
            # Nothing ran. The worker waits on its inbox until its next report and tries again;
            # a message wakes it sooner.
            if self.has_work() and not self._retry_pending:
                self._retry_pending = True
                interval_s = self.sim.cfg.monitor_interval_ms / 1000.0
                wait_s = interval_s - self.sim.loop.now_s % interval_s
                if wait_s < 1e-6 * interval_s:  # on a report instant (float rounding)
                    wait_s += interval_s
                self.sim.loop.after(wait_s, self._retry)
            return
        self.busy = True
        self.busy_s += duration_s
        if not self.num_steps:
            self.first_start_s = self.sim.loop.now_s
        self.num_steps += 1
        self.last_end_s = self.sim.loop.now_s + duration_s
        self.sim.loop.after(duration_s, self._finish)

    def _retry(self) -> None:
        self._retry_pending = False
        self._start()

    def _finish(self) -> None:
        self.finish_step()
        self.busy = False
        if self.report_due:  # the report the worker could not send during its step
            self.report_due = False
            self.sim.on_report(self.report())
        inbox, self.inbox = self.inbox, []
        for msg in inbox:
            self.take(msg)
        self.kick()

    # the role: overridden
    def handle(self, msg: tuple[Any, ...]) -> None:
        raise ValueError(f"{self.role} instance {self.worker_id}: unexpected message {msg[0]!r}")

    def has_work(self) -> bool:
        raise NotImplementedError

    def is_drained(self) -> bool:
        """Nothing held: the instance may switch role."""
        raise NotImplementedError

    def start_step(self) -> float | None:
        raise NotImplementedError

    def finish_step(self) -> None:
        raise NotImplementedError

    def load_report(self) -> LoadReport:
        raise NotImplementedError


class _Decoding(Instance):
    """Shared by decode and coupled instances: carry out a ``DecodeStepPlan``."""

    admission: DecodeAdmission
    seqs: dict[int, SimSeq]

    def has_work(self) -> bool:
        return bool(self.seqs)

    def is_drained(self) -> bool:
        return not (self.seqs or getattr(self, "pulling", None))

    def decode_items(self, plan: DecodeStepPlan) -> list[tuple[int, int]]:
        """Preempt (drop KV), fail what never fits, reserve the batch; (new, prefix) items."""
        for req_id in plan.preempt.req_ids:
            seq = self.seqs[req_id]
            release(self.alloc, seq)
            seq.num_computed = 0
        for req_id in plan.fail_ids:
            seq = self.seqs.pop(req_id)
            release(self.alloc, seq)
            seq.req.error = "request no longer fits this instance's KV pool"
            self.sim.finished(seq.req)
        items = []
        for req_id in plan.run_ids:
            seq = self.seqs[req_id]
            if not reserve(self.alloc, seq, seq.num_tokens, self.block_size):
                raise RuntimeError(f"admission planned request {req_id} but its blocks do not "
                                   "fit: allocator and policy disagree")
            # 1, or a slice of the context after a preemption (``DecodeStepPlan.recompute``)
            items.append((plan.row_tokens(req_id), seq.num_computed))
        return items

    def num_sampled(self, plan: DecodeStepPlan) -> int:
        """Rows of ``plan`` that sample (all but recomputes with more tokens to go)."""
        return sum(self.seqs[r].num_computed + plan.row_tokens(r) == self.seqs[r].num_tokens
                   for r in plan.run_ids)

    def seq(self, req_id: int) -> SimSeq:
        """This instance's state of a request it prefills or decodes."""
        return self.seqs[req_id]

    def reserve_slices(self, planned: tuple[ChunkSlice, ...],
                       items: list[tuple[int, int]]) -> tuple[ChunkSlice, ...]:
        """Blocks for each prompt a slice starts, as the worker's (``reserved_slices``); the
        kept slices' (new, prefix) items are appended to ``items``."""
        def fits(piece: ChunkSlice) -> bool:
            seq = self.seq(piece.req_id)
            return reserve(self.alloc, seq, seq.req.prompt_len, self.block_size)

        kept = reserved_slices(planned, fits)
        items.extend((piece.num_tokens, piece.start) for piece in kept)
        return kept

    def prompts_done(self, req_ids: list[int], *, predicted: bool) -> None:
        """Each completed prompt's first token: finished there, or it joins the admission
        (with its predicted bucket when this instance schedules by prediction)."""
        now = self.sim.loop.now_s
        for req_id in req_ids:
            seq = self.seqs[req_id]
            seq.num_computed = seq.num_tokens
            seq.num_tokens += 1  # the first output token, streamed from here
            seq.req.first_token_s = now
            if seq.req.output_len <= 1:
                release(self.alloc, seq)
                del self.seqs[req_id]
                seq.req.end_s = now
                self.sim.finished(seq.req)
            else:
                self.admission.add(req_id, seq.req.prompt_len, seq.num_tokens,
                                   seq.req.bucket if predicted else 0, seq.req.output_len)

    def decode_done(self, plan: DecodeStepPlan) -> None:
        """Every request of the batch gained one token (but a recompute with more tokens to
        go); the finished ones leave."""
        now = self.sim.loop.now_s
        finished: set[int] = set()
        for req_id in plan.run_ids:
            seq = self.seqs[req_id]
            seq.num_computed += plan.row_tokens(req_id)
            if seq.num_computed < seq.num_tokens:
                continue
            seq.num_tokens += 1
            if seq.num_tokens - seq.req.prompt_len >= seq.req.output_len:
                finished.add(req_id)
                release(self.alloc, seq)
                del self.seqs[req_id]
                seq.req.end_s = now
                self.sim.finished(seq.req)
        self.admission.on_done(plan, finished)
