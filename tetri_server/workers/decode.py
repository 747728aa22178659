"""Decode worker (disaggregated mode): pulls handed-off KV, admits by policy, decodes in batches.

Life of a request here: Handoff -> blocks for its computed tokens -> copy from the prefill
worker's pool (one strided copy per extent) -> KVPulled (the prefill worker may now free) ->
DecodeAdmission (greedy / reserve-static / reserve-dynamic) -> one token per step until a stop.
Preempted requests lose their KV and are recomputed from their tokens when re-admitted.

Elastic (``decode.local_prefill_tokens``): control may route a prompt here when it finishes
sooner here than behind the prefill side's backlog (``policy.LocalPrefill``). It waits in a FCFS
``PrefillQueue`` and its slices ride in the decode steps, at most ``local_prefill_tokens`` prompt
tokens a step and (``local_prefill_slice = "chunk"``) at most the prefill side's chunk, which
control sends with each prompt (so the batch's inter-token gap stays bounded); its first token
is streamed from here and it joins the admission like a handed-off request.
"""

from __future__ import annotations

import time

from tetri_server.engine.runner import StepPlan
from tetri_server.engine.sampling import make_generator
from tetri_server.engine.sequence import SeqStatus, Sequence
from tetri_server.engine.stops import DEAD_END, append_token, dead_end_failure, emit, prompt_parts
from tetri_server.messages import (
    AddRequest,
    Handoff,
    HandoffRejected,
    KVPulled,
    LoadReport,
    RequestFailed,
    TokenDelta,
)
from tetri_server.policy import (
    DecodeAdmission,
    LocalPrefill,
    PrefillQueue,
    StepTimes,
    coupled_chunked_plan,
    head_prompt_need,
)
from tetri_server.policy.chunker import num_blocks_for
from tetri_server.policy.prefill import ChunkSlice
from tetri_server.predictor import PredictorError
from tetri_server.workers.base import Role, Worker, length_tail
from tetri_server.workers.decoding import carry_out, reserve_prompts


