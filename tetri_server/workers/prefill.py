"""Prefill worker (disaggregated mode): fixed-size chunked prefill, length prediction, dispatch.

Life of a request here (its stage in ``policy.PrefillBook``, the one table of requests this
worker owns): AddRequest (NEW) -> predicted bucket -> PrefillQueue (QUEUED) -> chunks of
exactly ``chunk_size`` tokens (packed with others) -> first token sampled and streamed (TTFT;
HELD) -> dispatcher picks a decode worker -> Handoff via control (HANDED_OFF). Blocks stay held
until that worker answers KVPulled; on HandoffRejected or no room in the view the request is
HELD again until the next DecodeView. Nothing is dropped.
"""

from __future__ import annotations

import logging
import random
import time

from tetri_server.engine.runner import ScheduledSeq, StepPlan
from tetri_server.engine.sampling import make_generator
from tetri_server.engine.sequence import SeqStatus, Sequence
from tetri_server.engine.stops import DEAD_END, append_token, dead_end_failure, emit, prompt_parts
from tetri_server.messages import (
    AddRequest,
    DecodeView,
    Handoff,
    HandoffRejected,
    KVPulled,
    LoadReport,
    RequestFailed,
    TokenDelta,
)
from tetri_server.policy import (
    Chunker,
    ChunkPlan,
    DecodeAdmission,
    LocalDecode,
    LocalSteps,
    PrefillQueue,
    RoundRobinDispatcher,
    TetriDispatcher,
    calibration_rows,
    coupled_chunked_plan,
    kept_prompt_room,
    local_decode_of,
    mixed_chunk,
)
from tetri_server.policy.dispatch import Dispatcher
from tetri_server.policy.prefill_book import Entry, PrefillBook, Stage
from tetri_server.predictor import PredictorError
from tetri_server.workers.base import Role, Worker, length_tail
from tetri_server.workers.calibrate import resolve_chunk_size
from tetri_server.workers.decoding import carry_out, reserve_prompts

log = logging.getLogger("tetri.prefill")


