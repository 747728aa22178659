"""Attention over the KV pool for a packed, ragged batch.

A batch is a flat run of tokens from many sequences: prompt chunks (possibly the 2nd/3rd/...
chunk of a long prompt whose earlier KV is already in the pool) and single decode tokens, plus
optional padding at the end. Each sequence's context is one contiguous extent of the pool, so
attention reads it as a zero-copy view: ``pool_k[:, start:start+ctx]`` is ``[kv_heads, ctx, D]``.
Nothing copies a sequence's context per step; only the new tokens' K/V are written.

``ragged_attention`` is what the models call: one ``tetri::ragged_attention`` op per layer for
the whole batch (``engine/ops``) where it has a kernel for the device, else ``paged_attention``,
the per-sequence SDPA loop, which is also the op's reference.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import accumulate

import torch
import torch.nn.functional as F

from tetri_server.engine.ops import load_cpu_ops, ragged_attention_op, triton_layer_ops


@dataclass
class BatchMetadata:
    """Describes one forward pass. Built by the model runner; read by every layer.

    ``q_starts[i]``/``q_lens[i]``: where sequence i's new tokens sit in the flat batch.
    ``ctx_lens[i]``: its context length after this step (earlier tokens + new ones).
    ``kv_starts[i]``: pool token index of its extent start (block id * block_size).
    ``slot_mapping``: ``[num_tokens]`` pool token index of each new token (only real tokens).
    ``positions``: ``[num_tokens]`` position of each token (padding gets 0).
    ``num_real``: tokens before the padding.
    ``seq_tensors``: the four lists above as int64 vectors (q_starts, q_lens, ctx_lens,
    kv_starts) on the batch's device, for the attention op; made once per step (at
    construction when not given). Replace the metadata rather than edit its lists.
    ``sampled_only``: the metadata of the rows the step takes logits from, alone (see
    ``rows_alone``: the sampled rows one by one, then each prompt span whose logprobs were
    asked for as a group), when those are fewer than the batch's rows or a span is among them;
    the model's last layer then runs only them once every row's K/V is written. None: the
    last layer runs every row (a step of decode rows only).
    """

    q_starts: list[int]
    q_lens: list[int]
    ctx_lens: list[int]
    kv_starts: list[int]
    slot_mapping: torch.Tensor
    positions: torch.Tensor
    num_real: int
    _masks: dict[tuple[int, int, int, int], torch.Tensor] | None = None
    seq_tensors: tuple[torch.Tensor, ...] = ()
    sampled_only: BatchMetadata | None = None

    def __post_init__(self) -> None:
        if not self.seq_tensors:
            self.seq_tensors = metadata_tensors(self.q_starts, self.q_lens, self.ctx_lens,
                                                self.kv_starts, self.slot_mapping.device)

    def mask(self, q_len: int, ctx_len: int, device: torch.device, first_key: int = 0,
             window: int = 0) -> torch.Tensor:
        """Bool mask [q_len, ctx_len - first_key] over keys ``first_key..ctx_len-1``: query i
        (at context position ctx-q+i) sees keys <= it, and with a sliding ``window`` only the
        last ``window`` of those (transformers: key > query - window)."""
        if self._masks is None:
            self._masks = {}
        key = (q_len, ctx_len, first_key, window)
        m = self._masks.get(key)
        if m is None:
            q_pos = torch.arange(ctx_len - q_len, ctx_len, device=device)[:, None]
            k_pos = torch.arange(first_key, ctx_len, device=device)[None, :]
            m = k_pos <= q_pos
            if window:
                m &= k_pos > q_pos - window
            self._masks[key] = m
        return m


def rows_alone(meta: BatchMetadata, items: list[int],
               runs: Sequence[tuple[int, int, int]] = ()) -> BatchMetadata:
    """The metadata of a batch made of the last new row of each sequence ``items`` of ``meta``
    (in that order; one query row each, at the same context and pool extent), then of each
    run (sequence index n in ``meta``, first row in the batch, number of rows) of consecutive
    new rows of a sequence (a prompt span whose logprobs were asked for), at the context its
    last row sees. Attention gives each row what it gives it in the whole batch, and a row's
    group never depends on what else is in the batch."""
    q_lens = [1] * len(items) + [k for _, _, k in runs]
    rows = [meta.q_starts[n] + meta.q_lens[n] - 1 for n in items]
    ctx_lens = [meta.ctx_lens[n] for n in items]
    for n, row, k in runs:
        rows.extend(range(row, row + k))
        # the run's last row sees the context up to itself
        ctx_lens.append(meta.ctx_lens[n] - (meta.q_starts[n] + meta.q_lens[n] - row - k))
    index = torch.tensor(rows, dtype=torch.long, device=meta.positions.device)
    return BatchMetadata(q_starts=list(accumulate(q_lens, initial=0))[:-1], q_lens=q_lens,
                         ctx_lens=ctx_lens,
                         kv_starts=[meta.kv_starts[n] for n in items]
                         + [meta.kv_starts[n] for n, _, _ in runs],
                         slot_mapping=meta.slot_mapping[index], positions=meta.positions[index],
                         num_real=len(rows))


def metadata_tensors(q_starts: list[int], q_lens: list[int], ctx_lens: list[int],
                     kv_starts: list[int], device: torch.device) -> tuple[torch.Tensor, ...]:
    """One [4, num_seqs] int64 tensor, returned as its four contiguous rows."""
    t = torch.tensor([q_starts, q_lens, ctx_lens, kv_starts], dtype=torch.long, device=device)
    return tuple(t.unbind(0))


def write_kv(pool_k: torch.Tensor, pool_v: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             meta: BatchMetadata) -> None:
    """Store the new tokens' K/V. pool_*: [kv_heads, pool_tokens, D]; k, v: [T, kv_heads, D].
    One ``tetri::write_kv`` call on CPU (row copies), one Triton kernel on CUDA
    (``ops/triton_layer.py``), else two ``index_copy_``."""
    n = meta.num_real
    if n == 0:
        return
    slots = meta.slot_mapping
    if pool_k.device.type == "cpu" and load_cpu_ops():
        torch.ops.tetri.write_kv(pool_k, pool_v, k, v, slots)
        return
    if pool_k.device.type == "cuda" and k.stride(-1) == 1 and v.stride(-1) == 1 \
            and pool_k.stride(-1) == 1 and pool_k.stride() == pool_v.stride() \
            and (tri := triton_layer_ops()):
        tri.write_kv(pool_k, pool_v, k, v, slots[:n])
        return
    write_kv_ref(pool_k, pool_v, k, v, meta)


def write_kv_ref(pool_k: torch.Tensor, pool_v: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 meta: BatchMetadata) -> None:
    """``write_kv`` as two ``index_copy_`` calls (the reference, and the path off CPU)."""
    n = meta.num_real
    if n == 0:
        return
    slots = meta.slot_mapping
    pool_k.index_copy_(1, slots, k[:n].transpose(0, 1))
    pool_v.index_copy_(1, slots, v[:n].transpose(0, 1))


def paged_attention(q: torch.Tensor, pool_k: torch.Tensor, pool_v: torch.Tensor,
                    meta: BatchMetadata, scale: float | None = None,
                    window: int = 0) -> torch.Tensor:
    """q: [T, heads, D] -> out [T, heads, D]. Padding rows are left zero. ``window`` > 0: a
    sliding-window layer (Mistral, Qwen2): each query sees only its last ``window`` keys.

    One SDPA call per sequence over a view of its extent (GQA handled by SDPA)."""
    out = torch.zeros_like(q)
    gqa = q.shape[1] != pool_k.shape[0]
    for qs, ql, ctx, ks in zip(meta.q_starts, meta.q_lens, meta.ctx_lens, meta.kv_starts,
                               strict=True):
        # keys before the first query's window are seen by no query of this step
        lo = max(0, ctx - ql - window + 1) if window else 0
        qi = q[qs:qs + ql].transpose(0, 1).unsqueeze(0)  # [1, heads, ql, D]
        ki = pool_k[:, ks + lo:ks + ctx].unsqueeze(0)  # [1, kv_heads, ctx - lo, D] (a view)
        vi = pool_v[:, ks + lo:ks + ctx].unsqueeze(0)
        if ql == 1:
            o = F.scaled_dot_product_attention(qi, ki, vi, scale=scale, enable_gqa=gqa)
        elif window and window < ctx - lo:  # some query's window excludes some key
            o = F.scaled_dot_product_attention(
                qi, ki, vi, attn_mask=meta.mask(ql, ctx, q.device, lo, window), scale=scale,
                enable_gqa=gqa)
        elif ql == ctx - lo:
            o = F.scaled_dot_product_attention(qi, ki, vi, is_causal=True, scale=scale,
                                               enable_gqa=gqa)
        else:
            o = F.scaled_dot_product_attention(qi, ki, vi,
                                               attn_mask=meta.mask(ql, ctx, q.device, lo),
                                               scale=scale, enable_gqa=gqa)
        out[qs:qs + ql] = o[0].transpose(0, 1)
    return out


def ragged_attention(q: torch.Tensor, pool_k: torch.Tensor, pool_v: torch.Tensor,
                     meta: BatchMetadata, scale: float | None = None,
                     window: int = 0) -> torch.Tensor:
    """Same contract as ``paged_attention`` (q: [T, heads, D] -> [T, heads, D], padding rows
    zero), in one ``tetri::ragged_attention`` call where the op has a kernel for q's device;
    otherwise the loop (``engine/ops`` has logged a WARNING saying so)."""
    op = ragged_attention_op(q.device.type)
    if op is None:
        return paged_attention(q, pool_k, pool_v, meta, scale, window)
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)  # q may be strided (OPT)
    op(q, pool_k, pool_v, out, *meta.seq_tensors,
       scale if scale is not None else 1.0 / math.sqrt(q.shape[-1]), window)
    return out
