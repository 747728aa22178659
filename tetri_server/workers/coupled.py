"""Coupled worker (the baselines): prefills and decodes in one step loop.

``coupled``          vLLM-like: waiting prompts run whole before decode steps (prefill-first).
``coupled-chunked``  Sarathi-like: prompt chunks ride along with every decode step under
                     ``prefill.token_budget`` tokens.
"""

from __future__ import annotations

from tetri_server.engine.sampling import make_generator
from tetri_server.engine.scheduler import StepScheduler
from tetri_server.engine.sequence import SeqStatus, Sequence
from tetri_server.engine.stops import append_token, emit
from tetri_server.messages import AddRequest, LoadReport, StepOutput, TokenDelta
from tetri_server.workers.base import Role, Worker


class CoupledRole(Role):
    name = "coupled"

    def __init__(self, w: Worker) -> None:
        super().__init__(w)
        chunked = self.w.cfg.cluster.mode == "coupled-chunked"
        self.scheduler = StepScheduler(
            self.w.kv, "chunked" if chunked else "coupled",
            chunk_size=self.w.cfg.prefill.token_budget, max_batch=self.w.cfg.decode.max_batch,
            max_prefill_tokens=max(self.w.max_model_len, self.w.cfg.prefill.token_budget))
        self.seqs: dict[int, Sequence] = {}

    def handle(self, msg: object) -> None:
        if not isinstance(msg, AddRequest):
            return super().handle(msg)
        seq = Sequence(msg.req_id, list(msg.prompt_ids), len(msg.prompt_ids), msg.sampling,
                       arrival_s=msg.arrival_s,
                       generator=make_generator(msg.sampling.seed, self.w.device))
        self.seqs[seq.req_id] = seq
        self.scheduler.add(seq)

    def abort(self, req_id: int) -> None:
        seq = self.seqs.pop(req_id, None)
        if seq is not None:
            seq.status = SeqStatus.FINISHED
            self.scheduler.remove(seq)

    def has_work(self) -> bool:
        return self.scheduler.has_work()

    def step(self) -> None:
        plan = self.scheduler.schedule()
        if not plan.items:
            return
        result = self.w.runner.execute(plan)
        deltas: list[TokenDelta] = []
        for item, tok, lp in zip(plan.items, result.sampled, result.logprobs, strict=True):
            if tok is None:
                continue
            seq = item.seq
            reason = append_token(seq, tok, lp, self.w.model_spec.eos_token_ids,
                                  self.w.max_model_len)
            deltas.append(emit(seq, reason))
            if reason is not None:
                seq.status = SeqStatus.FINISHED
                self.scheduler.remove(seq)
                del self.seqs[seq.req_id]
        self.scheduler.on_step_done(plan)
        if deltas:
            self.w.send(StepOutput(self.w.worker_id, deltas))

    def load_report(self) -> LoadReport:
        s = self.scheduler
        queued = sum(q.num_uncomputed for q in s.waiting)
        return LoadReport(self.w.worker_id, self.name, len(s.waiting), len(s.running), queued,
                          self.w.allocator.num_free, self.w.allocator.num_blocks, 0, 0, 0,
                          self.w.busy_s, s.num_preemptions)