class PrefillRole(Role):
    name = "prefill"

    def __init__(self, w: Worker, *, at_start: bool = True) -> None:
        """``at_start``: False when the worker flips to prefill (``resolve_chunk_size``)."""
        super().__init__(w)
        cfg = self.w.cfg
        pre = cfg.prefill
        self._chunk_size = resolve_chunk_size(
            w, pre.chunk_size,
            rows=calibration_rows(pre.local_decode_batch, pre.local_decode_chunk,
                                  pre.local_decode_full_chunk_backlog,
                                  pre.local_decode_full_chunk_share), at_start=at_start)
        self.chunker = Chunker(self._chunk_size, block_size=self.w.block_size,
                               overtake_share=cfg.prefill.overtake_share,
                               finish_alone=cfg.prefill.finish_alone)
        self.predictor = w.predictor()
        gran = self.predictor.granularity
        heavy = cfg.predictor.heavy_decode_tokens
        # seqs above any an earlier process or role of this worker id sent: microseconds of
        # the system-wide monotonic clock (one plan takes far longer than one)
        stamp = dict(source=self.w.worker_id, first_seq=time.monotonic_ns() // 1000)
        dispatcher: Dispatcher = (
            TetriDispatcher(random.Random(cfg.dispatch.seed + self.w.worker_id),
                            block_size=self.w.block_size, granularity=gran, heavy_threshold=heavy,
                            **stamp)
            if cfg.dispatch.policy == "power-of-two"
            else RoundRobinDispatcher(block_size=self.w.block_size, granularity=gran,
                                      heavy_threshold=heavy, **stamp))
        self.book: PrefillBook[Sequence] = PrefillBook(
            PrefillQueue(cfg.prefill.policy, cfg.prefill.sched_batch,
                         starve_tokens=cfg.prefill.starve_tokens), dispatcher)
        # elastic P/D: the requests this worker keeps and decodes itself (greedy admission)
        num_local = cfg.prefill.local_decode_batch
        self.local = local_decode_of(cfg.prefill)
        # tokens of a step with kept requests' rows
        self._mixed_chunk = mixed_chunk(self._chunk_size, cfg.prefill.local_decode_chunk)
        self.steps = LocalSteps()  # for self.local (monotonic clock)
        self._alone = False  # the last step was a pure chunk beside kept requests
        self._drain_views = -1  # book.num_views when draining last handed kept requests back
        self.admission = DecodeAdmission("greedy", block_size=w.block_size,
                                         num_total_blocks=w.allocator.num_blocks,
                                         granularity=gran, max_batch=max(1, num_local),
                                         tail=length_tail(cfg, cfg.predictor.kind),
                                         recompute_chunk=cfg.decode.recompute_tokens,
                                         # a waiting kept request keeps its KV to be handed
                                         # back whole (_hand_back)
                                         waiting_kv_first=False)

    def chunk_size(self) -> int:
        return self._chunk_size

    # ------------------------------------------------------------------ messages

    def handle(self, msg: object) -> None:
        if isinstance(msg, AddRequest):
            seq = Sequence(msg.req_id, list(msg.prompt_ids), len(msg.prompt_ids), msg.sampling,
                           arrival_s=msg.arrival_s,
                           generator=make_generator(msg.sampling.seed, self.w.device))
            self.book.add(seq.req_id, seq, seq.num_prompt, msg.arrival_s,
                          prompt_text=msg.prompt_text, true_output_len=msg.true_output_len,
                          max_tokens=msg.sampling.max_tokens)
        elif isinstance(msg, DecodeView):
            if self.book.on_view(msg):
                self.dispatch_held()
        elif isinstance(msg, KVPulled):
            seq = self.book.pulled(msg.req_id)
            if seq is not None:
                self.w.kv.free(seq)
        elif isinstance(msg, HandoffRejected):
            seq = self.book.rejected(msg.req_id)  # held again; dispatched after the next view
            if seq is not None:
                log.info("request %d rejected by decode: %s", msg.req_id, msg.reason)
                self.w.kv.unpin(seq)  # nobody reads its blocks now; a new Handoff names them anew
                if (self.local is not None and self.w.pending_role is not None
                        and seq.num_output > 1):  # a hand-back (it decoded here) refused while
                    self._keep(msg.req_id, 0.0)  # draining: it decodes here until there is room
        else:
            super().handle(msg)

    def abort(self, req_id: int) -> None:
        self.admission.remove(req_id)
        seq = self.book.remove(req_id)
        if seq is not None:
            self.w.kv.free(seq)

    # ------------------------------------------------------------------ the step

    def has_work(self) -> bool:
        return self.book.has_work()

    def is_drained(self) -> bool:
        return not self.book

    def predict_new(self) -> None:
        """Batch-predict the output-length bucket of every newly arrived request."""
        batch = self.book.new()
        if not batch:
            return
        try:
            buckets = self.predictor.predict([e.prompt_text for e in batch],
                                             [e.true_output_len for e in batch])
        except PredictorError:
            batch, buckets = self._predict_one_by_one(batch)
        for e, bucket in zip(batch, buckets, strict=True):
            e.req.predicted_bucket = bucket
            e.req.predicted_len = self.predictor.lower_bound(bucket)
            self.book.predicted(e.req_id, bucket)

    def _predict_one_by_one(
            self, batch: list[Entry[Sequence]]) -> tuple[list[Entry[Sequence]], list[int]]:
        """A batch the predictor refused (e.g. ``oracle`` without a true length): fail the
        requests it cannot answer, keep the others."""
        kept, buckets = [], []
        for e in batch:
            try:
                buckets += self.predictor.predict([e.prompt_text], [e.true_output_len])
                kept.append(e)
            except PredictorError as err:
                self.book.remove(e.req_id)
                self.w.send(RequestFailed(e.req_id, f"length predictor: {err}"))
        return kept, buckets

    def step(self) -> bool:
        self.predict_new()
        if self.local is not None and len(self.admission):
            self._hand_back(self.local, draining=self.w.pending_role is not None)
        alone, self._alone = self._alone, False
        if len(self.admission) and (self.local is None or not self.local.prompt_alone(
                self.book.queue.num_queued_tokens, self._mixed_chunk, alone)):
            return self._mixed_step()
        self._alone = bool(len(self.admission))  # a pure chunk beside kept requests
        room = kept_prompt_room(self.admission, self.book, None, self.w.allocator.num_free)
        chunk = self.chunker.plan(self.book.queue, room)
        if chunk is None and self._alone:  # no room beside the kept rows: they run instead
            self._alone = False
            return self._mixed_step()
        if chunk is None:
            return False  # no blocks for the head request: wait for an ack or an abort
        chunk, items = self._reserve(chunk)
        if not items:
            return False  # free blocks exist, but only around pinned extents: wait
        self.w.decisions.step += 1
        self.w.decisions.record("chunk", slices=[[p.req_id, p.start, p.num_tokens]
                                                 for p in chunk.slices], pad=chunk.num_pad)
        # Padding is bookkeeping only: on CPU, computing pad tokens is pure waste.
        t0 = time.monotonic()
        result = self.w.runner.execute(StepPlan(items))
        self.steps.add(t0, time.monotonic(), prompt=True, num_tokens=chunk.num_tokens,
                       wait_tokens=self._kept_step_tokens())
        done = set(self.chunker.on_done(self.book.queue, chunk))
        self._send(prompt_parts(i.seq for i in items)
                   + self._first_tokens(items, result.sampled, result.logprobs, done))
        self.dispatch_held()
        return True

    def _mixed_step(self) -> bool:
        """Elastic: the requests this worker kept decode one token each and prompt slices fill
        the rest of the chunk, or of ``prefill.local_decode_chunk`` when set (Sarathi-style),
        in one forward."""
        free, book = self.w.allocator.num_free, self.book
        rows = len(self.admission.running_ids)  # a recompute takes room the step's cap leaves
        decode = self.admission.plan(free, recompute_room=self._kept_step_tokens(
            finishing=True, num_rows=rows) - rows)
        tokens = self._kept_step_tokens(finishing=True, num_rows=len(decode.run_ids))
        num_left = tokens - decode.num_recompute_tokens  # a recompute's count against the chunk
        room = kept_prompt_room(self.admission, book, decode, free)
        slices = coupled_chunked_plan(book.queue, decode.run_ids, num_left,
                                      num_free_blocks=room,
                                      block_size=self.w.block_size,
                                      overtake_share=self.chunker.overtake_share).slices
        self.w.decisions.step += 1
        self.w.decisions.record("mixed_step", run=list(decode.run_ids),
                                preempt=list(decode.preempt.req_ids), fail=list(decode.fail_ids),
                                slices=[[p.req_id, p.start, p.num_tokens] for p in slices],
                                **decode.recompute_log)
        local = {rid: book.get(rid) for rid in book.ids(Stage.DECODING)}
        planned = decode.run_ids
        items, dropped, decode = carry_out(decode, local, self.w.kv)
        if decode.run_ids != planned:  # blocks split by pinned extents: they wait for an ack
            self.w.decisions.record("rows_wait", ids=[r for r in planned
                                                      if r not in decode.run_ids])
        for req_id in dropped:
            book.remove(req_id)
            self.w.send(RequestFailed(req_id, "request no longer fits this worker's KV pool"))
        num_decode = len(items)
        chunk, prompt_items = self._reserve(ChunkPlan(slices, 0, sum(p.num_tokens for p in slices)))
        items += prompt_items
        if not items:
            self.admission.on_done(decode, set())
            return bool(decode.preempt.req_ids or dropped)
        t0 = time.monotonic()
        result = self.w.runner.execute(StepPlan(items))
        self.steps.add(t0, time.monotonic(), prompt=bool(prompt_items),
                       num_tokens=decode.num_tokens + chunk.num_tokens, wait_tokens=tokens)
        deltas, finished = [], set()
        for item, tok, lp in zip(items[:num_decode], result.sampled, result.logprobs,
                                 strict=False):
            seq = item.seq
            if tok is None:  # a recompute with more tokens to go
                continue
            reason = append_token(seq, tok, lp, self.w.model_spec.eos_token_ids,
                                  self.w.max_model_len)
            if reason == DEAD_END:
                self.w.send(dead_end_failure(seq))
            else:
                deltas.append(emit(seq, reason))
            if reason is not None:
                finished.add(seq.req_id)
                book.remove(seq.req_id)
                self.w.kv.free(seq)
        self.admission.on_done(decode, finished)
        if not len(self.admission):
            self.steps.idle()
        done = set(book.queue.advance(chunk.slices))
        deltas += prompt_parts(i.seq for i in prompt_items)
        deltas += self._first_tokens(prompt_items, result.sampled[num_decode:],
                                     result.logprobs[num_decode:], done)
        self._send(deltas)
        self.dispatch_held()
        return True

    def _kept_step_tokens(self, *, finishing: bool = False, num_rows: int = 0) -> int:
        """The most tokens of a step with kept rows now (``LocalDecode.step_tokens``); with
        ``finishing``, the cap of ``prefill.local_finish_tokens`` too while a request kept by
        it decodes, beside the step's ``num_rows`` rows (the next step's plan, not the rate
        ``LocalSteps`` scales prompt steps to)."""
        if self.local is None:
            return self._mixed_chunk
        book = self.book
        finishing = finishing and any(self.local.finishes_here(book.get(rid).params.max_tokens)
                                      for rid in book.ids(Stage.DECODING))
        return self.local.step_tokens(book.queue.num_queued_tokens, self._mixed_chunk,
                                      self._chunk_size,
                                      self.steps.prompt_share.share(time.monotonic()), finishing,
                                      num_rows)

    def _first_tokens(self, items: list[ScheduledSeq], sampled: list[int | None],
                      logprobs: list[float | None], done: set[int]) -> list[TokenDelta]:
        """The first token of every prompt the step completed; each such request is then held
        for dispatch, or finished."""
        deltas = []
        for item, tok, lp in zip(items, sampled, logprobs, strict=True):
            seq = item.seq
            if tok is None or seq.req_id not in done:
                continue
            reason = append_token(seq, tok, lp, self.w.model_spec.eos_token_ids,
                                  self.w.max_model_len)
            if reason == DEAD_END:
                self.w.send(dead_end_failure(seq))
            else:
                deltas.append(emit(seq, reason))
                deltas[-1].predicted_bucket = seq.predicted_bucket  # also if never handed off
            if reason is not None:
                self.book.remove(seq.req_id)
                self.w.kv.free(seq)
            else:
                self.book.prefilled(seq.req_id)
        return deltas

    def _send(self, deltas: list[TokenDelta]) -> None:
        self.w.send_deltas(deltas)

    def _reserve(self, chunk: ChunkPlan) -> tuple[ChunkPlan, list[ScheduledSeq]]:
        """Blocks for every request the chunk starts (``reserve_prompts``): a prompt whose
        blocks do not fit in one run waits, and so do the prompts behind it that would start."""
        items: list[ScheduledSeq] = []
        return chunk.keep(reserve_prompts(chunk.slices, self.book.get, self.w.kv, items)), items

    def dispatch_held(self) -> None:
        if self.local is not None and self.w.pending_role is None:  # a flip drains: keep none
            self._keep_held(self.local)
        for seq, plan in self.book.dispatch():
            self.w.decisions.record("dispatch", req=seq.req_id, to=plan.decode_worker,
                                    blocks=plan.num_blocks, heavy=plan.heavy)
            self.w.kv.pin(seq)  # the decode worker reads these block ids until KVPulled
            self.w.send(Handoff(seq.req_id, self.w.worker_id, list(seq.blocks), list(seq.token_ids),
                              seq.num_prompt, seq.params, seq.predicted_bucket,
                              seq.predicted_len, seq.arrival_s, dst_worker=plan.decode_worker,
                              dispatch_seq=plan.seq))

    def _keep_held(self, local: LocalDecode) -> None:
        """Elastic: keep held requests, in order, while the policy says decode is the busier
        side; they decode here, in this worker's own steps."""
        book = self.book
        held = []
        for req_id in book.ids(Stage.HELD):
            seq = book.get(req_id)
            held.append((req_id, seq.params.max_tokens,
                         self.predictor.upper_bound(seq.predicted_bucket)))
        if not held:
            return
        share = self.steps.prompt_share.share(time.monotonic())
        gap_s = self.steps.gap_s(share, book.view)
        for req_id in local.choose(held, len(self.admission), book.queue.num_queued_tokens,
                                   self._chunk_size, book.view, share, gap_s):
            self._keep(req_id, gap_s)

    def _keep(self, req_id: int, gap_s: float) -> None:
        book = self.book
        seq = book.keep(req_id)
        seq.status = SeqStatus.RUNNING
        self.admission.add(req_id, seq.num_prompt, seq.num_tokens, seq.predicted_bucket,
                           seq.params.max_tokens)
        self.w.decisions.record("keep", req=req_id, gap_s=gap_s, decode_step_s=[
            d.step_s for d in (book.view.decodes if book.view else ())],
            queued=book.queue.num_queued_tokens, chunk=self._chunk_size)

    def _hand_back(self, local: LocalDecode, *, draining: bool = False) -> None:
        """Elastic: prompts wait beyond the next chunk, so the kept requests whose KV is whole
        go to a decode worker now (one preempted here has none: it stays and is recomputed);
        one that ``finishes_here`` stays (``choose`` would keep it again at once). While the
        worker drains for a flip (``draining``) they go whatever the rule says, once per new
        decode view (a long one decoding here to its end would hold the flip past its
        timeout); those no decode worker has room for go on decoding here meanwhile."""
        book = self.book
        if draining:
            if book.num_views == self._drain_views:
                return  # tried with this view: wait for a newer one
            self._drain_views = book.num_views
        elif not local.hands_back(book.queue.num_queued_tokens, self._chunk_size):
            return
        moved = []
        for req_id in book.ids(Stage.DECODING):
            seq = book.get(req_id)
            if (seq.num_computed != seq.num_tokens - 1
                    or local.finishes_here(seq.params.max_tokens)):
                continue
            self.admission.remove(req_id)
            book.hand_back(req_id, seq.num_tokens)
            self.w.decisions.record("hand_back", req=req_id)
            moved.append(req_id)
        self.dispatch_held()
        if draining:  # not dispatched: decoding here beats waiting idle for room
            held = set(book.ids(Stage.HELD))
            for req_id in moved:
                if req_id in held:
                    self._keep(req_id, 0.0)

    def load_report(self) -> LoadReport:
        a, book = self.w.allocator, self.book
        kept = self.admission.load()  # its kept requests'
        return LoadReport(worker_id=self.w.worker_id, role="prefill",
                          num_waiting=book.count(Stage.NEW, Stage.QUEUED),
                          num_running=book.count(Stage.HELD, Stage.HANDED_OFF, Stage.DECODING),
                          num_queued_prompt_tokens=book.num_waiting_prompt_tokens(),
                          num_free_blocks=a.num_free, num_total_blocks=a.num_blocks, num_heavy=0,
                          num_light=0, predicted_demand_blocks=0, busy_s=self.w.busy_s,
                          num_preemptions=kept.num_preemptions, num_kv_drops=kept.num_kv_drops)
