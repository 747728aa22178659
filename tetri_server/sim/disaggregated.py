"""The simulated disaggregated roles: ``workers/prefill.py`` and ``workers/decode.py`` on the
virtual clock (see ``sim/instances.py``), with the same ``PrefillBook``, dispatchers,
admission and elastic rules as the workers."""

from __future__ import annotations

import random
from typing import TYPE_CHECKING, Any

from tetri_server.messages import LoadReport
from tetri_server.policy import (
    Chunker,
    ChunkPlan,
    DecodeAdmission,
    DecodeStepPlan,
    LocalDecode,
    LocalPrefill,
    LocalSteps,
    PrefillQueue,
    RoundRobinDispatcher,
    StepTimes,
    TetriDispatcher,
    coupled_chunked_plan,
    head_prompt_need,
    kept_prompt_room,
    local_decode_of,
    mixed_chunk,
)
from tetri_server.policy.chunker import num_blocks_for
from tetri_server.policy.dispatch import Dispatcher
from tetri_server.policy.prefill import ChunkSlice
from tetri_server.policy.prefill_book import PrefillBook, Stage
from tetri_server.sim.instances import (
    SimRequest,
    SimSeq,
    _Decoding,
    release,
    reserve,
    slice_list,
)

if TYPE_CHECKING:
    from tetri_server.sim.cluster import Simulation


