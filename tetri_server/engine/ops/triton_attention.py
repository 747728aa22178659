"""The CUDA side of ``tetri::ragged_attention``: a Triton kernel with the same arguments as the
C++ op (see ``ragged_attention.cpp`` and ``attention.py`` for the layout and semantics).

Two layouts of programs, the same per-row arithmetic:
- grouped (the default, ``PACK_GROUPS = True``): one program per (sequence, KV head, block of
  16 / g query rows, at least 1), computing every query head of the KV head's group (g query
  heads per KV head) on its rows, stacked in one tile of at least 16 rows; each key and value
  is read once per group.
- per query head (``PACK_GROUPS = False``, or ``pack_groups=False``; the kernel to session
  38): one program per (sequence, query head, block of 16 query rows), reading each KV block
  g times (from L2 or memory).
On an H200 (session 38; a 0.79 B Llama in bf16, 16 query heads on 8 KV heads, decode batch 64
at context 512, CUDA graphs) the step took 3.27 ms grouped against 3.51 and 3.84 ms per head
(one run each, separate processes: tools/bench_gpu.py [--per-head-attention]).
Programs past a sequence's rows do nothing.
Keys are walked in order in blocks of BLOCK_N from the first key any row of the block can
see, with an online softmax in fp32 (``tl.dot`` in IEEE fp32 for fp32 inputs, so no TF32), so
a row's result depends only on its own sequence. Metadata stays on the device: the grid is
sized from ``q``'s shape, never from the metadata's values (no host sync).

Only imported where Triton is installed. Its logic is tested on CPU under Triton's interpreter
(``TRITON_INTERPRET=1``, tests/unit/test_attention_op.py); speed only on a GPU.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_M = 16  # query rows per program (per query head), tile rows (grouped)
BLOCK_N = 64
PACK_GROUPS = True  # one program per KV head's group of query heads (False: per query head)


@triton.jit
def _ragged_attention_kernel(Q, K, V, Out, QS, QL, CL, KS, scale, window,  # noqa: N803
                             stride_qt, stride_qh, stride_kh, stride_kt, stride_ot, stride_oh,
                             GROUPS: tl.constexpr, HEADS: tl.constexpr, D: tl.constexpr,
                             BLOCK_D: tl.constexpr, BLOCK_Q: tl.constexpr, TILE: tl.constexpr,
                             BLOCK_N: tl.constexpr, PRECISION: tl.constexpr):
    """HEADS query heads (a KV head's group, or 1) x BLOCK_Q query rows per program, stacked
    head-major in TILE >= HEADS * BLOCK_Q tile rows."""
    mb = tl.program_id(0)  # axis 0: up to 2**31 - 1 programs (axes 1 and 2: 65,535)
    head_block = tl.program_id(1)
    seq = tl.program_id(2)
    q_start = tl.load(QS + seq).to(tl.int64)
    q_len = tl.load(QL + seq).to(tl.int64)
    ctx = tl.load(CL + seq).to(tl.int64)
    kv_start = tl.load(KS + seq).to(tl.int64)
    # in int64: the pool's heads may lie more than 2^31 elements apart (a big pool of a model
    # with few layers), which an int32 product of head and stride would wrap
    kvh = ((head_block * HEADS) // GROUPS).to(tl.int64)

    tile = tl.arange(0, TILE)
    head = head_block * HEADS + tile // BLOCK_Q  # each tile row's query head
    offs_m = mb * BLOCK_Q + tile % BLOCK_Q  # and its query row in the sequence
    offs_d = tl.arange(0, BLOCK_D)
    row_ok = (tile < HEADS * BLOCK_Q) & (offs_m < q_len)
    d_ok = offs_d < D
    pos = ctx - q_len + offs_m  # context position of each query row
    q = tl.load(Q + (q_start + offs_m)[:, None] * stride_qt + head[:, None] * stride_qh
                + offs_d[None, :], mask=row_ok[:, None] & d_ok[None, :], other=0.0)

    # keys [first, last): what the block's rows can see; empty for a block past the rows
    last = tl.minimum(ctx - q_len + (mb + 1) * BLOCK_Q, ctx)
    first = ctx * 0
    if window > 0:
        first = tl.maximum(ctx - q_len + mb * BLOCK_Q - window + 1, 0)
    if mb * BLOCK_Q >= q_len:
        last = first

    m_i = tl.full([TILE], float("-inf"), tl.float32)
    l_i = tl.zeros([TILE], tl.float32)
    acc = tl.zeros([TILE, BLOCK_D], tl.float32)
    k_base = K + kvh * stride_kh + kv_start * stride_kt
    v_base = V + kvh * stride_kh + kv_start * stride_kt
    for start in range(first, last, BLOCK_N):
        offs_n = start + tl.arange(0, BLOCK_N)
        kv_mask = (offs_n < last)[:, None] & d_ok[None, :]
        k = tl.load(k_base + offs_n[:, None] * stride_kt + offs_d[None, :], mask=kv_mask,
                    other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale
        visible = (offs_n[None, :] <= pos[:, None]) & (offs_n < last)[None, :]
        visible = visible & ((offs_n[None, :] > pos[:, None] - window) | (window <= 0))
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows that saw no key yet
        p = tl.exp(s - m_safe[:, None])
        alpha = tl.exp(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_base + offs_n[:, None] * stride_kt + offs_d[None, :], mask=kv_mask,
                    other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m_i = m_new
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(Out + (q_start + offs_m)[:, None] * stride_ot + head[:, None] * stride_oh
             + offs_d[None, :], out.to(Out.dtype.element_ty),
             mask=row_ok[:, None] & d_ok[None, :])


def ragged_attention_triton(q: torch.Tensor, pool_k: torch.Tensor, pool_v: torch.Tensor,
                            out: torch.Tensor, q_start: torch.Tensor, q_len: torch.Tensor,
                            ctx_len: torch.Tensor, kv_start: torch.Tensor, scale: float,
                            window: int, pack_groups: bool | None = None) -> None:
    """Same contract as ``torch.ops.tetri.ragged_attention``: writes ``out`` (rows of no
    sequence are zero). The metadata vectors must be on q's device. ``pack_groups``: one
    program per KV head's group of query heads (None: ``PACK_GROUPS``) or per query head."""
    tokens, heads, dim = q.shape
    kv_heads = pool_k.shape[0]
    if heads % kv_heads or pool_k.stride() != pool_v.stride() or q.stride(2) != 1 \
            or pool_k.stride(2) != 1 or not out.is_contiguous():
        raise ValueError("ragged_attention: unsupported shapes or strides")
    out.zero_()
    num_seqs = q_start.numel()
    if num_seqs == 0 or tokens == 0:
        return
    groups = heads // kv_heads
    per_program = groups if (PACK_GROUPS if pack_groups is None else pack_groups) else 1
    block_q = max(1, BLOCK_M // per_program)
    # the row blocks on axis 0: a step of over 65,535 x block_q tokens (a 128k prompt) would
    # not launch on axis 2; a batch of over 65,535 sequences never comes
    grid = (triton.cdiv(tokens, block_q), heads // per_program, num_seqs)
    _ragged_attention_kernel[grid](
        q, pool_k, pool_v, out, q_start, q_len, ctx_len, kv_start, float(scale), int(window),
        q.stride(0), q.stride(1), pool_k.stride(0), pool_k.stride(1), out.stride(0),
        out.stride(1), GROUPS=groups, HEADS=per_program, D=dim,
        BLOCK_D=triton.next_power_of_2(dim), BLOCK_Q=block_q,
        TILE=max(BLOCK_M, triton.next_power_of_2(per_program * block_q)), BLOCK_N=BLOCK_N,
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32")
