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

from tetri_server.engine.runner import ScheduledSeq, StepPlan
from tetri_server.engine.sampling import make_generator
from tetri_server.engine.sequence import Sequence
from tetri_server.engine.stops import append_token, emit
from tetri_server.messages import (
    AddRequest,
    DecodeView,
    Handoff,
    HandoffRejected,
    KVPulled,
    LoadReport,
    RequestFailed,
    StepOutput,
)
from tetri_server.policy import (
    Chunker,
    ChunkPlan,
    PrefillQueue,
    RoundRobinDispatcher,
    TetriDispatcher,
)
from tetri_server.policy.dispatch import Dispatcher
from tetri_server.policy.prefill_book import Entry, PrefillBook, Stage
from tetri_server.predictor import PredictorError
from tetri_server.workers.base import Role, Worker
from tetri_server.workers.calibrate import resolve_chunk_size

log = logging.getLogger("tetri.prefill")


class PrefillRole(Role):
    name = "prefill"

    def __init__(self, w: Worker) -> None:
        super().__init__(w)
        cfg = self.w.cfg
        self._chunk_size = resolve_chunk_size(w, cfg.prefill.chunk_size)
        self.chunker = Chunker(self._chunk_size, block_size=self.w.block_size)
        self.predictor = w.predictor()
        gran = self.predictor.granularity
        heavy = cfg.predictor.heavy_decode_tokens
        dispatcher: Dispatcher = (
            TetriDispatcher(random.Random(cfg.dispatch.seed + self.w.worker_id),
                            block_size=self.w.block_size, granularity=gran, heavy_threshold=heavy)
            if cfg.dispatch.policy == "power-of-two"
            else RoundRobinDispatcher(block_size=self.w.block_size, granularity=gran,
                                      heavy_threshold=heavy))
        self.book: PrefillBook[Sequence] = PrefillBook(
            PrefillQueue(cfg.prefill.policy, cfg.prefill.sched_batch), dispatcher)

    def chunk_size(self) -> int:
        return self._chunk_size

    # ------------------------------------------------------------------ messages

    def handle(self, msg: object) -> None:
        if isinstance(msg, AddRequest):
            seq = Sequence(msg.req_id, list(msg.prompt_ids), len(msg.prompt_ids), msg.sampling,
                           arrival_s=msg.arrival_s,
                           generator=make_generator(msg.sampling.seed, self.w.device))
            self.book.add(seq.req_id, seq, seq.num_prompt, msg.arrival_s,
                          prompt_text=msg.prompt_text, true_output_len=msg.true_output_len)
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
        else:
            super().handle(msg)

    def abort(self, req_id: int) -> None:
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
        chunk = self.chunker.plan(self.book.queue, self.w.allocator.num_free)
        if chunk is None:
            return False  # no blocks for the head request: wait for an ack or an abort
        chunk, items = self._reserve(chunk)
        if not items:
            return False  # free blocks exist, but only around pinned extents: wait
        self.w.decisions.step += 1
        self.w.decisions.record("chunk", slices=[[p.req_id, p.start, p.num_tokens]
                                                 for p in chunk.slices], pad=chunk.num_pad)
        # Padding is bookkeeping only: on CPU, computing pad tokens is pure waste.
        result = self.w.runner.execute(StepPlan(items))
        done = set(self.chunker.on_done(self.book.queue, chunk))
        deltas = []
        for item, tok, lp in zip(items, result.sampled, result.logprobs, strict=True):
            seq = item.seq
            if tok is None or seq.req_id not in done:
                continue
            reason = append_token(seq, tok, lp, self.w.model_spec.eos_token_ids,
                                  self.w.max_model_len)
            deltas.append(emit(seq, reason))
            if reason is not None:
                self.book.remove(seq.req_id)
                self.w.kv.free(seq)
            else:
                self.book.prefilled(seq.req_id)
        if deltas:
            self.w.send(StepOutput(self.w.worker_id, deltas))
        self.dispatch_held()
        return True

    def _reserve(self, chunk: ChunkPlan) -> tuple[ChunkPlan, list[ScheduledSeq]]:
        """Blocks for every request the chunk starts. The chunker counted free blocks, but
        extents pinned by un-acked hand-offs can split them into runs too short: the chunk then
        stops before the first request that does not fit (no overtaking) and it waits."""
        items = []
        for i, piece in enumerate(chunk.slices):
            seq = self.book.get(piece.req_id)
            if piece.is_first and not self.w.kv.reserve(seq, seq.num_prompt):
                return chunk.prefix(i), items
            items.append(ScheduledSeq(seq, piece.num_tokens))
        return chunk, items

    def dispatch_held(self) -> None:
        for seq, plan in self.book.dispatch():
            self.w.decisions.record("dispatch", req=seq.req_id, to=plan.decode_worker,
                                    blocks=plan.num_blocks, heavy=plan.heavy)
            self.w.kv.pin(seq)  # the decode worker reads these block ids until KVPulled
            self.w.send(Handoff(seq.req_id, self.w.worker_id, list(seq.blocks), list(seq.token_ids),
                              seq.num_prompt, seq.params, seq.predicted_bucket,
                              seq.predicted_len, seq.arrival_s, dst_worker=plan.decode_worker))

    def load_report(self) -> LoadReport:
        a, book = self.w.allocator, self.book
        return LoadReport(worker_id=self.w.worker_id, role="prefill",
                          num_waiting=book.count(Stage.NEW, Stage.QUEUED),
                          num_running=book.count(Stage.HELD, Stage.HANDED_OFF),
                          num_queued_prompt_tokens=book.queue.num_queued_tokens,
                          num_free_blocks=a.num_free, num_total_blocks=a.num_blocks, num_heavy=0,
                          num_light=0, predicted_demand_blocks=0, busy_s=self.w.busy_s)
