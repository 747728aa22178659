"""Simulated instances: the glue of ``workers/prefill.py`` and ``workers/decode.py`` (and, in
``sim/coupled.py``, of ``workers/coupled.py``'s ``CoupledLoop``) around the SAME policy
objects, with a cost model in place of the model runner and a virtual clock in place of the
wall clock.

Every instance runs the worker loop's shape: handle messages, plan a step with the policies,
"execute" it (the step ends ``cost.step_s(...)`` later), update the policies. Messages that
arrive while a step runs wait in the inbox until it ends, as on a real worker, which drains its
inbox between steps. Blocks come from the real ``BlockAllocator``; the simulator does not model
extents (a sequence may hold scattered blocks, as if compaction were free).
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from tetri_server.kv.blocks import BlockAllocator, blocks_for
from tetri_server.messages import LoadReport
from tetri_server.policy import (
    Chunker,
    ChunkPlan,
    DecodeAdmission,
    DecodeStepPlan,
    LocalDecode,
    PrefillQueue,
    RoundRobinDispatcher,
    TetriDispatcher,
    coupled_chunked_plan,
)
from tetri_server.policy.dispatch import Dispatcher
from tetri_server.policy.prefill import ChunkSlice
from tetri_server.policy.prefill_book import PrefillBook, Stage

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
        self.inbox: list[tuple[Any, ...]] = []
        self._kick_pending = False
        self._retry_pending = False
        # decision log hook: gets the records a worker's DecisionLog writes (workers/trace.py)
        self.decisions: Callable[[dict[str, Any]], None] | None = None
        self.num_planned = 0  # DecisionLog.step: every planning round, ran or not

    def deliver(self, msg: tuple[Any, ...]) -> None:
        """A message arrives: handled now when idle (a step starts once the messages of this
        instant are in), else after the running step."""
        if self.busy:
            self.inbox.append(msg)
            return
        self.handle(msg)
        self.kick()

    def kick(self) -> None:
        if not (self.busy or self._kick_pending):
            self._kick_pending = True
            self.sim.loop.after(0.0, self._start)

    def _start(self) -> None:
        self._kick_pending = False
        if self.busy:
            return
        duration_s = self.start_step()
        if duration_s is None:
            # Nothing ran. The worker waits on its inbox until its next report and tries again
            # (a plan that only preempted runs its batch only then); a message wakes it sooner.
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
        self.num_steps += 1
        self.sim.loop.after(duration_s, self._finish)

    def _retry(self) -> None:
        self._retry_pending = False
        self._start()

    def _finish(self) -> None:
        self.finish_step()
        self.busy = False
        inbox, self.inbox = self.inbox, []
        for msg in inbox:
            self.handle(msg)
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
            num_new = seq.num_tokens - seq.num_computed  # 1, or all after a preemption
            items.append((num_new, seq.num_computed))
        return items

    def reserve_slices(self, planned: tuple[ChunkSlice, ...],
                       items: list[tuple[int, int]]) -> tuple[ChunkSlice, ...]:
        """Blocks for each prompt a slice starts, in order, stopping at the first that does not
        fit (no overtaking); the kept slices' (new, prefix) items are appended to ``items``."""
        kept = []
        for piece in planned:
            seq = self.seqs[piece.req_id]
            if piece.is_first and not reserve(self.alloc, seq, seq.req.prompt_len,
                                              self.block_size):
                break
            kept.append(piece)
            items.append((piece.num_tokens, piece.start))
        return tuple(kept)

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
        """Every request of the batch gained one token; the finished ones leave."""
        now = self.sim.loop.now_s
        finished: set[int] = set()
        for req_id in plan.run_ids:
            seq = self.seqs[req_id]
            seq.num_computed = seq.num_tokens
            seq.num_tokens += 1
            if seq.num_tokens - seq.req.prompt_len >= seq.req.output_len:
                finished.add(req_id)
                release(self.alloc, seq)
                del self.seqs[req_id]
                seq.req.end_s = now
                self.sim.finished(seq.req)
        self.admission.on_done(plan, finished)


