"""The in-process engine driven below the API, for measurements: one runner step of exactly
C prompt tokens, or ``LLMEngine.step()`` over B running sequences whose KV (random values) is
already in the pool; plus the machine baselines (matmul peak, read and memcpy bandwidth) and
the model's shape in FLOPs and bytes. Used by ``tools/bench_engine.py`` and ``tetri-server sim
fit``. Imports torch: never import it from ``policy/`` or ``sim/`` at module level."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import numpy as np
import torch

from tetri_server.bench.cpu import Timer, core_busy
from tetri_server.engine.attention import ragged_attention
from tetri_server.engine.kernels import REFERENCE, Kernels, unfused_glu, unpacked_linear
from tetri_server.engine.ops.layer import silu_mul, silu_mul_ref
from tetri_server.engine.ops.linear import linear, onednn_pack_weight
from tetri_server.engine.runner import ScheduledSeq, StepPlan
from tetri_server.engine.sequence import SeqStatus
from tetri_server.engine.sequence import Sequence as Seq
from tetri_server.kv.blocks import blocks_for
from tetri_server.llm import LLMEngine, make_engine
from tetri_server.messages import SamplingParams

GREEDY = SamplingParams(max_tokens=1 << 30, temperature=0.0, ignore_eos=True)
AttentionFn = Callable[..., torch.Tensor]

# ---------------------------------------------------------------------------- CPU & timing


def pin(cpu: int | None) -> int:
    """Pin this process to one CPU (the least busy allowed one when ``cpu`` is None)."""
    allowed = sorted(os.sched_getaffinity(0))
    if cpu is None:
        busy = core_busy()
        cpu = min(allowed, key=lambda c: busy.get(c, 1.0))
    os.sched_setaffinity(0, {cpu})
    torch.set_num_threads(1)
    return cpu


# ---------------------------------------------------------------------------- baselines


def matmul_peak_gflops(timer: Timer, n: int, reps: int,
                       dtype: torch.dtype = torch.float32) -> float:
    """``torch.mm`` of n x n by n x n on the current thread count, best of ``reps``."""
    a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
    out = torch.empty(n, n, dtype=dtype)
    torch.mm(a, b, out=out)
    best = min(timer.timed(lambda: torch.mm(a, b, out=out), "baselines") for _ in range(reps))
    return 2 * n**3 / best / 1e9


def memcpy_gbps(timer: Timer, nbytes: int, reps: int) -> float:
    """``np.copyto`` of ``nbytes`` into a pre-touched destination (bytes copied per second)."""
    src = np.full(nbytes // 8, 1.0)
    dst = np.full(nbytes // 8, 2.0)  # touched: no first-touch page faults in the timing
    np.copyto(dst, src)
    best = min(timer.timed(lambda: np.copyto(dst, src), "baselines") for _ in range(reps))
    return nbytes / best / 1e9


def read_gbps(timer: Timer, nbytes: int, reps: int) -> float:
    """``torch.sum`` over ``nbytes`` of fp32 (bytes read per second): the rate a decode step's
    weight and KV reads are bounded by. A copy moves each byte twice (read, then write), so
    ``memcpy_gbps`` (bytes copied per second) is below it and a bound taken from it is too
    long: the engine once ran under its own "roofline" (0.93x)."""
    x = torch.ones(nbytes // 4)
    x.sum()
    best = min(timer.timed(x.sum, "baselines") for _ in range(reps))
    return nbytes / best / 1e9


@dataclass
class Baselines:
    timer: Timer
    dtype: torch.dtype = torch.float32
    peak_gflops: list[float] = field(default_factory=list)
    mem_gbps: list[float] = field(default_factory=list)  # memcpy: reported, and for sim profiles
    read_gbps: list[float] = field(default_factory=list)  # a read-only stream: the rooflines'

    def measure(self, quick: bool) -> None:
        reps, nbytes = (3, 256 << 20) if quick else (5, 1024 << 20)
        self.peak_gflops.append(matmul_peak_gflops(self.timer, 2048, reps, self.dtype))
        self.mem_gbps.append(memcpy_gbps(self.timer, nbytes, reps))
        self.read_gbps.append(read_gbps(self.timer, nbytes, reps))

    @property
    def peak(self) -> float:
        return max(self.peak_gflops)

    @property
    def bandwidth(self) -> float:
        """Bytes read per second: the best read-only stream of the run."""
        return max(self.read_gbps)


# ---------------------------------------------------------------------------- model shape


@dataclass(frozen=True)
class Shape:
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    matmul_params: int  # per token: all 2-D weights of the layers (+ OPT project_in/out)
    head_params: int  # LM head, per sampled row
    after_qkv_params: int  # one layer's 2-D weights past q|k|v: the last layer's, per sampled row
    weight_bytes: int  # weights a decode step reads (matmuls + head + norms/biases)
    dtype_bytes: int

    @classmethod
    def of(cls, eng: LLMEngine) -> Shape:
        s, m = eng.spec, eng.model
        per_token = sum(p.numel() for p in m.layers.parameters() if p.ndim == 2)
        per_token += sum(p.numel() for n, p in m.named_parameters()
                         if n.startswith(("project_in", "project_out")))
        small = sum(p.numel() for p in m.layers.parameters() if p.ndim == 1)
        head = m.embed.numel()
        nbytes = m.embed.element_size()
        last = m.layers[-1]
        qkv = getattr(last.qkv, "weight", last.qkv)  # llama: a parameter; OPT: a linear
        after = sum(p.numel() for p in last.parameters() if p.ndim == 2) - qkv.numel()
        return cls(s.num_layers, s.num_heads, s.num_kv_heads, s.head_dim, per_token, head, after,
                   (per_token + head + small) * nbytes, nbytes)

    def prefill_flops(self, prompt_lens: Sequence[int]) -> float:
        """The work of our prefill of these prompts in one step: every layer on every token,
        except that the last runs only each prompt's last row past its q|k|v projection
        (``BatchMetadata.sampled_only``)."""
        tokens, rows = sum(prompt_lens), len(prompt_lens)
        attn = sum(4 * self.heads * self.head_dim * n * (n + 1) / 2 for n in prompt_lens)
        last_attn = sum(4 * self.heads * self.head_dim * n for n in prompt_lens)
        return (2 * self.matmul_params * tokens - 2 * self.after_qkv_params * (tokens - rows)
                + 2 * self.head_params * rows + (self.layers - 1) * attn + last_attn)

    def decode_flops(self, batch: int, ctx: int) -> float:
        attn = self.layers * 4 * self.heads * self.head_dim * (ctx + 1)
        return batch * (2 * self.matmul_params + 2 * self.head_params + attn)

    def kv_bytes(self, batch: int, ctx: int) -> int:
        return batch * ctx * self.layers * 2 * self.kv_heads * self.head_dim * self.dtype_bytes

    def decode_phase_bound_s(self, batch: int, ctx: int, peak_gflops: float,
                             read_gbps: float) -> float:
        """A decode step's bound when its two phases run one after the other on one core:
        the linears (bound by their FLOPs or their weight bytes) plus the attention (bound by
        its FLOPs or the KV bytes). The roofline, max(all FLOPs / peak, all bytes / rate),
        assumes the linears' compute overlaps the attention's reads, which no engine that runs
        them in turn gets; where one phase is FLOPs-bound and the other bytes-bound (batch 32
        at a long context on a slow core) this bound is the longer one."""
        peak, rate = peak_gflops * 1e9, read_gbps * 1e9
        linear_flops = batch * (2 * self.matmul_params + 2 * self.head_params)
        attn_flops = self.decode_flops(batch, ctx) - linear_flops
        return (max(linear_flops / peak, self.weight_bytes / rate)
                + max(attn_flops / peak, self.kv_bytes(batch, ctx) / rate))


# ---------------------------------------------------------------------------- our engine


LinearKind = Literal["tetri", "onednn", "plain"]


class OneDNNLinear:
    """``linear`` over a oneDNN copy of each weight, made at its first use: the engine's
    linears before ``tetri::packed_linear``, kept for the benchmark's before/after."""

    def __init__(self) -> None:
        self.copies: dict[int, torch.Tensor | None] = {}

    def __call__(self, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None,
                 packed: torch.Tensor | None = None) -> torch.Tensor:
        key = w.data_ptr()
        if key not in self.copies:
            self.copies[key] = onednn_pack_weight(w)
        return linear(x, w, b, self.copies[key])