class PrefillInstance(_Decoding):
    """``workers/prefill.py``: predictor bucket -> PrefillQueue -> Chunker passes -> first
    token -> dispatcher on the last DecodeView -> hand-off; blocks held until KV pulled. With
    ``local_decode_batch`` (elastic), ``policy.LocalDecode`` keeps some prefilled requests:
    they decode here (``seqs``, a greedy admission), their rows riding in the chunks."""

    role = "prefill"

    def __init__(self, sim: Simulation, worker_id: int, num_blocks: int) -> None:
        super().__init__(sim, worker_id, num_blocks)
        cfg = sim.cfg
        self.chunker = Chunker(cfg.chunk_size, block_size=self.block_size,
                               overtake_share=cfg.overtake_share, finish_alone=cfg.finish_alone)
        # seqs above those of a dispatcher this instance had before a flip (PrefillRole's)
        stamp = dict(source=worker_id, first_seq=int(sim.loop.now_s * 1e6) + 1)
        dispatcher: Dispatcher = (
            TetriDispatcher(random.Random(cfg.seed + worker_id), block_size=self.block_size,
                            granularity=cfg.granularity, heavy_threshold=cfg.heavy_decode_tokens,
                            **stamp)
            if cfg.dispatch == "power-of-two"
            else RoundRobinDispatcher(block_size=self.block_size, granularity=cfg.granularity,
                                      heavy_threshold=cfg.heavy_decode_tokens, **stamp))
        self.book: PrefillBook[SimSeq] = PrefillBook(
            PrefillQueue(cfg.prefill_policy, cfg.sched_batch, starve_tokens=cfg.starve_tokens),
            dispatcher)
        self.num_rejected = 0  # hand-offs refused by a decode instance
        self._chunk: ChunkPlan | None = None
        self.local = local_decode_of(cfg)
        # tokens of a step with kept requests' rows (prefill.local_decode_chunk)
        self.mixed_chunk = mixed_chunk(cfg.chunk_size, cfg.local_decode_chunk)
        self.steps = LocalSteps()  # for self.local
        self._alone = False  # the last step was a pure chunk beside kept requests
        self._drain_views = -1  # ``PrefillRole._drain_views``
        self._step_start_s = 0.0
        self._wait_tokens = 0  # a mixed step's planned tokens (LocalSteps)
        self._last_bucket = cfg.num_buckets - 1  # open
        self.admission = DecodeAdmission("greedy", block_size=self.block_size,
                                         num_total_blocks=num_blocks,
                                         granularity=cfg.granularity,
                                         max_batch=max(1, cfg.local_decode_batch),
                                         tail=sim.length_tail(sim.tail_kind),
                                         recompute_chunk=cfg.recompute_tokens,
                                         waiting_kv_first=False)  # PrefillRole's
        self.seqs = {}  # the kept requests (DECODING in the book)
        self.num_kept = 0  # requests kept in all
        self.num_handed_back = 0  # kept requests handed to a decode instance after all
        self.max_kept = 0  # most kept at once
        self._decode: DecodeStepPlan | None = None

    def handle(self, msg: tuple[Any, ...]) -> None:
        kind = msg[0]
        if kind == "add":
            req: SimRequest = msg[1]
            self.book.add(req.req_id, SimSeq(req, req.prompt_len), req.prompt_len, req.arrival_s,
                          max_tokens=req.output_len)  # the benchmark's max_tokens
        elif kind == "view":
            if self.book.on_view(msg[1]):
                self.dispatch_held()
        elif kind == "pulled":
            pulled = self.book.pulled(msg[1])
            if pulled is not None:
                release(self.alloc, pulled)
                self.kick()  # freed blocks may let the head prompt start
        elif kind == "rejected":
            seq = self.book.rejected(msg[1])
            if seq is not None:
                self.num_rejected += 1
                if (self.local is not None and self.worker_id in self.sim.draining
                        and seq.num_tokens - seq.req.prompt_len > 1):
                    self._keep(msg[1])  # ``PrefillRole.handle``: a hand-back decodes here
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
        self._step_start_s = self.sim.loop.now_s
        predict_s = self.predict_new()
        step_s = self._start_work(predict_s)
        if step_s is None and predict_s > 0:  # the predictor ran with no step: its time passes
            self._chunk = ChunkPlan([], 0, 0)
            return predict_s
        return step_s

    def _start_work(self, predict_s: float) -> float | None:
        """A mixed step or a prompt chunk, costed with the predictor's ``predict_s``; None when
        nothing runs."""
        if self.local is not None and len(self.admission):
            self._hand_back(self.local, draining=self.worker_id in self.sim.draining)
        alone, self._alone = self._alone, False
        if len(self.admission) and (self.local is None or not self.local.prompt_alone(
                self.book.queue.num_queued_tokens, self.mixed_chunk, alone)):
            return self._start_mixed(predict_s)
        self._alone = bool(len(self.admission))  # a pure chunk beside kept requests
        room = kept_prompt_room(self.admission, self.book, None, self.alloc.num_free)
        chunk = self.chunker.plan(self.book.queue, room)
        if chunk is None and self._alone:  # PrefillRole.step: the kept rows run instead
            self._alone = False
            return self._start_mixed(predict_s)
        if chunk is None:
            return None
        return self._start_chunk(chunk, [], predict_s, pad=True)

    def _start_mixed(self, predict_s: float) -> float | None:
        """The kept requests decode and prompt slices fill the rest of the chunk (of
        ``local_decode_chunk`` when set)."""
        free = self.alloc.num_free
        rows = len(self.admission.running_ids)  # a recompute takes room the step's cap leaves
        decode = self.admission.plan(free, recompute_room=self.kept_step_tokens(
            finishing=True, num_rows=rows) - rows)
        tokens = self.kept_step_tokens(finishing=True, num_rows=len(decode.run_ids))
        self._wait_tokens = tokens  # ``PrefillRole._mixed_step`` reports the planned size
        num_left = tokens - decode.num_recompute_tokens  # a recompute's count against the chunk
        room = kept_prompt_room(self.admission, self.book, decode, free)
        slices = coupled_chunked_plan(self.book.queue, decode.run_ids, num_left,
                                      num_free_blocks=room,
                                      block_size=self.block_size,
                                      overtake_share=self.chunker.overtake_share).slices
        self.num_planned += 1
        self.record("mixed_step", run=list(decode.run_ids), preempt=list(decode.preempt.req_ids),
                    fail=list(decode.fail_ids), slices=slice_list(slices),
                    **decode.recompute_log)
        items = self.decode_items(decode)
        num_sampled = self.num_sampled(decode)
        for req_id in decode.fail_ids:
            self.book.remove(req_id)
        self._decode = decode
        step_s = self._start_chunk(ChunkPlan(slices, 0, sum(p.num_tokens for p in slices)),
                                   items, predict_s, pad=False, num_sampled=num_sampled)
        if step_s is None:
            self._decode = None
            self.admission.on_done(decode, set())
            self.replan = bool(decode.preempt.req_ids or decode.fail_ids)
        return step_s

    def _start_chunk(self, chunk: ChunkPlan, items: list[tuple[int, int]], predict_s: float,
                     *, pad: bool, num_sampled: int = 0) -> float | None:
        """The step's prompt slices after ``items`` (the kept requests' decode rows, if any,
        ``num_sampled`` of which sample); ``pad``: a pure prefill chunk, whose padding is
        logged, and costed only with ``pad_chunks`` (the worker runs no padding)."""
        kept = self.reserve_slices(chunk.slices, items)
        if not items:
            return None
        self._chunk = chunk.keep(kept)
        if pad:  # a pure prefill chunk: the worker logs it once it has its blocks
            self.num_planned += 1
            self.record("chunk", slices=slice_list(self._chunk.slices), pad=self._chunk.num_pad)
        num_sampled += sum(p.is_last for p in kept)
        num_pad = self._chunk.num_pad if pad and self.sim.cfg.pad_chunks else 0
        return self.cost.step_s(items, num_pad, num_sampled) + predict_s

    def kept_step_tokens(self, *, finishing: bool = False, num_rows: int = 0) -> int:
        """``PrefillRole._kept_step_tokens``."""
        if self.local is None:
            return self.mixed_chunk
        finishing = finishing and any(self.local.finishes_here(seq.req.output_len)
                                      for seq in self.seqs.values())  # max_tokens: true length
        return self.local.step_tokens(self.book.queue.num_queued_tokens, self.mixed_chunk,
                                      self.chunker.chunk_size,
                                      self.steps.prompt_share.share(self.sim.loop.now_s),
                                      finishing, num_rows)

    def seq(self, req_id: int) -> SimSeq:
        return self.book.get(req_id)  # queued prompts and kept requests alike

    def finish_step(self) -> None:
        assert self._chunk is not None
        now = self.sim.loop.now_s
        if self._chunk.slices or self._decode is not None:
            num_decode = 0 if self._decode is None else self._decode.num_tokens
            wait_tokens = (self.kept_step_tokens() if self._decode is None
                           else self._wait_tokens)
            self.steps.add(self._step_start_s, now, prompt=bool(self._chunk.slices),
                           num_tokens=num_decode + self._chunk.num_tokens,
                           wait_tokens=wait_tokens)
        if self._decode is not None:
            decode, self._decode = self._decode, None
            self.decode_done(decode)
            if not len(self.admission):
                self.steps.idle()
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
                if self.sim.cfg.mock_handoff:  # the paper's mock: nothing waits for the pull
                    release(self.alloc, seq)
        self._chunk = None
        self.dispatch_held()

    def dispatch_held(self) -> None:
        if self.local is not None and self.worker_id not in self.sim.draining:
            self._keep_held(self.local)
        for seq, plan in self.book.dispatch():
            self.record("dispatch", req=seq.req.req_id, to=plan.decode_worker,
                        blocks=plan.num_blocks, heavy=plan.heavy)
            self.sim.handoff(self, seq, plan.decode_worker, plan.seq)

    def _keep_held(self, local: LocalDecode) -> None:
        book = self.book
        gran = self.sim.cfg.granularity
        held = []
        for req_id in book.ids(Stage.HELD):
            req = book.get(req_id).req  # its max_tokens is the true length
            upper = None if req.bucket >= self._last_bucket else (req.bucket + 1) * gran
            held.append((req_id, req.output_len, upper))
        share = self.steps.prompt_share.share(self.sim.loop.now_s)
        for req_id in local.choose(held, len(self.admission), book.queue.num_queued_tokens,
                                   self.chunker.chunk_size, book.view, share,
                                   self.steps.gap_s(share, book.view)):
            self._keep(req_id)

    def _keep(self, req_id: int) -> None:
        seq = self.seqs[req_id] = self.book.keep(req_id)
        self.record("keep", req=req_id)
        self.num_kept += 1
        self.max_kept = max(self.max_kept, len(self.seqs))
        self.admission.add(req_id, seq.req.prompt_len, seq.num_tokens, seq.req.bucket,
                           seq.req.output_len)

    def _hand_back(self, local: LocalDecode, *, draining: bool = False) -> None:
        """``PrefillRole._hand_back``: prompts wait beyond the next chunk (or the instance
        drains for a flip); the kept requests whose KV is whole go to a decode instance, but
        those that finish here."""
        book = self.book
        if draining:
            if book.num_views == self._drain_views:
                return  # tried with this view: wait for a newer one
            self._drain_views = book.num_views
        elif not local.hands_back(book.queue.num_queued_tokens, self.chunker.chunk_size):
            return
        moved = []
        for req_id in book.ids(Stage.DECODING):
            seq = self.seqs[req_id]
            if seq.num_computed != seq.num_tokens - 1:
                continue  # preempted here: recomputed here
            if local.finishes_here(seq.req.output_len):  # max_tokens: the true length
                continue
            del self.seqs[req_id]
            self.admission.remove(req_id)
            book.hand_back(req_id, seq.num_tokens)
            self.record("hand_back", req=req_id)
            self.num_handed_back += 1
            moved.append(req_id)
        self.dispatch_held()
        if draining:  # not dispatched: decoding here beats waiting idle for room
            held = set(book.ids(Stage.HELD))
            for req_id in moved:
                if req_id in held:
                    self._keep(req_id)

    def load_report(self) -> LoadReport:
        book, kept = self.book, self.admission.load()  # its kept requests'
        return LoadReport(self.worker_id, "prefill", book.count(Stage.NEW, Stage.QUEUED),
                          book.count(Stage.HELD, Stage.HANDED_OFF, Stage.DECODING),
                          book.num_waiting_prompt_tokens(),
                          self.alloc.num_free, self.alloc.num_blocks, 0, 0, 0, self.busy_s,
                          kept.num_preemptions, num_kv_drops=kept.num_kv_drops)


