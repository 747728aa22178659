"""Engine benchmark: our model runner and engine against the machine and against transformers.

    .venv/bin/python tools/bench_engine.py [--family llama|opt] [--quick] [--profile]
        [--dtype float32|bfloat16] [--clock cpu|wall] [--keep-freed-memory] [--cpu N]
        [--skip prefill,decode,attention,mixed,layout]

Everything runs on ONE core (``sched_setaffinity``) and one torch thread. Because the dev machine
is shared, the machine baselines are measured in the same run (at the start and again at the
end), every comparison is between numbers measured side by side (interleaved round robin), and
times are process CPU time by default (``--clock cpu``): time slices that other processes take
from our core are not counted, cache and memory-bandwidth interference still is. Each section
prints the CPU share it got (CPU time / wall time; below ~0.9 the core was shared) and the part
of its CPU time spent in the kernel (mostly first-touch page faults of freshly mapped memory).

Sections (markdown on stdout, progress on stderr):

1. Baselines: matmul peak (``torch.mm`` of 2048x2048 matrices, best of N), read bandwidth
   (``torch.sum`` over ~1 GiB, best of N: the rooflines' bytes rate) and memcpy bandwidth
   (``np.copyto`` of ~1 GiB into a pre-touched destination, best of N; reported only).
2. Prefill: one step of exactly ``C`` tokens through ``ModelRunner.execute`` for C in 32..2048,
   (a) prompts of 128 tokens packed into the step (a TetriInfer chunk) and (b) one prompt of C
   tokens, against transformers' forward of the same C tokens as one sequence. Achieved GFLOP/s
   counts 2 x matmul parameters x tokens (+ the LM head for the sampled rows) + causal attention
   (4 x heads x head_dim x L(L+1)/2 per layer and prompt). "matmul-only" times just the step's
   matmuls, run as the engine runs them (an upper bound for us). The knee is
   ``tetri_server.policy.knee.pick_chunk_size`` over the packed times.
3. Decode: ``LLMEngine.step()`` over B running sequences whose KV (random values) is already in
   the pool, against ``generate()`` (greedy) on the same model and batch. transformers gets a
   real prefix cache (one forward of the prompt, repeated over the batch of equal-length
   prompts, so no padding is needed) and every timed step of ``generate()`` is a decode step;
   its step times are the intervals between calls of a LogitsProcessor. Both report the median
   step. GB/s = (weights + KV read per step) / step; the roofline is max(FLOPs / matmul peak,
   bytes / read bandwidth).
4. Before/after: the engine decode step at batch 32 (and the prefill step at the knee) with
   the old per-sequence SDPA loop and F.linear (before), the one ``tetri::ragged_attention`` op
   per layer, + prepacked oneDNN linears, + the fused layer ops, and + ``tetri::packed_linear``
   instead of oneDNN (after, what the engine runs),
   interleaved, each against the roofline of section 3.
5. Mixed: one runner step of a prompt chunk (128 tokens and the knee) alone, beside 16 decode
   rows of 250 or 500 tokens of context (a prefill worker's kept requests), and those rows
   alone: what the rows add to a prompt's step is mostly their K/V read from memory.
6. KV layout: the same engine decode step with attention over zero-copy extent views (ours),
   vs gathering each sequence's blocks into a contiguous tensor first (``index_select``, what a
   paged layout without a paged-attention kernel does), vs gathering the whole batch into one
   padded tensor and running one SDPA per layer.

``--profile`` adds a per-phase breakdown of the engine step (wrapper timers) and torch.profiler's
top ops for decode at B=32 and for the prefill at the knee. ``--keep-freed-memory`` re-runs the
benchmark under GLIBC_TUNABLES that keep freed memory in the heap.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import datetime
import inspect
import os
import platform
import resource
import statistics
import sys
import time
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from tetri_server.bench.cpu import Timer, core_busy
from tetri_server.bench.engine_driver import AttentionFn, Baselines, LinearKind, Shape, pin
from tetri_server.bench.engine_driver import EngineDriver as Ours
from tetri_server.bench.phases import INSIDE_FORWARD, engine_phases
from tetri_server.engine.attention import BatchMetadata, paged_attention, ragged_attention
from tetri_server.engine.ops.linear import linear, pack_weight
from tetri_server.engine.runner import ScheduledSeq, StepPlan
from tetri_server.kv.blocks import blocks_for

ROOT = Path(__file__).resolve().parents[1]
# Freed blocks up to 256 MiB stay in the heap and the heap is trimmed only above 1 GiB, so the
# forward's large temporaries reuse already-faulted pages instead of fresh mmap'd memory.
KEEP_FREED_MEMORY = ("glibc.malloc.mmap_threshold=268435456:"
                     "glibc.malloc.trim_threshold=1073741824")


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


# ---------------------------------------------------------------------------- transformers


class StepTimer:
    """A LogitsProcessor that only records when each generation step's logits are ready."""

    def __init__(self) -> None:
        self.stamps: list[float] = []
        self.cpu: list[float] = []
        self.sys: list[float] = []

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        self.stamps.append(time.perf_counter())
        self.cpu.append(time.process_time())
        self.sys.append(resource.getrusage(resource.RUSAGE_SELF).ru_stime)
        return scores


