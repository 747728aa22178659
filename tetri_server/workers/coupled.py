"""Coupled worker (the baselines): prefills and decodes in one step loop, planned by the same
pure policies as the disaggregated roles.

``coupled``          vLLM-like: waiting prompts run whole before decode steps (prefill-first,
                     ``policy.prefill_first_plan``).
``coupled-chunked``  Sarathi-like: prompt chunks ride along with every decode step under
                     ``prefill.token_budget`` tokens (``policy.coupled_chunked_plan``).

Prompts wait in a ``PrefillQueue``; a request whose prompt is done joins a greedy
``DecodeAdmission``, which decides the batch and its preemptions (the KV of prefilled requests
waiting for admission where it covers the shortfall, else the newest running one, or with
``decode.estimate = "refined"`` the one expected to run longest; recomputed when re-admitted).
``CoupledLoop`` is channel-free: the coupled worker and the in-process ``LLMEngine`` both run
it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tetri_server.engine.runner import ModelRunner, ScheduledSeq, StepPlan
from tetri_server.engine.sampling import make_generator
from tetri_server.engine.sequence import SeqStatus, Sequence
from tetri_server.engine.stops import DEAD_END, append_token, dead_end_failure, emit, prompt_parts
from tetri_server.kv.manager import KVCacheManager
from tetri_server.messages import (
    AddRequest,
    LoadReport,
    RequestFailed,
    SamplingParams,
    TokenDelta,
)
from tetri_server.policy import (
    ChunkSlice,
    DecodeAdmission,
    DecodeStepPlan,
    LengthTail,
    PrefillQueue,
    coupled_step_plan,
)
from tetri_server.workers.base import Role, Worker, length_tail
from tetri_server.workers.decoding import carry_out, reserve_prompts
from tetri_server.workers.trace import DecisionLog


@dataclass(frozen=True)
class CoupledStepPlan:
    """One coupled step: the decode batch (None in a prefill-only step) and prompt slices."""

    decode: DecodeStepPlan | None
    slices: tuple[ChunkSlice, ...]
    num_pad: int = 0

    @property
    def num_tokens(self) -> int:
        num_decode = 0 if self.decode is None else self.decode.num_tokens
        return num_decode + sum(p.num_tokens for p in self.slices) + self.num_pad


class CoupledLoop:
    """plan -> execute -> update over one runner and one KV pool."""

    def __init__(self, runner: ModelRunner, kv: KVCacheManager, eos_token_ids: tuple[int, ...],
                 max_model_len: int, device: torch.device, *, chunked: bool, token_budget: int,
                 max_batch: int, max_prefill_tokens: int, recompute_tokens: int = 0,
                 waiting_kv_first: bool = True, pad_chunks: bool = False,
                 decisions: DecisionLog | None = None, tail: LengthTail | None = None) -> None:
        self.runner, self.kv = runner, kv
        self.eos_token_ids = eos_token_ids
        self.max_model_len = max_model_len
        self.device = device
        self.chunked = chunked
        self.token_budget = token_budget
        self.max_batch = max_batch
        self.max_prefill_tokens = max(max_prefill_tokens, token_budget)
        self.pad_chunks = pad_chunks
        self.block_size = kv.block_size
        self.queue = PrefillQueue("fcfs")
        self.admission = DecodeAdmission(
            "greedy", block_size=kv.block_size, num_total_blocks=kv.allocator.num_blocks,
            max_batch=max_batch, tail=tail,
            recompute_chunk=recompute_tokens, waiting_kv_first=waiting_kv_first)
        self.seqs: dict[int, Sequence] = {}
        self.failed: list[RequestFailed] = []  # for the caller to report, then clear
        self.decisions = decisions or DecisionLog()
        self.last_step_ran = False  # the last step made progress (a forward, or preemptions)

    def add(self, req_id: int, prompt_ids: list[int], params: SamplingParams,
            arrival_s: float) -> None:
        seq = Sequence(req_id, list(prompt_ids), len(prompt_ids), params, arrival_s=arrival_s,
                       generator=make_generator(params.seed, self.device))
        self.seqs[req_id] = seq
        self.queue.add(req_id, seq.num_prompt, arrival_s)

    def abort(self, req_id: int) -> None:
        seq = self.seqs.pop(req_id, None)
        self.queue.remove(req_id)
        self.admission.remove(req_id)
        if seq is not None:
            seq.status = SeqStatus.FINISHED
            self.kv.free(seq)

    def has_work(self) -> bool:
        return bool(self.seqs)

    # ------------------------------------------------------------------ the step

    def plan(self) -> CoupledStepPlan:
        """This step's decisions, from the policies. Pure: nothing is reserved or changed."""
        decode, slices = coupled_step_plan(
            self.queue, self.admission, self.kv.allocator.num_free, chunked=self.chunked,
            token_budget=self.token_budget, max_batch=self.max_batch,
            max_prefill_tokens=self.max_prefill_tokens, block_size=self.block_size)
        if decode is None:
            return CoupledStepPlan(None, slices)
        num_pad = 0
        if self.pad_chunks and slices and not decode.run_ids:
            num_pad = self.token_budget - sum(p.num_tokens for p in slices)
        return CoupledStepPlan(decode, slices, max(0, num_pad))

    def step(self) -> list[TokenDelta]:
        plan = self.plan()
        self._record(plan)
        items, d = self._decode_items(plan.decode)
        num_decode = len(items)
        slices = reserve_prompts(plan.slices, self.seqs.__getitem__, self.kv, items)
        # a step that only preempted or failed requests made progress too: plan again at once
        self.last_step_ran = bool(items) or (d is not None and bool(d.preempt.req_ids
                                                                  or d.fail_ids))
        if not items:
            if d is not None:
                self.admission.on_done(d, set())
            return []
        result = self.runner.execute(StepPlan(items, plan.num_pad if slices else 0))
        deltas = prompt_parts(item.seq for item in items[num_decode:])
        finished: set[int] = set()
        for item, tok, lp in zip(items[:num_decode], result.sampled, result.logprobs,
                                 strict=False):
            if tok is None:  # a recompute with more tokens to go
                continue
            if self._append(item.seq, tok, lp, deltas):
                finished.add(item.seq.req_id)
        if d is not None:
            self.admission.on_done(d, finished)
        done = set(self.queue.advance(slices))
        for item, tok, lp in zip(items[num_decode:], result.sampled[num_decode:],
                                 result.logprobs[num_decode:], strict=True):
            seq = item.seq
            if tok is None or seq.req_id not in done:
                continue
            if not self._append(seq, tok, lp, deltas):
                seq.status = SeqStatus.RUNNING
                self.admission.add(seq.req_id, seq.num_prompt, seq.num_tokens, 0,
                                   seq.params.max_tokens)
        return deltas

    def _record(self, plan: CoupledStepPlan) -> None:
        log = self.decisions
        log.step += 1
        if not log.enabled:
            return
        d = plan.decode
        log.record("coupled_step",
                   run=[] if d is None else list(d.run_ids),
                   admit=[] if d is None else list(d.admit.req_ids),
                   recompute=[] if d is None else list(d.admit.recompute_ids),
                   preempt=[] if d is None else list(d.preempt.req_ids),
                   slices=[[p.req_id, p.start, p.num_tokens] for p in plan.slices],
                   pad=plan.num_pad, free=self.kv.allocator.num_free,
                   **({} if d is None else d.recompute_log))

    def _decode_items(self, decode: DecodeStepPlan | None
                      ) -> tuple[list[ScheduledSeq], DecodeStepPlan | None]:
        """Carry out the admission plan (preemptions, requests that can never fit, blocks);
        the items and the plan carried out."""
        if decode is None:
            return [], None
        items, dropped, decode = carry_out(decode, self.seqs, self.kv)
        self.failed += [RequestFailed(req_id, "request no longer fits the KV pool")
                        for req_id in dropped]
        return items, decode

    def _append(self, seq: Sequence, tok: int, lp: float | None,
                deltas: list[TokenDelta]) -> bool:
        """Append a sampled token; True (and freed) if the request finished."""
        reason = append_token(seq, tok, lp, self.eos_token_ids, self.max_model_len)
        if reason == DEAD_END:
            self.failed.append(dead_end_failure(seq))
        else:
            deltas.append(emit(seq, reason))
        if reason is None:
            return False
        seq.status = SeqStatus.FINISHED
        seq.finish_reason = reason
        self.kv.free(seq)
        del self.seqs[seq.req_id]
        return True

    @property
    def num_preemptions(self) -> int:
        return self.admission.load().num_preemptions


