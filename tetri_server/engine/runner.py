"""Model runner: turns a step plan into one forward over a packed, ragged batch and samples."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from tetri_server.engine.attention import BatchMetadata, metadata_tensors, rows_alone
from tetri_server.engine.cuda_graphs import DecodeGraphs
from tetri_server.engine.grammar import Grammars
from tetri_server.engine.loader import CausalLM
from tetri_server.engine.sampling import PromptSpan, add_prompt_logprobs, sample
from tetri_server.engine.sequence import Sequence
from tetri_server.engine.spec import ModelSpec


@dataclass
class ScheduledSeq:
    """Compute the next ``num_tokens`` uncomputed tokens of ``seq`` (a prompt chunk, or 1 for a
    decode step). Its blocks must already hold ``seq.num_computed + num_tokens`` tokens."""

    seq: Sequence
    num_tokens: int


@dataclass
class StepPlan:
    items: list[ScheduledSeq]
    num_pad: int = 0  # padding tokens after the real ones (fixed-size chunks)

    @property
    def num_tokens(self) -> int:
        return sum(i.num_tokens for i in self.items) + self.num_pad


@dataclass
class StepResult:
    """``sampled[i]`` is the new token of ``plan.items[i]``, or None when that item was a
    non-final chunk of a prompt (nothing to sample yet)."""

    sampled: list[int | None]
    logprobs: list[float | None]


class ModelRunner:
    """Owns the model and the KV pool tensor of one worker. Not thread-safe."""

    def __init__(self, model: CausalLM, spec: ModelSpec, kv: torch.Tensor, block_size: int,
                 device: torch.device, grammars: Grammars | None = None) -> None:
        self.last_plan: StepPlan | None = None
        self.grammars = grammars  # structured output; None: guided requests are refused
        self.graphs: DecodeGraphs | None = None  # decode steps replay these (engine/cuda_graphs)
        self.model = model
        self.spec = spec
        self.kv = kv
        self.block_size = block_size
        self.device = device
        # A benchmark sets these to split execute()'s time: name -> seconds, added per call.
        self.phases: dict[str, float] | None = None
        self.clock: Callable[[], float] = time.perf_counter

    def _build(self, plan: StepPlan) -> tuple[torch.Tensor, BatchMetadata, list[int], list[int],
                                              list[PromptSpan]]:
        """The batch's tensors; the rows to sample (one per item whose tokens are all computed)
        and the spans of prompt rows whose logprobs a sequence asked for (rows after those)."""
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        q_starts, q_lens, ctx_lens, kv_starts, sample_rows, sample_items = [], [], [], [], [], []
        spans: list[PromptSpan] = []
        runs: list[tuple[int, int, int]] = []  # (item, first row, rows) of each span
        now_s = time.monotonic()  # the clock control stamps arrivals with
        for n, item in enumerate(plan.items):
            seq, k = item.seq, item.num_tokens
            start, end = seq.num_computed, seq.num_computed + k
            assert end <= seq.num_tokens and k > 0, (seq.req_id, start, k, seq.num_tokens)
            base = seq.blocks[0] * self.block_size
            assert len(seq.blocks) * self.block_size >= end, "blocks not reserved"
            if seq.scheduled_s is None:
                seq.scheduled_s = now_s
            if seq.wants_prompt_logprobs:
                last = min(end, seq.num_prompt - 1)  # the row at num_prompt - 1 samples
                if last > start:
                    spans.append(PromptSpan(seq, start, len(ids), last - start))
                    runs.append((n, len(ids), last - start))
            q_starts.append(len(ids))
            q_lens.append(k)
            ctx_lens.append(end)
            kv_starts.append(base)
            ids.extend(seq.token_ids[start:end])
            positions.extend(range(start, end))
            slots.extend(range(base + start, base + end))
            if end == seq.num_tokens:
                sample_rows.append(len(ids) - 1)
                sample_items.append(n)
        ids.extend([0] * plan.num_pad)
        positions.extend([0] * plan.num_pad)
        dev = self.device
        meta = BatchMetadata(
            q_starts=q_starts, q_lens=q_lens, ctx_lens=ctx_lens, kv_starts=kv_starts,
            slot_mapping=torch.tensor(slots, dtype=torch.long, device=dev),
            positions=torch.tensor(positions, dtype=torch.long, device=dev),
            num_real=len(slots),
            seq_tensors=metadata_tensors(q_starts, q_lens, ctx_lens, kv_starts, dev))
        # the last layer runs the rows it reads alone: the sampled rows one by one, a prompt
        # span whose logprobs were asked for as a group; with a span always, so that the rows
        # of a sequence take the same path whatever else is in the batch
        if spans or len(sample_rows) < len(slots):
            meta.sampled_only = rows_alone(meta, sample_items, runs)
        return (torch.tensor(ids, dtype=torch.long, device=dev), meta, sample_rows, sample_items,
                spans)

    @torch.inference_mode()
    def execute(self, plan: StepPlan) -> StepResult:
        """Run the forward, advance ``num_computed`` of every item, sample where a sequence's
        tokens are all computed. The caller appends the sampled tokens."""
        self.last_plan = plan  # a worker whose step raises names these requests (StepFailed)
        t = self.clock()
        logits = self._graph_forward(plan) if self.graphs is not None else None
        if logits is not None:
            items, spans = list(range(len(plan.items))), []
            t = self._lap("model forward", t)
        else:
            ids, meta, rows, items, spans = self._build(plan)
            num_sample = len(rows)
            for span in spans:  # zero cost unless a sequence asked for prompt logprobs
                rows += range(span.row, span.row + span.num_rows)
            rows_t = torch.tensor(rows, dtype=torch.long, device=self.device)
            t = self._lap("build metadata", t)
            logits = self.model(ids, meta, self.kv, rows_t)  # [num_sample + prompt rows, V]
            t = self._lap("model forward", t)
        if spans:
            add_prompt_logprobs(logits[num_sample:], spans)
            logits = logits[:num_sample]
        for item in plan.items:
            item.seq.num_computed += item.num_tokens
        sampled: list[int | None] = [None] * len(plan.items)
        logprobs: list[float | None] = [None] * len(plan.items)
        if items:
            seqs = [plan.items[n].seq for n in items]
            if any(s.params.guide is not None for s in seqs):
                if self.grammars is None:
                    raise RuntimeError("a guided request reached a runner without grammars")
                self.grammars.bind(seqs)
            toks, lps = sample(logits, seqs, self.spec.eos_token_ids)
            for j, n in enumerate(items):
                sampled[n] = toks[j]
                logprobs[n] = lps[j] if lps is not None else None
        self._lap("sample", t)
        return StepResult(sampled, logprobs)

    def _graph_forward(self, plan: StepPlan) -> torch.Tensor | None:
        """The logits of a decode step (every item one new token whose KV is the last to
        compute, no prompt logprobs) from the decode graphs, or None: run it eagerly."""
        assert self.graphs is not None
        ids, positions, slots, ctx_lens, kv_starts = [], [], [], [], []
        now_s = time.monotonic()
        for item in plan.items:
            seq = item.seq
            end = seq.num_computed + 1
            if item.num_tokens != 1 or end != seq.num_tokens or seq.wants_prompt_logprobs:
                return None
            base = seq.blocks[0] * self.block_size
            ids.append(seq.token_ids[end - 1])
            positions.append(end - 1)
            slots.append(base + end - 1)
            ctx_lens.append(end)
            kv_starts.append(base)
        if plan.num_pad:
            return None
        logits = self.graphs.forward(ids, positions, slots, ctx_lens, kv_starts)
        if logits is not None:
            for item in plan.items:
                if item.seq.scheduled_s is None:
                    item.seq.scheduled_s = now_s
        return logits

    def _lap(self, phase: str, t0: float) -> float:
        t = self.clock()
        if self.phases is not None:
            self.phases[phase] = self.phases.get(phase, 0.0) + t - t0
        return t