class HF:
    def __init__(self, timer: Timer, model_path: Path,
                 dtype: torch.dtype = torch.float32) -> None:
        from transformers import AutoModelForCausalLM

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            self.model = AutoModelForCausalLM.from_pretrained(str(model_path),
                                                              dtype=dtype)
        self.model.eval()
        params = inspect.signature(self.model.forward).parameters
        self.cache_kw = "cache" if "cache" in params else "past_key_values"
        self.pad_id = self.model.generation_config.pad_token_id
        self.prefix: dict[int, tuple[torch.Tensor, Any]] = {}
        self.timer = timer

    @torch.inference_mode()
    def forward(self, ids: torch.Tensor) -> None:
        """One prefill forward of ``ids`` [1, C] (logits of the last token only, like ours)."""
        self.model(ids, use_cache=False, logits_to_keep=1)

    def forward_fn(self, ids: torch.Tensor) -> Callable[[], None]:
        return lambda: self.forward(ids)

    @torch.inference_mode()
    def prefix_cache(self, ids: torch.Tensor) -> Any:
        out = self.model(ids, use_cache=True)
        cache = getattr(out, "cache", None)
        return cache if cache is not None else out.past_key_values

    def decode_step_times(self, batch: int, ctx: int, new_tokens: int, vocab: int,
                          section: str) -> list[float]:
        """``generate()`` on B copies of a ctx-token prompt whose KV is already cached: every
        step is a decode step. Returns the intervals between successive steps' logits."""
        if ctx not in self.prefix:
            gen = torch.Generator().manual_seed(ctx)
            ids = torch.randint(3, vocab, (1, ctx + 1), generator=gen)
            self.prefix[ctx] = (ids, self.prefix_cache(ids[:, :ctx]))
        ids, base = self.prefix[ctx]
        cache = copy.deepcopy(base)
        cache.batch_repeat_interleave(batch)
        timer = StepTimer()
        with warnings.catch_warnings(), torch.inference_mode():
            warnings.simplefilter("ignore")
            self.model.generate(
                ids.repeat(batch, 1), attention_mask=torch.ones(batch, ctx + 1, dtype=torch.long),
                max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                logits_processor=[timer], pad_token_id=self.pad_id, **{self.cache_kw: cache})
        del cache
        self.timer.account(section, timer.stamps[-1] - timer.stamps[0],
                           timer.cpu[-1] - timer.cpu[0], timer.sys[-1] - timer.sys[0])
        stamps = timer.cpu if self.timer.kind == "cpu" else timer.stamps
        return [b - a for a, b in zip(stamps, stamps[1:], strict=False)]


# ---------------------------------------------------------------------------- gather variant


