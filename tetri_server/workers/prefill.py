"""Prefill worker (disaggregated mode): fixed-size chunked prefill, length prediction, dispatch.

Life of a request here: AddRequest -> predicted bucket -> PrefillQueue -> chunks of exactly
``chunk_size`` tokens (packed with others) -> first token sampled and streamed (TTFT) ->
dispatcher picks a decode worker -> Handoff (via control). Blocks stay held until that worker
answers KVPulled; on HandoffRejected or no room in the view the request waits for the next
DecodeView and is dispatched again. Nothing is dropped.
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
from tetri_server.policy.dispatch import Dispatcher, DispatchPlan
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
        self.queue = PrefillQueue(cfg.prefill.policy, cfg.prefill.sched_batch)
        self.chunker = Chunker(self._chunk_size, block_size=self.w.block_size)
        self.predictor = w.predictor()
        gran = self.predictor.granularity
        heavy = cfg.predictor.heavy_decode_tokens
        self.dispatcher: Dispatcher = (
            TetriDispatcher(random.Random(cfg.dispatch.seed + self.w.worker_id),
                            block_size=self.w.block_size, granularity=gran, heavy_threshold=heavy)
            if cfg.dispatch.policy == "power-of-two"
            else RoundRobinDispatcher(block_size=self.w.block_size, granularity=gran,
                                      heavy_threshold=heavy))
        self.seqs: dict[int, Sequence] = {}  # queued or prefilling
        self.unpredicted: list[tuple[Sequence, AddRequest]] = []
        self.undispatched: list[Sequence] = []  # prefilled, waiting for room on a decode worker
        # Handoff sent, with the plan that chose its decode worker; blocks pinned until KVPulled
        self.handed_off: dict[int, tuple[Sequence, DispatchPlan]] = {}
        self.await_view = False  # a hand-off was refused: dispatch again on the next view

    def chunk_size(self) -> int:
        return self._chunk_size

    # ------------------------------------------------------------------ messages

    def handle(self, msg: object) -> None:
        if isinstance(msg, AddRequest):
            seq = Sequence(msg.req_id, list(msg.prompt_ids), len(msg.prompt_ids), msg.sampling,
                           arrival_s=msg.arrival_s,
                           generator=make_generator(msg.sampling.seed, self.w.device))
            self.seqs[seq.req_id] = seq
            self.unpredicted.append((seq, msg))
        elif isinstance(msg, DecodeView):
            self.await_view = False
            if self.dispatcher.on_view(msg):
                self.dispatch_held()
        elif isinstance(msg, KVPulled):
            held = self.handed_off.pop(msg.req_id, None)
            if held is not None:
                self.w.kv.free(held[0])
        elif isinstance(msg, HandoffRejected):
            held = self.handed_off.pop(msg.req_id, None)
            if held is not None:
                seq, plan = held
                log.info("request %d rejected by decode: %s", msg.req_id, msg.reason)
                self.w.kv.unpin(seq)  # nobody reads its blocks now; a new Handoff names them anew
                self.dispatcher.on_rejected(plan)  # not counted against that worker
                self.undispatched.append(seq)
                self.await_view = True  # the view that chose that worker is stale
        else:
            super().handle(msg)

    def abort(self, req_id: int) -> None:
        held = self.handed_off.pop(req_id, None)
        seq = self.seqs.pop(req_id, None) or (held[0] if held is not None else None)
        if seq is None:
            seq = next((s for s in self.undispatched if s.req_id == req_id), None)
            if seq is not None:
                self.undispatched.remove(seq)
        self.unpredicted = [(s, m) for s, m in self.unpredicted if s.req_id != req_id]
        self.queue.remove(req_id)
        if seq is not None:
            self.w.kv.free(seq)

    # ------------------------------------------------------------------ the step

    def has_work(self) -> bool:
        return bool(self.unpredicted or len(self.queue))

    def is_drained(self) -> bool:
        return not (self.has_work() or self.undispatched or self.handed_off)

    def predict_new(self) -> None:
        """Batch-predict the output-length bucket of every newly arrived request."""
        if not self.unpredicted:
            return
        batch, self.unpredicted = self.unpredicted, []
        try:
            buckets = self.predictor.predict([m.prompt_text for _, m in batch],
                                             [m.true_output_len for _, m in batch])
        except PredictorError:
            batch, buckets = self._predict_one_by_one(batch)
        for (seq, msg), bucket in zip(batch, buckets, strict=True):
            seq.predicted_bucket = bucket
            seq.predicted_len = self.predictor.lower_bound(bucket)
            self.queue.add(seq.req_id, seq.num_prompt, msg.arrival_s)

    def _predict_one_by_one(
            self, batch: list[tuple[Sequence, AddRequest]]
    ) -> tuple[list[tuple[Sequence, AddRequest]], list[int]]:
        """A batch the predictor refused (e.g. ``oracle`` without a true length): fail the
        requests it cannot answer, keep the others."""
        kept, buckets = [], []
        for seq, msg in batch:
            try:
                buckets += self.predictor.predict([msg.prompt_text], [msg.true_output_len])
                kept.append((seq, msg))
            except PredictorError as e:
                del self.seqs[seq.req_id]
                self.w.send(RequestFailed(seq.req_id, f"length predictor: {e}"))
        return kept, buckets

    def step(self) -> bool:
        self.predict_new()
        chunk = self.chunker.plan(self.queue, self.w.allocator.num_free)
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
        done = set(self.chunker.on_done(self.queue, chunk))
        deltas = []
        for item, tok, lp in zip(items, result.sampled, result.logprobs, strict=True):
            seq = item.seq
            if tok is None or seq.req_id not in done:
                continue
            reason = append_token(seq, tok, lp, self.w.model_spec.eos_token_ids,
                                  self.w.max_model_len)
            deltas.append(emit(seq, reason))
            del self.seqs[seq.req_id]
            if reason is not None:
                self.w.kv.free(seq)
            else:
                self.undispatched.append(seq)
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
            seq = self.seqs[piece.req_id]
            if piece.is_first and not self.w.kv.reserve(seq, seq.num_prompt):
                kept = chunk.slices[:i]
                num_real = sum(p.num_tokens for p in kept)
                return ChunkPlan(kept, chunk.chunk_size - num_real, chunk.chunk_size), items
            items.append(ScheduledSeq(seq, piece.num_tokens))
        return chunk, items

    def dispatch_held(self) -> None:
        if self.await_view:
            return
        still: list[Sequence] = []
        for seq in self.undispatched:
            plan = self.dispatcher.plan(seq.req_id, seq.num_prompt, seq.predicted_bucket)
            if plan is None:
                still.append(seq)
                continue
            self.handed_off[seq.req_id] = (seq, plan)
            self.w.decisions.record("dispatch", req=seq.req_id, to=plan.decode_worker,
                                    blocks=plan.num_blocks, heavy=plan.heavy)
            self.w.kv.pin(seq)  # the decode worker reads these block ids until KVPulled
            self.w.send(Handoff(seq.req_id, self.w.worker_id, list(seq.blocks), list(seq.token_ids),
                              seq.num_prompt, seq.params, seq.predicted_bucket,
                              seq.predicted_len, seq.arrival_s, dst_worker=plan.decode_worker))
        self.undispatched = still

    def load_report(self) -> LoadReport:
        held = len(self.undispatched) + len(self.handed_off)
        a = self.w.allocator
        return LoadReport(worker_id=self.w.worker_id, role="prefill",
                          num_waiting=len(self.queue) + len(self.unpredicted), num_running=held,
                          num_queued_prompt_tokens=self.queue.num_queued_tokens,
                          num_free_blocks=a.num_free, num_total_blocks=a.num_blocks, num_heavy=0,
                          num_light=0, predicted_demand_blocks=0, busy_s=self.w.busy_s)