class DecodeRole(Role):
    name = "decode"

    def __init__(self, w: Worker) -> None:
        super().__init__(w)
        self.admission = DecodeAdmission(
            self.w.cfg.decode.policy, block_size=self.w.block_size,
            num_total_blocks=self.w.allocator.num_blocks, granularity=w.predictor().granularity,
            max_batch=self.w.cfg.decode.max_batch,
            heavy_threshold=self.w.cfg.predictor.heavy_decode_tokens,
            tail=length_tail(w.cfg, w.cfg.predictor.kind),
            recompute_chunk=w.cfg.decode.recompute_tokens,
            waiting_kv_first=w.cfg.decode.waiting_kv_first)
        self.seqs: dict[int, Sequence] = {}  # handed off, and prompts routed here
        self.queue = PrefillQueue("fcfs")  # elastic: prompts this worker prefills itself
        self.prompt_budget = self.w.cfg.decode.local_prefill_tokens  # prompt tokens a step
        self.step_times = StepTimes()  # steps with decode rows, reported (elastic: LocalDecode)
        # prefill worker -> the last Handoff.dispatch_seq read from it (LoadReport.handoffs_read)
        self.handoffs_read: dict[int, int] = {}

    def handle(self, msg: object) -> None:
        if isinstance(msg, Handoff):
            self.receive(msg)
        elif isinstance(msg, AddRequest) and self.w.cfg.decode.local_prefill_tokens > 0:
            self.add_prompt(msg)  # (with local prefill off it would wait for good)
        else:
            super().handle(msg)

    def add_prompt(self, msg: AddRequest) -> None:
        """Elastic: a prompt to prefill here (its bucket predicted here, as a prefill worker
        would)."""
        predictor = self.w.predictor()
        try:
            [bucket] = predictor.predict([msg.prompt_text], [msg.true_output_len])
        except PredictorError as e:
            self.w.send(RequestFailed(msg.req_id, f"length predictor: {e}"))
            return
        seq = Sequence(msg.req_id, list(msg.prompt_ids), len(msg.prompt_ids), msg.sampling,
                       arrival_s=msg.arrival_s,
                       generator=make_generator(msg.sampling.seed, self.w.device),
                       predicted_bucket=bucket, predicted_len=predictor.lower_bound(bucket))
        self.seqs[seq.req_id] = seq
        self.queue.add(seq.req_id, seq.num_prompt, msg.arrival_s)
        cfg = self.w.cfg.decode
        self.prompt_budget = LocalPrefill.slice_tokens(
            cfg.local_prefill_tokens, msg.prefill_chunk, cfg.local_prefill_slice == "chunk")

    def receive(self, h: Handoff) -> None:
        """Pull the request's KV into our pool and queue it for admission."""
        if h.dispatch_seq:  # read: whatever it takes is in our reports from now on
            self.handoffs_read[h.src_worker] = h.dispatch_seq
        seq = Sequence(h.req_id, list(h.token_ids), h.num_prompt_tokens, h.sampling,
                       arrival_s=h.arrival_s, status=SeqStatus.RUNNING,
                       generator=make_generator(h.sampling.seed, self.w.device),
                       predicted_bucket=h.predicted_bucket, predicted_len=h.predicted_len)
        seq.num_computed = seq.num_tokens - 1  # the last sampled token has no KV yet
        seq.num_emitted = seq.num_output  # the prefill worker streamed these
        free = self.w.allocator.num_free - head_prompt_need(self.queue, self.w.block_size)
        if not self.admission.has_room_for(num_blocks_for(seq.num_computed, self.w.block_size),
                                           free):
            self.w.send(HandoffRejected(h.req_id, "decode worker's free blocks are its "
                                                  "running batch's next step"))
            return
        if not self.w.kv.reserve(seq, seq.num_computed):
            self.w.send(HandoffRejected(h.req_id, "decode worker has no free blocks"))
            return
        n = len(seq.blocks)
        try:
            self.w.transport.copy_blocks(h.src_worker, h.src_block_ids[:n], seq.blocks,
                                       seq.num_computed)
        except KeyError:
            self.w.kv.free(seq)
            self.w.send(HandoffRejected(h.req_id, f"pool of worker {h.src_worker} not mapped"))
            return
        self.w.send(KVPulled(h.req_id))
        self.seqs[seq.req_id] = seq
        self.admission.add(seq.req_id, seq.num_prompt, seq.num_tokens, seq.predicted_bucket,
                           seq.params.max_tokens)

    def abort(self, req_id: int) -> None:
        seq = self.seqs.pop(req_id, None)
        self.admission.remove(req_id)
        self.queue.remove(req_id)
        if seq is not None:
            self.w.kv.free(seq)

    def has_work(self) -> bool:
        return bool(self.seqs)

    def step(self) -> bool:
        free = self.w.allocator.num_free
        plan = self.admission.plan(free)
        slices: tuple[ChunkSlice, ...] = ()
        if len(self.queue):  # a recompute's tokens count against the prompt tokens
            num_prompt = max(0, self.prompt_budget - plan.num_recompute_tokens)
            slices = coupled_chunked_plan(
                self.queue, plan.run_ids, len(plan.run_ids) + num_prompt,
                num_free_blocks=self.admission.prompt_room(plan, free),
                block_size=self.w.block_size).slices
        log = self.w.decisions
        log.step += 1
        if log.enabled and (plan.run_ids or plan.preempt.req_ids or plan.fail_ids or slices):
            log.record("decode_step", run=list(plan.run_ids), admit=list(plan.admit.req_ids),
                       preempt=list(plan.preempt.req_ids), fail=list(plan.fail_ids),
                       free=free, **({"slices": [[p.req_id, p.start, p.num_tokens]
                                                 for p in slices]} if slices else {}),
                       **plan.recompute_log)
        items, dropped, plan = carry_out(plan, self.seqs, self.w.kv)
        for req_id in dropped:
            self.w.send(RequestFailed(req_id, "request no longer fits this worker's KV pool"))
        num_decode = len(items)
        slices = reserve_prompts(slices, self.seqs.__getitem__, self.w.kv, items)
        finished: set[int] = set()
        deltas: list[TokenDelta] = []
        if items:
            t0 = time.monotonic()
            result = self.w.runner.execute(StepPlan(items))
            if num_decode:  # the gap its requests see, prompt slices and all
                self.step_times.add(time.monotonic() - t0)
            for item, tok, lp in zip(items[:num_decode], result.sampled, result.logprobs,
                                     strict=False):
                seq = item.seq
                if tok is None:  # a recompute with more tokens to go
                    continue
                if self._append(seq, tok, lp, deltas):
                    finished.add(seq.req_id)
            done = set(self.queue.advance(slices)) if slices else set()
            deltas += prompt_parts(item.seq for item in items[num_decode:])
            for item, tok, lp in zip(items[num_decode:], result.sampled[num_decode:],
                                     result.logprobs[num_decode:], strict=True):
                seq = item.seq
                if tok is None or seq.req_id not in done:
                    continue
                ended = self._append(seq, tok, lp, deltas, predicted_here=True)
                if not ended:  # prefilled here: now it decodes
                    seq.status = SeqStatus.RUNNING
                    self.admission.add(seq.req_id, seq.num_prompt, seq.num_tokens,
                                       seq.predicted_bucket, seq.params.max_tokens)
        self.admission.on_done(plan, finished)
        if not len(self.admission):
            self.step_times.idle()
        self.w.send_deltas(deltas)
        # a step that only preempted or failed requests made progress: plan again at once
        return bool(items or plan.preempt.req_ids or plan.fail_ids)

    def _append(self, seq: Sequence, tok: int, lp: float | None, deltas: list[TokenDelta],
                *, predicted_here: bool = False) -> bool:
        """Append a sampled token and its delta (a prompt prefilled here, ``predicted_here``:
        with its predicted bucket); True (and freed) if the request finished (a grammar's dead
        end: failed, no delta)."""
        reason = append_token(seq, tok, lp, self.w.model_spec.eos_token_ids,
                              self.w.max_model_len)
        if reason == DEAD_END:
            self.w.send(dead_end_failure(seq))
        else:
            deltas.append(emit(seq, reason))
            if predicted_here:
                deltas[-1].predicted_bucket = seq.predicted_bucket
        if reason is None:
            return False
        self.w.kv.free(seq)
        del self.seqs[seq.req_id]
        return True

    def load_report(self) -> LoadReport:
        load = self.admission.load()
        a = self.w.allocator
        return LoadReport(worker_id=self.w.worker_id, role="decode",
                          num_waiting=load.num_waiting + len(self.queue),
                          num_running=load.num_running,
                          num_queued_prompt_tokens=self.queue.num_queued_tokens,
                          num_free_blocks=a.num_free,
                          num_total_blocks=a.num_blocks, num_heavy=load.num_heavy,
                          num_light=load.num_light,
                          predicted_demand_blocks=load.predicted_demand_blocks,
                          busy_s=self.w.busy_s, num_preemptions=load.num_preemptions,
                          num_kv_drops=load.num_kv_drops,
                          step_s=self.step_times.recent_s,
                          fastest_step_s=self.step_times.fastest_s,
                          handoffs_read=dict(self.handoffs_read))