def make_gather_attention(block_size: int) -> AttentionFn:
    """``paged_attention`` as a paged layout without a kernel must do it: per sequence, gather
    its blocks (``index_select`` by block table) into a contiguous tensor, then SDPA. The
    block tables are built once per forward (not per layer), as a real implementation would."""
    last: list[Any] = [None, None]  # (meta, tables) of the current forward

    def gather_attention(q: torch.Tensor, pool_k: torch.Tensor, pool_v: torch.Tensor,
                         meta: BatchMetadata, scale: float | None = None,
                         window: int = 0) -> torch.Tensor:
        assert window == 0, "the gather variants have no sliding window"
        if last[0] is not meta:
            last[0] = meta
            last[1] = [torch.arange(ks // block_size, ks // block_size
                                    + blocks_for(ctx, block_size))
                       for ks, ctx in zip(meta.kv_starts, meta.ctx_lens, strict=True)]
        tables: list[torch.Tensor] = last[1]
        heads, pool_tokens, dim = pool_k.shape
        pk = pool_k.view(heads, pool_tokens // block_size, block_size, dim)
        pv = pool_v.view(heads, pool_tokens // block_size, block_size, dim)
        out = torch.zeros_like(q)
        gqa = q.shape[1] != heads
        for qs, ql, ctx, table in zip(meta.q_starts, meta.q_lens, meta.ctx_lens, tables,
                                      strict=True):
            qi = q[qs:qs + ql].transpose(0, 1).unsqueeze(0)
            ki = pk.index_select(1, table).view(1, heads, -1, dim)[:, :, :ctx]
            vi = pv.index_select(1, table).view(1, heads, -1, dim)[:, :, :ctx]
            if ql == 1:
                o = F.scaled_dot_product_attention(qi, ki, vi, scale=scale, enable_gqa=gqa)
            elif ql == ctx:
                o = F.scaled_dot_product_attention(qi, ki, vi, is_causal=True, scale=scale,
                                                   enable_gqa=gqa)
            else:
                o = F.scaled_dot_product_attention(
                    qi, ki, vi, attn_mask=meta.mask(ql, ctx, q.device), scale=scale,
                    enable_gqa=gqa)
            out[qs:qs + ql] = o[0].transpose(0, 1)
        return out

    return gather_attention


def make_batched_gather(block_size: int) -> AttentionFn:
    """Decode-only batches: gather every sequence's context into one padded
    ``[B, heads, max_ctx, D]`` tensor (one index_select per layer) and run ONE masked SDPA
    per layer, as a padded-batch engine does. Mixed batches fall back to per-sequence gather."""
    per_seq = make_gather_attention(block_size)
    last: list[Any] = [None, None, None]  # (meta, token index [B * max_ctx], mask)

    def batched_gather(q: torch.Tensor, pool_k: torch.Tensor, pool_v: torch.Tensor,
                       meta: BatchMetadata, scale: float | None = None,
                       window: int = 0) -> torch.Tensor:
        assert window == 0, "the gather variants have no sliding window"
        if any(n != 1 for n in meta.q_lens) or meta.num_real != q.shape[0]:
            return per_seq(q, pool_k, pool_v, meta, scale)
        b = len(meta.ctx_lens)
        if last[0] is not meta:
            width = max(meta.ctx_lens)
            pos = torch.arange(width)
            starts = torch.tensor(meta.kv_starts)[:, None]
            lens = torch.tensor(meta.ctx_lens)[:, None]
            valid = pos[None, :] < lens  # [B, width]
            last[0] = meta
            last[1] = torch.where(valid, starts + pos[None, :], starts).reshape(-1)
            last[2] = valid[:, None, None, :]  # [B, 1, 1, width], broadcast over heads
        index, mask = last[1], last[2]
        heads, _, dim = pool_k.shape
        k = pool_k.index_select(1, index).view(heads, b, -1, dim).transpose(0, 1)
        v = pool_v.index_select(1, index).view(heads, b, -1, dim).transpose(0, 1)
        o = F.scaled_dot_product_attention(q.unsqueeze(2), k, v, attn_mask=mask, scale=scale,
                                           enable_gqa=q.shape[1] != heads)
        return o.squeeze(2)

    return batched_gather


# ---------------------------------------------------------------------------- helpers


def packed_lens(total: int, pack_len: int) -> list[int]:
    """Split ``total`` tokens into prompts of ``pack_len`` (the last one shorter)."""
    lens = [pack_len] * (total // pack_len)
    if total % pack_len:
        lens.append(total % pack_len)
    return lens


def linear_only(ours: Ours, tokens: int, sampled: int) -> Callable[[], None]:
    """The matmuls of one forward of ``tokens`` tokens as the engine runs them (prepacked where
    it does; activations random)."""
    m = ours.eng.model
    mats = [(p, pack_weight(p)) for p in m.layers.parameters() if p.ndim == 2]
    xs = {p.shape[1]: torch.randn(tokens, p.shape[1], dtype=p.dtype) for p, _ in mats}
    xh = torch.randn(sampled, m.embed.shape[1], dtype=m.embed.dtype)
    head = pack_weight(m.embed)

    def run() -> None:
        with torch.inference_mode():
            for p, packed in mats:
                linear(xs[p.shape[1]], p, None, packed)
            linear(xh, m.embed, None, head)

    return run


def knee_of(samples: list[tuple[int, float]]) -> int:
    try:
        from tetri_server.policy.knee import pick_chunk_size
    except ImportError:  # inline fallback: smallest size within 5% of the best throughput
        best = max(n / s for n, s in samples)
        return min(n for n, s in samples if n / s >= 0.95 * best)
    return pick_chunk_size(samples)


# ---------------------------------------------------------------------------- sections


@dataclass
class Params:
    chunk_sizes: list[int]
    batches: list[int]
    contexts: list[int]
    prefill_reps: int
    decode_steps: int
    decode_warmup: int
    hf_new_tokens: int
    layout_steps: int
    pack_len: int
    layout_configs: list[tuple[int, int]]
    mixed_contexts: tuple[int, ...] = (250, 500)


FULL = Params([32, 64, 128, 256, 512, 1024, 2048], [1, 4, 16, 32, 64], [128, 1024],
              prefill_reps=3, decode_steps=12, decode_warmup=2, hf_new_tokens=16,
              layout_steps=10, pack_len=128, layout_configs=[(16, 1024), (32, 128)])
QUICK = Params([32, 128, 512, 2048], [1, 32], [128, 1024], prefill_reps=2, decode_steps=5,
               decode_warmup=1, hf_new_tokens=6, layout_steps=5, pack_len=128,
               layout_configs=[(16, 1024)])


# A section measures, then returns its table as a function: main renders every table after the
# end-of-run baselines, so that each ratio to the matmul peak or read bandwidth is to the
# highest of the start and end measurements (the header's promise), not to the start's alone.
Table = Callable[[], tuple[list[str], Any]]


def bench_prefill(ours: Ours, hf: HF, base: Baselines, p: Params) -> tuple[Table, int]:
    sh = ours.shape
    rows: list[dict[str, float]] = []
    for c in p.chunk_sizes:
        log(f"prefill C={c}")
        lens = packed_lens(c, p.pack_len)
        ids = torch.tensor([ours.tokens(c)])
        lin = linear_only(ours, c, len(lens))
        run_hf = hf.forward_fn(ids)
        t_pack: list[float] = []
        t_one: list[float] = []
        t_hf: list[float] = []
        t_lin: list[float] = []
        with ours.prefill(lens) as run_pack, ours.prefill([c]) as run_one:
            run_pack()
            run_one()
            run_hf()
            lin()
            for _ in range(p.prefill_reps):  # round robin: all variants see the same load
                t_pack.append(ours.timer.timed(run_pack, "prefill-ours"))
                t_one.append(ours.timer.timed(run_one, "prefill-ours"))
                t_hf.append(ours.timer.timed(run_hf, "prefill-hf"))
                t_lin.append(ours.timer.timed(lin, "prefill-lin"))
        rows.append(dict(c=c, pack=min(t_pack), one=min(t_one), hf=min(t_hf), lin=min(t_lin),
                         f_pack=sh.prefill_flops(lens), f_one=sh.prefill_flops([c]),
                         f_lin=2 * sh.matmul_params * c + 2 * sh.head_params * len(lens)))
    knee = knee_of([(int(r["c"]), r["pack"]) for r in rows])
    return lambda: prefill_table(ours, base, p, rows, knee), knee


def prefill_table(ours: Ours, base: Baselines, p: Params, rows: list[dict[str, float]],
                  knee: int) -> tuple[list[str], float]:
    """The prefill table and the knee's % of the matmul peak."""
    peak = base.peak
    share = ours.timer.share_text
    out = [
        f"Prefill ({ours.timer.kind} time, best of {p.prefill_reps}): packed = prompts of "
        f"{p.pack_len} tokens packed into one step of C tokens; 1-seq = one prompt of C tokens; "
        f"matmul peak {peak:.1f} GFLOP/s; CPU share ours {share('prefill-ours')}, HF "
        f"{share('prefill-hf')}",
        "",
        "| chunk C | ours packed tok/s | GFLOP/s | % peak | matmul-only % peak "
        "| ours 1-seq tok/s | HF 1-seq tok/s | ours/HF (1-seq) |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    knee_pct = 0.0
    # The pick may fall between the sizes measured: its % is that of the next size measured.
    at = min((int(r["c"]) for r in rows if r["c"] >= knee), default=int(rows[-1]["c"]))
    for r in rows:
        c = int(r["c"])
        gf = r["f_pack"] / r["pack"] / 1e9
        if c == at:
            knee_pct = 100 * gf / peak
        mark = str(c) if c != at else f"**{c}** (knee)" if c == knee else f"**{c}** (knee {knee})"
        out.append(
            f"| {mark} | {c / r['pack']:.0f} | {gf:.1f} | {100 * gf / peak:.0f}% "
            f"| {100 * r['f_lin'] / r['lin'] / 1e9 / peak:.0f}% | {c / r['one']:.0f} "
            f"| {c / r['hf']:.0f} | {r['hf'] / r['one']:.2f}x |")
    return out, knee_pct


def bench_decode(ours: Ours, hf: HF, base: Baselines, p: Params) -> Table:
    times: list[tuple[int, int, float, float]] = []  # ctx, batch, ours, HF
    for ctx in p.contexts:
        for b in p.batches:
            log(f"decode ctx={ctx} B={b}")
            t_ours = statistics.median(ours.decode_step_times(
                b, ctx, p.decode_steps, p.decode_warmup, "decode-ours"))
            t_hf = statistics.median(hf.decode_step_times(
                b, ctx, p.hf_new_tokens, ours.vocab, "decode-hf"))
            times.append((ctx, b, t_ours, t_hf))
    return lambda: decode_table(ours, base, p, times)


def decode_table(ours: Ours, base: Baselines, p: Params,
                 times: list[tuple[int, int, float, float]]) -> tuple[list[str], dict[int, float]]:
    """The decode table and ours/HF at batch 32 per context."""
    sh = ours.shape
    rows: list[str] = []
    ratio_b32: dict[int, float] = {}
    for ctx, b, t_ours, t_hf in times:
        read = sh.weight_bytes + sh.kv_bytes(b, ctx)
        gbps = read / t_ours / 1e9
        roof = roofline_s(sh, base, b, ctx)
        if b == 32:
            ratio_b32[ctx] = t_hf / t_ours
        rows.append(
            f"| {ctx} | {b} | {1e3 * t_ours:.1f} | {b / t_ours:.0f} | {1e3 * t_hf:.1f} "
            f"| {b / t_hf:.0f} | **{t_hf / t_ours:.2f}x** | {gbps:.1f} "
            f"| {100 * gbps / base.bandwidth:.0f}% | {1e3 * roof:.1f} | {t_hf / roof:.1f}x |")
    out = [
        f"Decode: median step ({ours.timer.kind} time) of {p.decode_steps} engine.step() calls "
        f"(ours) and of the {p.hf_new_tokens - 1} step intervals of HF generate() (greedy, "
        f"prefix cached); read {base.bandwidth:.1f} GB/s; CPU share ours "
        f"{ours.timer.share_text('decode-ours')} / HF {ours.timer.share_text('decode-hf')}. "
        "Roofline = max(FLOPs / "
        "matmul peak, weight+KV bytes / read GB/s); HF/roofline bounds what any engine could "
        "gain over HF.",
        "",
        "| ctx | batch | ours step ms | ours tok/s | HF step ms | HF tok/s | ours/HF "
        "| ours GB/s read | % of read GB/s | roofline ms | HF/roofline |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
        *rows,
    ]
    return out, ratio_b32


def roofline_s(sh: Shape, base: Baselines, batch: int, ctx: int) -> float:
    """max(FLOPs / matmul peak, weight+KV bytes / read bandwidth) of one decode step."""
    read = sh.weight_bytes + sh.kv_bytes(batch, ctx)
    return max(sh.decode_flops(batch, ctx) / (base.peak * 1e9), read / (base.bandwidth * 1e9))


def bench_attention_op(ours: Ours, base: Baselines, p: Params, knee: int) -> Table:
    """Decode at batch 32 and the packed prefill at the knee, before (per-sequence SDPA loop,
    F.linear, eager norms/RoPE/SiLU) and after (one attention op per layer, prepacked linears,
    fused layer ops), adding one change at a time in between; interleaved round robin over the
    same sequences."""
    variants: list[tuple[str, AttentionFn, LinearKind, bool]] = [
        ("before", paged_attention, "plain", False), ("op", ragged_attention, "plain", False),
        ("onednn", ragged_attention, "onednn", False), ("fused", ragged_attention, "onednn", True),
        ("after", ragged_attention, "tetri", True)]

    def cells(t: dict[str, float], roof: float | None, phase: float | None = None) -> str:
        row = "".join(f"| {1e3 * t[name]:.1f} " for name, *_ in variants)
        row += f"| **{t['before'] / t['after']:.2f}x** | {t['fused'] / t['after']:.2f}x |"
        if roof is None or phase is None:
            return row + " | | | | |"
        return (row + f" {1e3 * roof:.1f} | {t['before'] / roof:.2f}x "
                f"| **{t['after'] / roof:.2f}x** | {1e3 * phase:.1f} | {t['after'] / phase:.2f}x |")

    batch = 32
    decode_med: dict[int, dict[str, float]] = {}
    for ctx in p.contexts:
        times: dict[str, list[float]] = {name: [] for name, *_ in variants}
        for _ in range(2):
            log(f"attention op and linears, before/after: decode ctx={ctx} B={batch}")
            for name, fn, linears, fused in variants:
                with ours.kernels(fn, linears, fused):
                    times[name] += ours.decode_step_times(batch, ctx, p.decode_steps,
                                                          p.decode_warmup, "attention")
        decode_med[ctx] = {name: statistics.median(ts) for name, ts in times.items()}
    log(f"attention op and linears, before/after: prefill C={knee}")
    with ours.prefill(packed_lens(knee, p.pack_len)) as run:
        times = {name: [] for name, *_ in variants}
        for _ in range(p.prefill_reps + 1):
            for name, fn, linears, fused in variants:
                with ours.kernels(fn, linears, fused):
                    times[name].append(ours.timer.timed(run, "attention"))
    prefill_best = {name: min(ts[1:]) for name, ts in times.items()}

    def table() -> tuple[list[str], tuple[dict[int, tuple[float, float]], float]]:
        rows, ratios = [], {}
        for ctx, med in decode_med.items():
            roof = roofline_s(ours.shape, base, batch, ctx)
            phase = ours.shape.decode_phase_bound_s(batch, ctx, base.peak, base.bandwidth)
            ratios[ctx] = (med["after"] / roof, med["after"] / phase)
            rows.append(f"| decode B={batch} ctx={ctx} " + cells(med, roof, phase))
        rows.append(f"| prefill C={knee} packed " + cells(prefill_best, None))
        head = [
            f"Before/after ({ours.timer.kind} time; decode median of {2 * p.decode_steps} "
            f"steps, prefill best of {p.prefill_reps}). before = per-sequence SDPA loop + "
            "F.linear + eager norms/RoPE/SiLU + `index_copy_`; op = one "
            "`tetri::ragged_attention` call per layer; onednn = + prepacked oneDNN linears; "
            "fused = + the fused layer ops (`tetri::rms_norm`, `add_rms_norm`, `rope_`, "
            "`silu_mul`, `write_kv`); after = + `tetri::packed_linear` instead of oneDNN and "
            "`tetri::packed_glu` (gate|up with SiLU-and-mul in the tile) instead of gate|up then "
            "`silu_mul` (what the engine runs). Interleaved; roofline as in the decode table; "
            "phase bound = the linears' bound (FLOPs or weight bytes) + the attention's (FLOPs "
            "or KV bytes), what one core gets running them in turn; "
            f"CPU share {ours.timer.share_text('attention')}", "",
            "| step | before ms | op ms | onednn ms | fused ms | after ms | before/after "
            "| fused/after | roofline ms | before/roofline | after/roofline | phase bound ms "
            "| after/phase bound |",
            "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
        knee_flops = ours.shape.prefill_flops(packed_lens(knee, p.pack_len))
        knee_pct = 100 * knee_flops / prefill_best["after"] / 1e9 / base.peak
        return head + rows, (ratios, knee_pct)

    return table


def bench_mixed(ours: Ours, p: Params, knee: int) -> list[str]:
    """What decode rows beside a prompt chunk add to its step: a prefill worker's kept
    requests ride in its chunks, and each adds its context's K/V reads to every step."""
    rows_n = 16
    out = [f"Prompt chunk beside decode rows: median ({ours.timer.kind} time) of "
           f"{p.prefill_reps + 1} runner steps; {rows_n} rows, each over ctx tokens of KV "
           f"({ours.shape.kv_bytes(1, 1) / 1024:.0f} KiB a token)", "",
           "| chunk | ctx | chunk alone ms | chunk + rows ms | rows add ms | rows alone ms "
           "| rows' KV MB |", "|---:|---:|---:|---:|---:|---:|---:|"]
    for chunk in sorted({128, knee}):
        for ctx in p.mixed_contexts:
            log(f"mixed C={chunk} rows={rows_n} ctx={ctx}")
            t = {}
            for name, c, r in (("alone", chunk, 0), ("both", chunk, rows_n), ("rows", 0, rows_n)):
                with ours.mixed(c, r, ctx) as run:
                    run()
                    t[name] = statistics.median(ours.timer.timed(run, "mixed")
                                                for _ in range(p.prefill_reps + 1))
            out.append(f"| {chunk} | {ctx} | {1e3 * t['alone']:.1f} | {1e3 * t['both']:.1f} "
                       f"| {1e3 * (t['both'] - t['alone']):.1f} | {1e3 * t['rows']:.1f} "
                       f"| {ours.shape.kv_bytes(rows_n, ctx) / 1e6:.0f} |")
    return out


def bench_layout(ours: Ours, p: Params) -> list[str]:
    """Decode step with three attention paths over the same pool and sequences."""
    variants: list[tuple[str, AttentionFn]] = [
        ("zero-copy extent views, one tetri::ragged_attention op per layer (ours)",
         ragged_attention),
        ("zero-copy extent views, SDPA per sequence (the old loop)", paged_attention),
        ("gather blocks per sequence (index_select), then SDPA", make_gather_attention(
            ours.block_size)),
        ("gather the batch into a padded tensor, one SDPA per layer", make_batched_gather(
            ours.block_size)),
    ]
    out = [f"KV layout: decode step ({ours.timer.kind} time, median) with each attention path over "
           f"the same pool; CPU share {{share}}", "",
           "| batch | ctx | KV MB | attention over | step ms | vs ours |",
           "|---:|---:|---:|---|---:|---:|"]
    for batch, ctx in p.layout_configs:
        check_attention(ours, [fn for _, fn in variants], batch, ctx)
        times: list[list[float]] = [[] for _ in variants]
        for _ in range(2):  # interleave the variants twice
            log(f"layout B={batch} ctx={ctx}")
            for (_, fn), ts in zip(variants, times, strict=True):
                with ours.kernels(fn):
                    ts += ours.decode_step_times(batch, ctx, p.layout_steps, 1, "layout")
        med = [statistics.median(ts) for ts in times]
        kv_mb = ours.shape.kv_bytes(batch, ctx) / 1e6
        for (name, _), t in zip(variants, med, strict=True):
            out.append(f"| {batch} | {ctx} | {kv_mb:.0f} | {name} | {1e3 * t:.1f} "
                       f"| {t / med[0]:.2f}x |")
    out[0] = out[0].format(share=ours.timer.share_text("layout"))
    return out


def check_attention(ours: Ours, fns: list[AttentionFn], batch: int, ctx: int) -> None:
    """Every variant gives the extent-view output on a real decode batch's metadata."""
    with ours.decoding(batch, ctx, 1):
        plan = StepPlan([ScheduledSeq(s, 1) for s in ours.eng.seqs.values()])
        _, meta, *_ = ours.eng.runner._build(plan)
        # ragged, all within written KV (a new metadata: its tensors follow the lists)
        meta = dataclasses.replace(meta, ctx_lens=[ctx - i % 3 for i in range(batch)],
                                   seq_tensors=())
        pk, pv = ours.eng.kv[0, 0], ours.eng.kv[0, 1]
        q = torch.randn(batch, ours.eng.spec.num_heads, ours.eng.spec.head_dim, dtype=ours.dtype)
        ref = paged_attention(q, pk, pv, meta)
        for fn in fns:
            if not torch.allclose(ref.float(), fn(q, pk, pv, meta).float(), atol=2e-2 if
                                  ours.dtype != torch.float32 else 1e-5):
                raise AssertionError(f"{fn.__name__} differs from the extent-view attention")


# ---------------------------------------------------------------------------- profiling


@contextmanager
def phase_timers(ours: Ours) -> Iterator[dict[str, float]]:
    """The runner's phases and the model's kernels timed on the tool's clock (cheap; no
    profiler)."""
    with engine_phases(ours.eng.runner, ours.timer.now) as acc:
        yield acc


def phase_rows(acc: dict[str, float], steps: int, step_s: float) -> list[str]:
    def key(item: tuple[str, float]) -> tuple[bool, float]:
        return (item[0] in INSIDE_FORWARD, -item[1])

    rows = []
    for name, s in sorted(acc.items(), key=key):
        inside = name in INSIDE_FORWARD
        label = f"&nbsp;&nbsp;↳ {name}" if inside else name
        rows.append(f"| {label} | {1e3 * s / steps:.2f} | {100 * s / steps / step_s:.0f}% |")
    return rows


def profile_section(ours: Ours, knee: int, p: Params) -> list[str]:
    from torch.profiler import ProfilerActivity, profile

    out = [f"Profile ({ours.timer.kind} time per step; the phases inside `model forward` are "
           "indented; torch.profiler's table is wall time and inflated when the core is shared)",
           ""]
    for ctx in p.contexts:
        batch = 32
        log(f"profile decode ctx={ctx} B={batch}")
        steps = 8
        with ours.decoding(batch, ctx, 2 * steps + 2) as run:
            run()
            t_step = statistics.median(ours.timer.timed(run, "profile") for _ in range(steps))
            with phase_timers(ours) as acc:
                wall = sum(ours.timer.timed(run, "profile") for _ in range(steps)) / steps
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                for _ in range(2):
                    run()
        acc["schedule and bookkeeping (step() minus the runner phases)"] = wall * steps - sum(
            v for k, v in acc.items() if k not in INSIDE_FORWARD)
        out += [f"Decode B={batch} ctx={ctx}: step {1e3 * t_step:.1f} ms unwrapped, "
                f"{1e3 * wall:.1f} ms with phase timers", "",
                "| phase | ms/step | % of step |", "|---|---:|---:|"]
        out += phase_rows(acc, steps, wall)
        out += ["", "```", prof.key_averages().table(sort_by="self_cpu_time_total",
                                                    row_limit=14), "```", ""]
    log(f"profile prefill C={knee}")
    with ours.prefill(packed_lens(knee, p.pack_len)) as run:
        run()
        with phase_timers(ours) as acc:
            wall = ours.timer.timed(run, "profile")
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            run()
    out += [f"Prefill C={knee} (packed): {1e3 * wall:.1f} ms with phase timers", "",
            "| phase | ms | % |", "|---|---:|---:|"]
    out += phase_rows(acc, 1, wall)
    out += ["", "```", prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=14),
            "```"]
    return out


# ---------------------------------------------------------------------------- main


def model_path(family: str, models_dir: Path) -> Path:
    path = models_dir / f"{family}-bench"
    if not (path / "config.json").is_file():
        from tetri_server.modelmaker import make_model

        log(f"making the {family} bench model in {path}")
        make_model(path, family, "bench")
    return path


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--family", default="llama", choices=["llama", "qwen2", "mistral", "opt"])
    ap.add_argument("--models-dir", type=Path, default=ROOT / "models")
    ap.add_argument("--quick", action="store_true", help="a 1-2 minute version")
    ap.add_argument("--cpu", type=int, default=None, help="core to pin to (default: idlest)")
    ap.add_argument("--profile", action="store_true", help="add a profile of the engine step")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--clock", default="cpu", choices=["cpu", "wall"],
                    help="cpu: process CPU time (robust when other processes share the core)")
    ap.add_argument("--keep-freed-memory", action="store_true",
                    help="re-run under GLIBC_TUNABLES that stop glibc from returning freed "
                    "memory to the OS (no first-touch page faults for big temporaries)")
    ap.add_argument("--skip", default="", help="comma list of sections to skip: "
                    "prefill,decode,attention,mixed,layout")
    args = ap.parse_args(argv)
    if args.keep_freed_memory and os.environ.get("GLIBC_TUNABLES") != KEEP_FREED_MEMORY:
        argv_now = sys.argv[1:] if argv is None else argv
        env = dict(os.environ, GLIBC_TUNABLES=KEEP_FREED_MEMORY)
        os.execve(sys.executable, [sys.executable, str(Path(__file__).resolve()), *argv_now],
                  env)
    p = QUICK if args.quick else FULL
    skip = set(filter(None, args.skip.split(",")))
    timer = Timer(kind=args.clock)

    t_start = time.perf_counter()
    busy = core_busy()
    cpu = pin(args.cpu)
    path = model_path(args.family, args.models_dir)
    log(f"pinned to cpu {cpu}; model {path}")
    dtype = getattr(torch, args.dtype)
    base = Baselines(timer, dtype)
    base.measure(args.quick)
    ours = Ours(timer, path, max(p.batches), max(p.contexts),
                max(p.decode_steps, p.layout_steps) + p.decode_warmup + 2, args.dtype)
    hf = HF(timer, path, dtype)
    sh = ours.shape

    report = [
        f"`{' '.join(['tools/bench_engine.py', *sys.argv[1:]])}` on "
        f"{datetime.date.today().isoformat()}, {platform.processor() or platform.machine()}, "
        f"ISA {torch.backends.cpu.get_cpu_capability()}, torch {torch.__version__}, "
        f"1 thread pinned to cpu {cpu}, {timer.kind} time, glibc "
        f"malloc {'tuned' if os.environ.get('GLIBC_TUNABLES') else 'default'} "
        f"(CPU busy before start: {', '.join(f'cpu{c} {100 * b:.0f}%' for c, b in busy.items())})",
        "",
        f"Model: {args.family} `bench` ({sh.layers} layers, {sh.heads} heads x {sh.head_dim}, "
        f"{sh.matmul_params / 1e6:.1f} M matmul params + {sh.head_params / 1e6:.1f} M LM head, "
        f"{args.dtype}, {sh.weight_bytes / 1e6:.0f} MB read per decode step)",
        "",
    ]
    tables: dict[str, Table] = {}  # rendered after the end-of-run baselines
    knee = 256
    if "prefill" not in skip:
        tables["knee_pct"], knee = bench_prefill(ours, hf, base, p)
    if "decode" not in skip:
        tables["ratios"] = bench_decode(ours, hf, base, p)
    if "attention" not in skip:
        tables["attn_ratios"] = bench_attention_op(ours, base, p, knee)
    later = []
    if "mixed" not in skip:
        later += bench_mixed(ours, p, knee) + [""]
    if "layout" not in skip and ours.eng.spec.sliding_window:  # the gather variants have none
        later += [f"(layout section skipped: the model has a sliding window of "
                  f"{ours.eng.spec.sliding_window}, which the gather variants do not "
                  "implement)", ""]
    elif "layout" not in skip:
        later += bench_layout(ours, p) + [""]
    base.measure(args.quick)
    results: dict[str, Any] = {}
    for key, table in tables.items():
        lines, results[key] = table()
        report += lines + [""]
    report += later
    ratios: dict[int, float] = results.get("ratios", {})
    attn_ratios: dict[int, tuple[float, float]]  # after / roofline, after / phase bound
    attn_ratios, knee_exact = results.get("attn_ratios", ({}, None))
    report[4:4] = [
        f"Baselines (start / end of the run, the max is used): {args.dtype} matmul 2048^3 "
        f"{' / '.join(f'{g:.1f}' for g in base.peak_gflops)} GFLOP/s; read (torch.sum) "
        f"{' / '.join(f'{g:.1f}' for g in base.read_gbps)} GB/s; np.copyto (reported only) "
        f"{' / '.join(f'{g:.1f}' for g in base.mem_gbps)} GB/s; CPU share "
        f"{timer.share_text('baselines')}",
        "",
    ]
    targets = []
    if "prefill" in skip:  # 256 stands in for the knee: its percentage is not a target's
        knee_exact = None
    if knee_exact is not None or "knee_pct" in results:
        # the before/after section times a step of exactly the knee; the prefill table only
        # the sizes it measures, and reads the knee's % at the next one (at least as fast)
        pct, where = ((knee_exact, "a step of exactly the knee, before/after section")
                      if knee_exact is not None else
                      (results["knee_pct"], "the next size measured, prefill table"))
        targets.append(f"prefill at the knee ({knee}) = {pct:.0f}% of matmul peak ({where}; "
                       f"target >= 90%): {'MET' if pct >= 90 else 'MISSED'}")
    for ctx, r in ratios.items():
        targets.append(f"decode at batch 32, context {ctx} = {r:.2f}x generate() (target >= 5x): "
                       f"{'MET' if r >= 5 else 'MISSED'}")
    for ctx, (r, ph) in attn_ratios.items():
        limit = 1.5 if ctx <= 128 else 1.2
        targets.append(f"decode step at batch 32, context {ctx}, after (op + packed "
                       f"linears + fused layer ops) = {r:.2f}x the roofline (target <= {limit}x): "
                       f"{'MET' if r <= limit else 'MISSED'}; {ph:.2f}x the phase bound "
                       "(linears, then attention)")
    report += ["Targets:", "", *[f"- {t}" for t in targets], ""] if targets else []
    if args.profile:
        report += profile_section(ours, knee, p) + [""]
    report.append(f"Total benchmark time {time.perf_counter() - t_start:.0f} s.")
    print("\n".join(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
