"""Coupled worker (the baselines): prefills and decodes in one step loop.

``coupled``          vLLM-like: waiting prompts run whole before decode steps (prefill-first).
``coupled-chunked``  Sarathi-like: prompt chunks ride along with every decode step under
                     ``prefill.token_budget`` tokens.
"""

from __future__ import annotations

from tetri_server.engine.core import CoupledCore
from tetri_server.engine.scheduler import StepScheduler
from tetri_server.messages import AddRequest, LoadReport, StepOutput
from tetri_server.workers.base import Role, Worker


class CoupledRole(Role):
    name = "coupled"

    def __init__(self, w: Worker) -> None:
        super().__init__(w)
        cfg = w.cfg
        chunked = cfg.cluster.mode == "coupled-chunked"
        scheduler = StepScheduler(
            w.kv, "chunked" if chunked else "coupled", chunk_size=cfg.prefill.token_budget,
            max_batch=cfg.decode.max_batch,
            max_prefill_tokens=max(w.max_model_len, cfg.prefill.token_budget))
        self.core = CoupledCore(w.runner, w.kv, w.model_spec.eos_token_ids, w.max_model_len,
                                scheduler, w.device)

    def handle(self, msg: object) -> None:
        if not isinstance(msg, AddRequest):
            return super().handle(msg)
        self.core.add(msg.req_id, msg.prompt_ids, msg.sampling, msg.arrival_s)

    def abort(self, req_id: int) -> None:
        self.core.abort(req_id)

    def has_work(self) -> bool:
        return self.core.has_work()

    def step(self) -> bool:
        deltas = self.core.step()
        if deltas:
            self.w.send(StepOutput(self.w.worker_id, deltas))
        return self.core.last_step_ran

    def load_report(self) -> LoadReport:
        s = self.core.scheduler
        queued = sum(q.num_uncomputed for q in s.waiting)
        a = self.w.allocator
        return LoadReport(self.w.worker_id, self.name, len(s.waiting), len(s.running), queued,
                          a.num_free, a.num_blocks, 0, 0, 0, self.w.busy_s, s.num_preemptions)