class PrefillInstance(_Decoding):
    """``workers/prefill.py``: predictor bucket -> PrefillQueue -> Chunker passes -> first
    token -> dispatcher on the last DecodeView -> hand-off; blocks held until KV pulled. With
    ``local_decode_batch`` (elastic), ``policy.LocalDecode`` keeps some prefilled requests:
    they decode here (``seqs``, a greedy admission), their rows riding in the chunks."""

    role = "prefill"

    def __init__(self, sim: Simulation, worker_id: int, num_blocks: int) -> None:
        super().__init__(sim, worker_id, num_blocks)
        cfg = sim.cfg
        self.chunker = Chunker(cfg.chunk_size, block_size=self.block_size)
        dispatcher: Dispatcher = (
            TetriDispatcher(random.Random(cfg.seed + worker_id), block_size=self.block_size,
                            granularity=cfg.granularity, heavy_threshold=cfg.heavy_decode_tokens)
            if cfg.dispatch == "power-of-two"
            else RoundRobinDispatcher(block_size=self.block_size, granularity=cfg.granularity,
                                      heavy_threshold=cfg.heavy_decode_tokens))
        self.book: PrefillBook[SimSeq] = PrefillBook(
            PrefillQueue(cfg.prefill_policy, cfg.sched_batch), dispatcher)
        self.num_rejected = 0  # hand-offs refused by a decode instance
        self._chunk: ChunkPlan | None = None
        self.local = LocalDecode(cfg.local_decode_batch) if cfg.local_decode_batch else None
        self.admission = DecodeAdmission("greedy", block_size=self.block_size,
                                         num_total_blocks=num_blocks,
                                         max_batch=max(1, cfg.local_decode_batch))
        self.seqs = {}  # the kept requests (DECODING in the book)
        self.num_kept = 0  # requests kept in all
        self.max_kept = 0  # most kept at once
        self._decode: DecodeStepPlan | None = None

    def handle(self, msg: tuple[Any, ...]) -> None:
        kind = msg[0]
        if kind == "add":
            req: SimRequest = msg[1]
            self.book.add(req.req_id, SimSeq(req, req.prompt_len), req.prompt_len, req.arrival_s)
        elif kind == "view":
            if self.book.on_view(msg[1]):
                self.dispatch_held()
        elif kind == "pulled":
            pulled = self.book.pulled(msg[1])
            if pulled is not None:
                release(self.alloc, pulled)
                self.kick()  # freed blocks may let the head prompt start
        elif kind == "rejected":
            if self.book.rejected(msg[1]) is not None:
                self.num_rejected += 1
        else:
            super().handle(msg)

    def has_work(self) -> bool:
        return self.book.has_work()

    def is_drained(self) -> bool:
        return not self.book

    def predict_new(self) -> float:
        """Bucket every new arrival (the bucket was drawn per request up front, so every mode
        sees the same predictions); returns the predictor's time, run in-line as the worker
        does."""
        batch = self.book.new()
        if not batch:
            return 0.0
        for e in batch:
            self.book.predicted(e.req_id, e.req.req.bucket)
        return self.sim.predictor_s([e.num_prompt for e in batch])

    def start_step(self) -> float | None:
        predict_s = self.predict_new()
        if len(self.admission):
            return self._start_mixed(predict_s)
        chunk = self.chunker.plan(self.book.queue, self.alloc.num_free)
        if chunk is None:
            return None
        return self._start_chunk(chunk, [], predict_s)

    def _start_mixed(self, predict_s: float) -> float | None:
        """The kept requests decode and prompt slices fill the rest of the chunk."""
        free = self.alloc.num_free
        decode = self.admission.plan(free)
        slices = coupled_chunked_plan(self.book.queue, decode.run_ids, self.chunker.chunk_size,
                                      num_free_blocks=self.admission.free_after(decode, free),
                                      block_size=self.block_size).slices
        items = self.decode_items(decode)
        for req_id in decode.fail_ids:
            self.book.remove(req_id)
        self._decode = decode
        step_s = self._start_chunk(ChunkPlan(slices, 0, sum(p.num_tokens for p in slices)),
                                   items, predict_s)
        if step_s is None:
            self._decode = None
            self.admission.on_done(decode, set())
        return step_s

    def _start_chunk(self, chunk: ChunkPlan, items: list[tuple[int, int]],
                     predict_s: float) -> float | None:
        num_decode = len(items)
        num_kept = len(chunk.slices)
        for i, piece in enumerate(chunk.slices):
            seq = self.book.get(piece.req_id)
            if piece.is_first and not reserve(self.alloc, seq, seq.req.prompt_len,
                                              self.block_size):
                num_kept = i
                break
        if not (num_kept or items):
            return None
        self._chunk = chunk.prefix(num_kept)
        items = items + [(p.num_tokens, p.start) for p in self._chunk.slices]
        num_sampled = num_decode + sum(p.is_last for p in self._chunk.slices)
        num_pad = self._chunk.num_pad if self._decode is None else 0
        return self.cost.step_s(items, num_pad, num_sampled) + predict_s

    def finish_step(self) -> None:
        assert self._chunk is not None
        now = self.sim.loop.now_s
        if self._decode is not None:
            decode, self._decode = self._decode, None
            self.decode_done(decode)
            for req_id in decode.run_ids:
                if req_id not in self.seqs:  # finished
                    self.book.remove(req_id)
        for req_id in self.chunker.on_done(self.book.queue, self._chunk):
            seq = self.book.get(req_id)
            seq.num_computed = seq.num_tokens
            seq.num_tokens += 1  # the first output token
            seq.req.first_token_s = now
            if seq.req.output_len <= 1:
                self.book.remove(req_id)
                release(self.alloc, seq)
                seq.req.end_s = now
                self.sim.finished(seq.req)
            else:
                self.book.prefilled(req_id)
        self._chunk = None
        self.dispatch_held()

    def dispatch_held(self) -> None:
        if self.local is not None:
            self._keep_held(self.local)
        for seq, plan in self.book.dispatch():
            self.sim.handoff(self, seq, plan.decode_worker)

    def _keep_held(self, local: LocalDecode) -> None:
        book = self.book
        for req_id in book.ids(Stage.HELD):
            if not local.keep(len(self.admission), book.queue.num_queued_tokens,
                              self.chunker.chunk_size, book.view):
                return
            seq = self.seqs[req_id] = book.keep(req_id)
            self.num_kept += 1
            self.max_kept = max(self.max_kept, len(self.seqs))
            self.admission.add(req_id, seq.req.prompt_len, seq.num_tokens, seq.req.bucket,
                               seq.req.output_len)

    def load_report(self) -> LoadReport:
        book = self.book
        return LoadReport(self.worker_id, "prefill", book.count(Stage.NEW, Stage.QUEUED),
                          book.count(Stage.HELD, Stage.HANDED_OFF, Stage.DECODING),
                          book.queue.num_queued_tokens,
                          self.alloc.num_free, self.alloc.num_blocks, 0, 0, 0, self.busy_s)


