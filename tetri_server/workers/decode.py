"""Decode worker (disaggregated mode): pulls handed-off KV, admits by policy, decodes in batches.

Life of a request here: Handoff -> blocks for its computed tokens -> copy from the prefill
worker's pool (one strided copy per extent) -> KVPulled (the prefill worker may now free) ->
DecodeAdmission (greedy / reserve-static / reserve-dynamic) -> one token per step until a stop.
Preempted requests lose their KV and are recomputed from their tokens when re-admitted.
"""

from __future__ import annotations

from tetri_server.engine.runner import StepPlan
from tetri_server.engine.sampling import make_generator
from tetri_server.engine.sequence import SeqStatus, Sequence
from tetri_server.engine.stops import append_token, emit
from tetri_server.messages import (
    Handoff,
    HandoffRejected,
    KVPulled,
    LoadReport,
    RequestFailed,
    StepOutput,
    TokenDelta,
)
from tetri_server.policy import DecodeAdmission
from tetri_server.workers.base import Role, Worker
from tetri_server.workers.decoding import carry_out


class DecodeRole(Role):
    name = "decode"

    def __init__(self, w: Worker) -> None:
        super().__init__(w)
        self.admission = DecodeAdmission(
            self.w.cfg.decode.policy, block_size=self.w.block_size,
            num_total_blocks=self.w.allocator.num_blocks, granularity=w.predictor().granularity,
            max_batch=self.w.cfg.decode.max_batch,
            heavy_threshold=self.w.cfg.predictor.heavy_decode_tokens)
        self.seqs: dict[int, Sequence] = {}

    def handle(self, msg: object) -> None:
        if isinstance(msg, Handoff):
            self.receive(msg)
        else:
            super().handle(msg)

    def receive(self, h: Handoff) -> None:
        """Pull the request's KV into our pool and queue it for admission."""
        seq = Sequence(h.req_id, list(h.token_ids), h.num_prompt_tokens, h.sampling,
                       arrival_s=h.arrival_s, status=SeqStatus.RUNNING,
                       generator=make_generator(h.sampling.seed, self.w.device),
                       predicted_bucket=h.predicted_bucket, predicted_len=h.predicted_len)
        seq.num_computed = seq.num_tokens - 1  # the last sampled token has no KV yet
        seq.num_emitted = seq.num_output  # the prefill worker streamed these
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
        if seq is not None:
            self.w.kv.free(seq)

    def has_work(self) -> bool:
        return bool(self.seqs)

    def step(self) -> bool:
        plan = self.admission.plan(self.w.allocator.num_free)
        log = self.w.decisions
        log.step += 1
        if log.enabled and (plan.run_ids or plan.preempt.req_ids or plan.fail_ids):
            log.record("decode_step", run=list(plan.run_ids), admit=list(plan.admit.req_ids),
                       preempt=list(plan.preempt.req_ids), fail=list(plan.fail_ids),
                       free=self.w.allocator.num_free)
        items, dropped = carry_out(plan, self.seqs, self.w.kv)
        for req_id in dropped:
            self.w.send(RequestFailed(req_id, "request no longer fits this worker's KV pool"))
        finished: set[int] = set()
        deltas: list[TokenDelta] = []
        if items:
            result = self.w.runner.execute(StepPlan(items))
            for item, tok, lp in zip(items, result.sampled, result.logprobs, strict=True):
                seq = item.seq
                assert tok is not None
                reason = append_token(seq, tok, lp, self.w.model_spec.eos_token_ids,
                                      self.w.max_model_len)
                deltas.append(emit(seq, reason))
                if reason is not None:
                    finished.add(seq.req_id)
                    self.w.kv.free(seq)
                    del self.seqs[seq.req_id]
        self.admission.on_done(plan, finished)
        if deltas:
            self.w.send(StepOutput(self.w.worker_id, deltas))
        # a step that only preempted or failed requests made progress: plan again at once
        return bool(items or plan.preempt.req_ids or plan.fail_ids)

    def load_report(self) -> LoadReport:
        load = self.admission.load()
        a = self.w.allocator
        return LoadReport(worker_id=self.w.worker_id, role="decode",
                          num_waiting=load.num_waiting, num_running=load.num_running,
                          num_queued_prompt_tokens=0, num_free_blocks=a.num_free,
                          num_total_blocks=a.num_blocks, num_heavy=load.num_heavy,
                          num_light=load.num_light,
                          predicted_demand_blocks=load.predicted_demand_blocks,
                          busy_s=self.w.busy_s, num_preemptions=load.num_preemptions)
