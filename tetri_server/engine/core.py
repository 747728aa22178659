"""The step loop of a worker that both prefills and decodes: requests in, token deltas out.
Used by the in-process ``LLMEngine`` and by the coupled baseline worker."""

from __future__ import annotations

import torch

from tetri_server.engine.runner import ModelRunner
from tetri_server.engine.sampling import make_generator
from tetri_server.engine.scheduler import StepScheduler
from tetri_server.engine.sequence import SeqStatus, Sequence
from tetri_server.engine.stops import append_token, emit
from tetri_server.kv.manager import KVCacheManager
from tetri_server.messages import SamplingParams, TokenDelta


class CoupledCore:
    """schedule -> execute -> update, over one runner and one KV pool."""

    def __init__(self, runner: ModelRunner, kv: KVCacheManager, eos_token_ids: tuple[int, ...],
                 max_model_len: int, scheduler: StepScheduler, device: torch.device) -> None:
        self.runner = runner
        self.kv = kv
        self.eos_token_ids = eos_token_ids
        self.max_model_len = max_model_len
        self.scheduler = scheduler
        self.device = device
        self.seqs: dict[int, Sequence] = {}
        self.last_step_ran = False  # the last step() ran a forward

    def add(self, req_id: int, prompt_ids: list[int], params: SamplingParams,
            arrival_s: float) -> None:
        seq = Sequence(req_id, list(prompt_ids), len(prompt_ids), params, arrival_s=arrival_s,
                       generator=make_generator(params.seed, self.device))
        self.seqs[req_id] = seq
        self.scheduler.add(seq)

    def abort(self, req_id: int) -> None:
        seq = self.seqs.pop(req_id, None)
        if seq is not None:
            seq.status = SeqStatus.FINISHED
            self.scheduler.remove(seq)

    def has_work(self) -> bool:
        return self.scheduler.has_work()

    def step(self) -> list[TokenDelta]:
        plan = self.scheduler.schedule()
        self.last_step_ran = bool(plan.items)
        if not plan.items:
            if self.scheduler.waiting and not self.scheduler.running:
                raise RuntimeError("no request fits in the KV pool")
            return []
        result = self.runner.execute(plan)
        deltas: list[TokenDelta] = []
        for item, tok, lp in zip(plan.items, result.sampled, result.logprobs, strict=True):
            if tok is None:
                continue
            seq = item.seq
            reason = append_token(seq, tok, lp, self.eos_token_ids, self.max_model_len)
            deltas.append(emit(seq, reason))
            if reason is not None:
                seq.status = SeqStatus.FINISHED
                seq.finish_reason = reason
                self.scheduler.remove(seq)
                del self.seqs[seq.req_id]
        self.scheduler.on_step_done(plan)
        return deltas