class DecodeInstance(_Decoding):
    """``workers/decode.py``: hand-off -> blocks for the prompt's KV -> pull over the link ->
    KV pulled (the prefill side frees) -> DecodeAdmission -> one token per step. Elastic
    (``local_prefill_tokens``): prompts routed here wait in a FCFS queue and ride in the decode
    steps, at most that many prompt tokens a step."""

    role = "decode"

    def __init__(self, sim: Simulation, worker_id: int, num_blocks: int) -> None:
        super().__init__(sim, worker_id, num_blocks)
        cfg = sim.cfg
        self.admission = DecodeAdmission(
            cfg.decode_policy, block_size=self.block_size, num_total_blocks=num_blocks,
            granularity=cfg.granularity, max_batch=cfg.max_batch,
            heavy_threshold=cfg.heavy_decode_tokens)
        self.seqs = {}
        self.pulling: dict[int, tuple[SimSeq, PrefillInstance]] = {}
        self.link_free_s = 0.0  # the inbound link carries one hand-off at a time
        self._plan: DecodeStepPlan | None = None
        self.queue = PrefillQueue("fcfs")  # elastic: prompts prefilled here
        self._slices: tuple[ChunkSlice, ...] = ()
        self.num_prefilled = 0  # prompts prefilled here (elastic)

    def handle(self, msg: tuple[Any, ...]) -> None:
        kind = msg[0]
        if kind == "handoff":
            src: PrefillInstance = msg[1]
            req: SimRequest = msg[2]
            seq = SimSeq(req, req.prompt_len + 1, num_computed=req.prompt_len)
            if not reserve(self.alloc, seq, seq.num_computed, self.block_size):
                self.sim.send(src, ("rejected", req.req_id))
                return
            self.pulling[req.req_id] = (seq, src)
            self.sim.pull(self, req.req_id, seq.num_computed)
        elif kind == "add":  # elastic: a light prompt routed here
            req = msg[1]
            self.seqs[req.req_id] = SimSeq(req, req.prompt_len)
            self.queue.add(req.req_id, req.prompt_len, req.arrival_s)
        elif kind == "kv_ready":
            seq, src = self.pulling.pop(msg[1])
            self.sim.send(src, ("pulled", msg[1]))
            self.seqs[msg[1]] = seq
            req = seq.req
            self.admission.add(req.req_id, req.prompt_len, seq.num_tokens, req.bucket,
                               req.output_len)
        else:
            super().handle(msg)

    def start_step(self) -> float | None:
        free = self.alloc.num_free
        plan = self.admission.plan(free)
        slices: tuple[ChunkSlice, ...] = ()
        if len(self.queue):
            slices = coupled_chunked_plan(
                self.queue, plan.run_ids, len(plan.run_ids) + self.sim.cfg.local_prefill_tokens,
                num_free_blocks=self.admission.free_after(plan, free),
                block_size=self.block_size).slices
        items = self.decode_items(plan)
        num_decode = len(items)
        kept = self.reserve_slices(slices, items)
        if not items:
            self.admission.on_done(plan, set())
            return None
        self._plan, self._slices = plan, kept
        return self.cost.step_s(items, 0, num_decode + sum(p.is_last for p in kept))

    def finish_step(self) -> None:
        assert self._plan is not None
        plan, self._plan = self._plan, None
        self.decode_done(plan)
        slices, self._slices = self._slices, ()
        if slices:
            done = self.queue.advance(slices)
            self.num_prefilled += len(done)
            self.prompts_done(done, predicted=True)

    def load_report(self) -> LoadReport:
        load = self.admission.load()
        return LoadReport(self.worker_id, "decode", load.num_waiting + len(self.queue),
                          load.num_running, self.queue.num_queued_tokens,
                          self.alloc.num_free, self.alloc.num_blocks, load.num_heavy,
                          load.num_light, load.predicted_demand_blocks, self.busy_s,
                          load.num_preemptions)