class EngineDriver:
    """One engine (pool sized for the largest decode configuration) driven below the API."""

    def __init__(self, timer: Timer, model_path: Path, max_batch: int, max_ctx: int, extra: int,
                 dtype: str = "float32", sets: Sequence[str] = ()) -> None:
        self.timer = timer
        block_size = 16
        per_seq = blocks_for(max_ctx + extra, block_size) + 1
        num_blocks = max(int(max_batch * per_seq * 1.25), blocks_for(4096, block_size) * 2)
        self.eng = make_engine(str(model_path), f"model.dtype={dtype}",
                               "cluster.mode=coupled-chunked", f"kv.block_size={block_size}",
                               f"kv.num_blocks={num_blocks}", f"decode.max_batch={max_batch}",
                               *sets)
        self.dtype = self.eng.kv.dtype
        self.shape = Shape.of(self.eng)
        self.vocab = self.eng.spec.vocab_size
        self.block_size = block_size
        self.gen = torch.Generator().manual_seed(1234)
        self.onednn = OneDNNLinear()
        self.next_id = 0
        s = self.eng.spec
        # Random KV to copy into decode sequences' extents (values do not change the timing,
        # but zeros would make attention uniform; random is closer to a real context).
        self.kv_template = torch.randn(s.num_layers, 2, s.num_kv_heads, max_ctx, s.head_dim,
                                       generator=self.gen).mul_(0.5).to(self.dtype)

    def tokens(self, n: int) -> list[int]:
        return torch.randint(3, self.vocab, (n,), generator=self.gen).tolist()

    def new_seq(self, prompt_len: int, computed: int = 0) -> Seq:
        seq = Seq(self.next_id, self.tokens(prompt_len), prompt_len, GREEDY,
                  num_computed=computed)
        self.next_id += 1
        return seq

    @contextmanager
    def kernels(self, attention: AttentionFn = ragged_attention, linears: LinearKind = "tetri",
                fused: bool = True) -> Iterator[None]:
        """The model runs ``attention``, its linears on ``linears`` (the engine's packed
        ``tetri::packed_linear``, oneDNN's prepacked matmul, or plain ``F.linear``) and the
        fused (or eager PyTorch) norm/RoPE/SiLU ops and KV write."""
        model, saved = self.eng.model, self.eng.model.kernels
        layer_ops = Kernels() if fused else REFERENCE
        lin = {"tetri": linear, "onednn": self.onednn, "plain": unpacked_linear}[linears]
        glu = layer_ops.glu if linears == "tetri" else unfused_glu(
            lin, silu_mul if fused else silu_mul_ref)
        model.kernels = dataclasses.replace(layer_ops, attention=attention, linear=lin, glu=glu)
        try:
            yield
        finally:
            model.kernels = saved

    # -- prefill: one runner step of exactly sum(prompt_lens) tokens

    @contextmanager
    def prefill(self, prompt_lens: Sequence[int]) -> Iterator[Callable[[], None]]:
        seqs = [self.new_seq(n) for n in prompt_lens]
        for seq in seqs:
            if not self.eng.kv_manager.reserve(seq, seq.num_tokens):
                raise RuntimeError("KV pool too small for the prefill benchmark")
        plan_items = [ScheduledSeq(seq, seq.num_tokens) for seq in seqs]

        def run() -> None:
            for seq in seqs:
                seq.num_computed = 0
            self.eng.runner.execute(StepPlan(list(plan_items)))

        try:
            yield run
        finally:
            for seq in seqs:
                self.eng.kv_manager.free(seq)

    # -- a prompt chunk beside decode rows: one runner step, as a prefill worker that keeps
    #    requests runs it (their rows ride in its prompt chunks)

    @contextmanager
    def mixed(self, chunk: int, rows: int, ctx: int) -> Iterator[Callable[[], None]]:
        """One step of ``chunk`` prompt tokens (none: 0) and ``rows`` decode rows, each over
        ``ctx`` tokens of KV already in the pool."""
        seqs: list[Seq] = []
        try:
            prompt = self.new_seq(chunk) if chunk else None
            if prompt is not None:
                seqs.append(prompt)
                if not self.eng.kv_manager.reserve(prompt, chunk):
                    raise RuntimeError("KV pool too small for the mixed-step benchmark")
            decodes = []
            for _ in range(rows):
                seq = self.new_seq(ctx + 1, computed=ctx)
                seq.num_prompt = ctx
                seqs.append(seq)
                if not self.eng.kv_manager.reserve(seq, ctx + 1):
                    raise RuntimeError("KV pool too small for the mixed-step benchmark")
                base = seq.blocks[0] * self.block_size
                self.eng.kv[:, :, :, base:base + ctx].copy_(self.kv_template[:, :, :, :ctx])
                decodes.append(seq)
            items = ([ScheduledSeq(prompt, chunk)] if prompt is not None else []) + [
                ScheduledSeq(seq, 1) for seq in decodes]

            def run() -> None:
                if prompt is not None:
                    prompt.num_computed = 0
                for seq in decodes:
                    seq.num_computed = ctx
                self.eng.runner.execute(StepPlan(list(items)))

            yield run
        finally:
            for seq in seqs:
                self.eng.kv_manager.free(seq)

    # -- decode: engine.step() over B running sequences with ``ctx`` tokens of KV

    @contextmanager
    def decoding(self, batch: int, ctx: int, max_steps: int) -> Iterator[Callable[[], None]]:
        eng = self.eng
        seqs: list[Seq] = []
        try:
            for _ in range(batch):
                seq = self.new_seq(ctx + 1, computed=ctx)
                seq.num_prompt = ctx  # one token already sampled: the step's input
                # Reserve the whole run up front, so no relocation lands in a timed step.
                if not eng.kv_manager.reserve(seq, ctx + max_steps + 2):
                    raise RuntimeError("KV pool too small for the decode benchmark")
                base = seq.blocks[0] * self.block_size
                eng.kv[:, :, :, base:base + ctx].copy_(self.kv_template[:, :, :, :ctx])
                seq.status = SeqStatus.RUNNING
                eng.loop.seqs[seq.req_id] = seq
                eng.loop.admission.add(seq.req_id, seq.num_prompt, seq.num_tokens, 0,
                                       seq.params.max_tokens)
                seqs.append(seq)

            def run() -> None:
                deltas = eng.step()
                if len(deltas) != batch:
                    raise RuntimeError(f"decode step returned {len(deltas)} of {batch} tokens")

            yield run
        finally:
            for seq in seqs:
                eng.abort(seq.req_id)

    def decode_step_times(self, batch: int, ctx: int, steps: int, warmup: int,
                          section: str) -> list[float]:
        with self.decoding(batch, ctx, steps + warmup) as run:
            for _ in range(warmup):
                run()
            return [self.timer.timed(run, section) for _ in range(steps)]