class CoupledRole(Role):
    name = "coupled"

    def __init__(self, w: Worker) -> None:
        super().__init__(w)
        cfg = w.cfg
        self.loop = CoupledLoop(
            w.runner, w.kv, w.model_spec.eos_token_ids, w.max_model_len, w.device,
            chunked=cfg.cluster.mode == "coupled-chunked", token_budget=cfg.prefill.token_budget,
            max_batch=cfg.decode.max_batch,
            max_prefill_tokens=max(w.max_model_len, cfg.prefill.token_budget),
            recompute_tokens=cfg.decode.recompute_tokens,
            waiting_kv_first=cfg.decode.waiting_kv_first, decisions=w.decisions,
            tail=length_tail(cfg, "none"))  # predicts nothing: bucket 0

    def handle(self, msg: object) -> None:
        if not isinstance(msg, AddRequest):
            return super().handle(msg)
        self.loop.add(msg.req_id, msg.prompt_ids, msg.sampling, msg.arrival_s)

    def abort(self, req_id: int) -> None:
        self.loop.abort(req_id)

    def has_work(self) -> bool:
        return self.loop.has_work()

    def step(self) -> bool:
        deltas = self.loop.step()
        for failure in self.loop.failed:
            self.w.send(failure)
        self.loop.failed.clear()
        self.w.send_deltas(deltas)
        return self.loop.last_step_ran

    def load_report(self) -> LoadReport:
        load = self.loop.admission.load()
        a = self.w.allocator
        return LoadReport(worker_id=self.w.worker_id, role="coupled",
                          num_waiting=len(self.loop.queue) + load.num_waiting,
                          num_running=load.num_running,
                          num_queued_prompt_tokens=self.loop.queue.num_queued_tokens,
                          num_free_blocks=a.num_free, num_total_blocks=a.num_blocks,
                          num_heavy=0, num_light=0, predicted_demand_blocks=0,
                          busy_s=self.w.busy_s, num_preemptions=load.num_preemptions,
                          num_kv_drops=load.num_kv_drops)
