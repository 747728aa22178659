"""Step scheduler of a worker that both prefills and decodes (in-process engine, coupled modes).

``coupled``  (vLLM-like): waiting prompts run whole, before any decode step (prefill-first).
``chunked``  (Sarathi-like): every step runs all decodes, then fills ``chunk_size`` tokens with
             prompt chunks (several prompts may share a step; a prompt may span several steps).
Both preempt the most recently admitted sequence (recompute) when blocks run out.
"""

from __future__ import annotations

from collections import deque

from tetri_server.engine.runner import ScheduledSeq, StepPlan
from tetri_server.engine.sequence import SeqStatus, Sequence
from tetri_server.kv.manager import KVCacheManager


class StepScheduler:
    def __init__(self, kv: KVCacheManager, mode: str = "coupled", chunk_size: int = 512,
                 max_batch: int = 32, max_prefill_tokens: int = 8192,
                 pad_chunks: bool = False) -> None:
        if mode not in ("coupled", "chunked"):
            raise ValueError(f"mode must be coupled or chunked, got {mode!r}")
        self.kv = kv
        self.mode = mode
        self.chunk_size = chunk_size
        self.max_batch = max_batch
        self.max_prefill_tokens = max(max_prefill_tokens, chunk_size)
        self.pad_chunks = pad_chunks
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # admission order: the last is preempted first
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def remove(self, seq: Sequence) -> None:
        """Forget a finished or aborted sequence and free its blocks."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.kv.free(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> StepPlan:
        if self.mode == "coupled" and self.waiting:
            plan = self._prompts(self.max_prefill_tokens, whole=True)
            if plan.items:
                return plan
        plan = StepPlan(self._decodes())
        if self.mode == "chunked":
            budget = self.chunk_size - len(plan.items)
            extra = self._prompts(budget, whole=False)
            plan.items.extend(extra.items)
            if self.pad_chunks and not any(i.seq.status is SeqStatus.RUNNING for i in plan.items):
                plan.num_pad = self.chunk_size - plan.num_tokens if plan.items else 0
        return plan

    def _decodes(self) -> list[ScheduledSeq]:
        items: list[ScheduledSeq] = []
        for seq in list(self.running[:self.max_batch]):
            if seq.status is not SeqStatus.RUNNING:
                continue  # preempted while scheduling this step
            while not self.kv.reserve(seq, seq.num_tokens):
                victim = self.running[-1]
                self._preempt(victim)
                if victim is seq:
                    break
            else:
                items.append(ScheduledSeq(seq, 1))
        return [i for i in items if i.seq.status is SeqStatus.RUNNING]

    def _prompts(self, budget: int, whole: bool) -> StepPlan:
        """Prompt work (FCFS) within ``budget`` tokens, reserving blocks as it goes."""
        items: list[ScheduledSeq] = []
        blocked = False
        for seq in self.waiting:
            if budget <= 0 or len(self.running) + len(items) >= self.max_batch:
                break
            todo = seq.num_uncomputed
            n = todo if whole else min(todo, budget)
            if whole and n > budget and items:
                break
            if blocked and not seq.blocks:
                continue  # FCFS: nobody new overtakes a sequence that is waiting for blocks
            # All of a sequence's blocks at its first chunk: partial reservations by several
            # half-prefilled sequences could otherwise deadlock the pool.
            if not self.kv.reserve(seq, seq.num_tokens):
                blocked = True
                continue
            items.append(ScheduledSeq(seq, n))
            budget -= n
        return StepPlan(items)

    def on_step_done(self, plan: StepPlan) -> None:
        """Sequences whose prompt is fully computed move from waiting to running."""
        for item in plan.items:
            seq = item.seq
            if seq.status is SeqStatus.WAITING and seq.num_uncomputed == 1:
                self.waiting.remove(seq)
                seq.status = SeqStatus.RUNNING
                self.running.append(seq)

    def _preempt(self, seq: Sequence) -> None:
        """Recompute later: free the KV, requeue at the front with all tokens as the prompt."""
        self.running.remove(seq)
        self.kv.free(seq)
        seq.num_computed = 0
        seq.status = SeqStatus.WAITING
        self.waiting.appendleft(seq)
        self.num_preemptions += 1
