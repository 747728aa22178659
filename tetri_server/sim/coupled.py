"""The simulated coupled instance: ``CoupledLoop`` (``workers/coupled.py``) over a simulated
pool. It plans with the same ``policy.coupled_step_plan`` (``tests/unit/test_sim_golden.py``
holds it to the real loop's golden decision traces)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from tetri_server.messages import LoadReport
from tetri_server.policy import (
    DecodeAdmission,
    DecodeStepPlan,
    PrefillQueue,
    coupled_step_plan,
)
from tetri_server.policy.chunker import ChunkSlice
from tetri_server.sim.instances import SimRequest, SimSeq, _Decoding, slice_list

if TYPE_CHECKING:
    from tetri_server.sim.cluster import Simulation


class CoupledInstance(_Decoding):
    """``CoupledLoop``: a PrefillQueue and a greedy DecodeAdmission in one step loop;
    prefill-first whole prompts (vLLM-like) or chunks riding on decode steps (Sarathi-like)."""

    role = "coupled"

    def __init__(self, sim: Simulation, worker_id: int, num_blocks: int, *,
                 chunked: bool) -> None:
        super().__init__(sim, worker_id, num_blocks)
        cfg = sim.cfg
        self.chunked = chunked
        self.token_budget = cfg.token_budget
        self.max_batch = cfg.max_batch
        self.max_prefill_tokens = max(cfg.max_model_len, cfg.token_budget)
        self.queue = PrefillQueue("fcfs")
        self.admission = DecodeAdmission(
            "greedy", block_size=self.block_size, num_total_blocks=num_blocks,
            max_batch=cfg.max_batch, tail=sim.length_tail("none"),  # predicts nothing
            recompute_chunk=cfg.recompute_tokens, waiting_kv_first=cfg.waiting_kv_first)
        self.seqs = {}
        self._step: tuple[DecodeStepPlan | None, tuple[ChunkSlice, ...]] | None = None

    def handle(self, msg: tuple[Any, ...]) -> None:
        if msg[0] != "add":
            return super().handle(msg)
        req: SimRequest = msg[1]
        self.seqs[req.req_id] = SimSeq(req, req.prompt_len)
        self.queue.add(req.req_id, req.prompt_len, req.arrival_s)

    def plan(self) -> tuple[DecodeStepPlan | None, tuple[ChunkSlice, ...]]:
        """The coupled worker's plan (``policy.coupled_step_plan``), over the simulated pool."""
        return coupled_step_plan(self.queue, self.admission, self.alloc.num_free,
                                 chunked=self.chunked, token_budget=self.token_budget,
                                 max_batch=self.max_batch,
                                 max_prefill_tokens=self.max_prefill_tokens,
                                 block_size=self.block_size)

    def start_step(self) -> float | None:
        free = self.alloc.num_free
        decode, planned = self.plan()
        self.num_planned += 1
        if self.decisions is not None:
            d = decode
            self.record("coupled_step", run=[] if d is None else list(d.run_ids),
                        admit=[] if d is None else list(d.admit.req_ids),
                        recompute=[] if d is None else list(d.admit.recompute_ids),
                        preempt=[] if d is None else list(d.preempt.req_ids),
                        slices=slice_list(planned), pad=0, free=free,
                        **({} if d is None else d.recompute_log))
        items = [] if decode is None else self.decode_items(decode)
        num_sampled = 0 if decode is None else self.num_sampled(decode)
        slices = self.reserve_slices(planned, items)
        if not items:
            if decode is not None:
                self.admission.on_done(decode, set())
                self.replan = bool(decode.preempt.req_ids or decode.fail_ids)
            return None
        self._step = (decode, slices)
        return self.cost.step_s(items, 0, num_sampled + sum(p.is_last for p in slices))

    def finish_step(self) -> None:
        assert self._step is not None
        (decode, slices), self._step = self._step, None
        if decode is not None:
            self.decode_done(decode)
        self.prompts_done(self.queue.advance(slices), predicted=False)  # greedy admission

    def load_report(self) -> LoadReport:
        load = self.admission.load()
        return LoadReport(worker_id=self.worker_id, role="coupled",
                          num_waiting=len(self.queue) + load.num_waiting,
                          num_running=load.num_running,
                          num_queued_prompt_tokens=self.queue.num_queued_tokens,
                          num_free_blocks=self.alloc.num_free,
                          num_total_blocks=self.alloc.num_blocks, num_heavy=0, num_light=0,
                          predicted_demand_blocks=0, busy_s=self.busy_s,
                          num_preemptions=load.num_preemptions,
                          num_kv_drops=load.num_kv_drops)