class DecodeInstance(_Decoding):
    """``workers/decode.py``: hand-off -> blocks for the prompt's KV -> pull over the link ->
    KV pulled (the prefill side frees) -> DecodeAdmission -> one token per step. Elastic
    (``local_prefill_tokens``): prompts routed here wait in a FCFS queue and ride in the decode
    steps, at most that many prompt tokens a step (and at most ``chunk_size`` of them with
    ``local_prefill_slice = "chunk"``, ``LocalPrefill.slice_tokens``)."""

    role = "decode"

    def __init__(self, sim: Simulation, worker_id: int, num_blocks: int) -> None:
        super().__init__(sim, worker_id, num_blocks)
        cfg = sim.cfg
        self.admission = DecodeAdmission(
            cfg.decode_policy, block_size=self.block_size, num_total_blocks=num_blocks,
            granularity=cfg.granularity, max_batch=cfg.max_batch,
            heavy_threshold=cfg.heavy_decode_tokens,
            tail=sim.length_tail(sim.tail_kind),  # as the emulated predictor's buckets are
            recompute_chunk=cfg.recompute_tokens, waiting_kv_first=cfg.waiting_kv_first)
        self.seqs = {}
        self.pulling: dict[int, tuple[SimSeq, PrefillInstance]] = {}
        self.link_free_s = 0.0  # the inbound link carries one hand-off at a time
        self._plan: DecodeStepPlan | None = None
        self.queue = PrefillQueue("fcfs")  # elastic: prompts prefilled here
        self._slices: tuple[ChunkSlice, ...] = ()
        self.num_prefilled = 0  # prompts prefilled here (elastic)
        self.prompt_budget = cfg.local_prefill_tokens  # DecodeRole's, until a prompt comes
        self.step_times = StepTimes()  # reported, as workers/decode.py does
        self.handoffs_read: dict[int, int] = {}  # DecodeRole.handoffs_read

    def handle(self, msg: tuple[Any, ...]) -> None:
        kind = msg[0]
        if kind == "handoff":
            src: PrefillInstance = msg[1]
            req: SimRequest = msg[2]
            num_tokens: int = msg[3]  # prompt + first token, + what a prefill worker decoded
            seq = SimSeq(req, num_tokens, num_computed=num_tokens - 1)
            # DecodeRole.receive: the batch's next step and the first queued prompt keep theirs
            free = self.alloc.num_free - head_prompt_need(self.queue, self.block_size)
            if not self.admission.has_room_for(
                    num_blocks_for(seq.num_computed, self.block_size), free) \
                    or not reserve(self.alloc, seq, seq.num_computed, self.block_size):
                self.sim.send(src, ("rejected", req.req_id))
                return
            self.pulling[req.req_id] = (seq, src)
            # read now: DecodeRole.receive reserves, copies, marks it read and admits in one
            # go (the worker reports nothing in between); the reports count it meanwhile
            self.handoffs_read[src.worker_id] = msg[4]
            self.sim.pull(self, req.req_id, seq.num_computed)
        elif kind == "add":  # elastic: a prompt routed here (it finishes sooner)
            req = msg[1]
            cfg = self.sim.cfg  # DecodeRole.add: the slice follows the prefill side's chunk
            self.prompt_budget = LocalPrefill.slice_tokens(
                cfg.local_prefill_tokens, msg[3], cfg.local_prefill_slice == "chunk")
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
        if len(self.queue):  # a recompute's tokens count against the prompt tokens
            num_prompt = max(0, self.prompt_budget - plan.num_recompute_tokens)
            slices = coupled_chunked_plan(
                self.queue, plan.run_ids, len(plan.run_ids) + num_prompt,
                num_free_blocks=self.admission.prompt_room(plan, free),
                block_size=self.block_size).slices
        self.num_planned += 1
        if plan.run_ids or plan.preempt.req_ids or plan.fail_ids or slices:
            self.record("decode_step", run=list(plan.run_ids), admit=list(plan.admit.req_ids),
                        preempt=list(plan.preempt.req_ids), fail=list(plan.fail_ids), free=free,
                        **({"slices": slice_list(slices)} if slices else {}),
                        **plan.recompute_log)
        items = self.decode_items(plan)
        num_decode = len(items)
        num_sampled = self.num_sampled(plan)
        kept = self.reserve_slices(slices, items)
        if not items:
            self.admission.on_done(plan, set())
            self.replan = bool(plan.preempt.req_ids or plan.fail_ids)
            return None
        self._plan, self._slices = plan, kept
        step_s = self.cost.step_s(items, 0, num_sampled + sum(p.is_last for p in kept))
        if num_decode:  # the gap its requests see, prompt slices and all
            self.step_times.add(step_s)
        return step_s

    def finish_step(self) -> None:
        assert self._plan is not None
        plan, self._plan = self._plan, None
        self.decode_done(plan)
        if not len(self.admission):
            self.step_times.idle()
        slices, self._slices = self._slices, ()
        if slices:
            done = self.queue.advance(slices)
            self.num_prefilled += len(done)
            self.prompts_done(done, predicted=True)

    def load_report(self) -> LoadReport:
        load = self.admission.load([(s.req.req_id, s.req.prompt_len, s.num_tokens,
                                     s.req.bucket, s.req.output_len)
                                    for s, _ in self.pulling.values()])
        return LoadReport(self.worker_id, "decode", load.num_waiting + len(self.queue),
                          load.num_running, self.queue.num_queued_tokens,
                          self.alloc.num_free, self.alloc.num_blocks, load.num_heavy,
                          load.num_light, load.predicted_demand_blocks, self.busy_s,
                          load.num_preemptions, step_s=self.step_times.recent_s,
                          fastest_step_s=self.step_times.fastest_s,
                          num_kv_drops=load.num_kv_drops,
                          handoffs_read=dict(self.handoffs_read))
