"""CUDA graphs of the model forward for decode steps.

A decode step launches a few kernels per layer for a handful of tokens: on a GPU the launches,
not the math, set its time. ``DecodeGraphs`` captures the forward once per batch-size bucket
at start-up (``capture``, timed and logged) over persistent input buffers, and ``forward``
replays the smallest bucket that holds a step's batch: it writes the step's tokens, positions,
KV slots and attention metadata into the buffers, pads the bucket's spare rows, replays, and
returns the real rows' logits. Prefill, mixed steps and steps that want prompt logprobs stay
eager (``graphable``); sampling runs after the forward, outside the graph.

Padding rows attend to one token of context at a scratch slot and write their K/V there: the
pool's last block, which the worker takes out of its allocator for good (``SCRATCH_BLOCKS``), so
no sequence's KV is ever touched by a padding row, and the allocator's counts (a drained
worker's free blocks, admission's total) leave it out.

What a graph holds fixed is exactly what a bucket fixes: the number of tokens and sequences
(the attention kernel's grid) and the buffers' addresses. Context lengths and pool offsets are
read from device memory by the kernels, so one capture serves every step of its bucket. The
metadata's Python lists (read only by the eager fallbacks, never by the CUDA path) are the
capture's.

``capture=False`` (CPU, and the tests of this logic) runs the same padded buffers eagerly at
every step: the bucket choice, the padding and the scratch slot are what the CPU tests check.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import torch

from tetri_server.engine.attention import BatchMetadata, ragged_attention
from tetri_server.engine.ops import ragged_attention_op
from tetri_server.kv.blocks import BlockAllocator

log = logging.getLogger("tetri.graphs")
SCRATCH_BLOCKS = 1  # taken from the end of the pool for the padding rows
BUCKET_STEPS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 224, 256)

# model(input_ids [T], meta, kv, logits_indices [S]) -> logits [S, vocab]
ForwardFn = Callable[[torch.Tensor, BatchMetadata, torch.Tensor, torch.Tensor], torch.Tensor]


def buckets(max_batch: int) -> list[int]:
    """Batch sizes that get a graph: powers of two up to 8, then steps of 8 to 32, ..., up to
    and including ``max_batch``."""
    if max_batch < 1:
        raise ValueError(f"max_batch must be >= 1, got {max_batch}")
    out = [b for b in BUCKET_STEPS if b < max_batch]
    return [*out, max_batch]


def bucket_for(n: int, sizes: list[int]) -> int | None:
    """The smallest bucket holding ``n`` rows, or None when none does."""
    for b in sizes:
        if b >= n:
            return b
    return None


class DecodeGraphs:
    """One captured forward per bucket over shared persistent buffers (sized for the largest)."""

    def __init__(self, model: ForwardFn, kv: torch.Tensor, scratch_slot: int, max_batch: int,
                 device: torch.device, capture: bool = True) -> None:
        self.model = model
        self.kv = kv
        self.scratch_slot = scratch_slot
        self.sizes = buckets(max_batch)
        self.device = device
        self.use_graphs = capture
        n = self.sizes[-1]
        # rows: ids, positions, slots, ctx_lens, kv_starts (one host-to-device copy per step)
        self.inputs = torch.zeros(5, n, dtype=torch.long, device=device)
        self.q_starts = torch.arange(n, dtype=torch.long, device=device)
        self.q_lens = torch.ones(n, dtype=torch.long, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.capture_s = 0.0
        self.inputs[2:].fill_(scratch_slot)  # capture runs on padding rows only
        self.inputs[3].fill_(1)

    def _meta(self, b: int) -> BatchMetadata:
        _, pos, slots, ctx, kv_start = self.inputs.unbind(0)
        return BatchMetadata(
            q_starts=list(range(b)), q_lens=[1] * b, ctx_lens=[1] * b,
            kv_starts=[self.scratch_slot] * b, slot_mapping=slots[:b], positions=pos[:b],
            num_real=b, seq_tensors=(self.q_starts[:b], self.q_lens[:b], ctx[:b],
                                     kv_start[:b]))

    def _run(self, b: int) -> torch.Tensor:
        return self.model(self.inputs[0, :b], self._meta(b), self.kv, self.q_starts[:b])

    @torch.inference_mode()
    def capture(self) -> float:
        """Capture every bucket (largest first, so later ones reuse its memory pool); returns
        and logs the seconds taken. Without ``use_graphs`` it captures nothing."""
        if not self.use_graphs:
            return 0.0
        t0 = time.perf_counter()
        pool = None
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            for b in reversed(self.sizes):
                self._run(b)  # warm-up: kernels compiled and autotuned outside the capture
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool, stream=stream):
                    self.outputs[b] = self._run(b)
                pool = graph.pool()
                self.graphs[b] = graph
        torch.cuda.current_stream(self.device).wait_stream(stream)
        torch.cuda.synchronize(self.device)
        self.capture_s = time.perf_counter() - t0
        log.info("captured %d decode CUDA graphs (batch %s) in %.1f s", len(self.sizes),
                 ",".join(map(str, self.sizes)), self.capture_s)
        return self.capture_s

    def forward(self, ids: list[int], positions: list[int], slots: list[int],
                ctx_lens: list[int], kv_starts: list[int]) -> torch.Tensor | None:
        """Logits [n, vocab] of a decode step of ``n = len(ids)`` sequences (one token each),
        or None when no bucket holds it (the caller runs it eagerly)."""
        n = len(ids)
        b = bucket_for(n, self.sizes)
        if b is None or n == 0:
            return None
        pad = b - n  # padding rows: token 0 at position 0, one token of context at scratch
        s = self.scratch_slot
        rows = torch.tensor([ids + [0] * pad, positions + [0] * pad, slots + [s] * pad,
                             ctx_lens + [1] * pad, kv_starts + [s] * pad], dtype=torch.long)
        self.inputs[:, :b].copy_(rows)  # one host-to-device copy
        if self.use_graphs:
            self.graphs[b].replay()
            return self.outputs[b][:n]
        return self._run(b)[:n]


def scratch_blocks(device: torch.device, cuda_graphs: bool) -> int:
    """The blocks ``decode_graphs`` will take from a pool on ``device`` (for its size checks)."""
    return SCRATCH_BLOCKS if device.type == "cuda" and cuda_graphs else 0


def graphs_unsupported(model: ForwardFn, device: torch.device) -> str | None:
    """Why a replayed graph would compute wrong tokens with this model on this device, or
    None. A replay changes only the buffers' contents, so attention must read its metadata
    from them: one ``tetri::ragged_attention`` call with a kernel for the device. The
    per-sequence fallback reads the metadata's Python lists, which stay the capture's (one
    token of context at the scratch slot): every replayed step would attend to that alone."""
    attention = getattr(getattr(model, "kernels", None), "attention", None)
    if attention is not ragged_attention:
        return "the model's attention is not the one tetri::ragged_attention call"
    if ragged_attention_op(device.type) is None:
        return (f"no tetri::ragged_attention kernel for {device.type} (Triton missing, or a "
                "GPU older than sm80)")
    return None


def decode_graphs(model: ForwardFn, kv: torch.Tensor, allocator: BlockAllocator,
                  block_size: int, max_batch: int, device: torch.device,
                  capture: bool = True) -> DecodeGraphs | None:
    """Take the scratch block from the end of the pool out of the allocator for good
    (``reserve_tail``) and capture the decode graphs (a worker calls this once, after loading
    the model and before any request); None, with a warning, where graphs would be wrong
    (``graphs_unsupported``): decode then runs eagerly."""
    reason = graphs_unsupported(model, device)
    if reason is not None:
        log.warning("CUDA graphs off: %s; decode steps run eagerly", reason)
        return None
    scratch = allocator.reserve_tail(SCRATCH_BLOCKS)
    graphs = DecodeGraphs(model, kv, scratch[0] * block_size, max_batch, device, capture)
    graphs.capture()
    return graphs
