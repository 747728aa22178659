"""The CUDA side of the small per-layer ops of ``layer.py`` and of ``write_kv``: one Triton
kernel each, where eager PyTorch launches several.

On an H200 (session 38; a 0.79 B Llama in bf16, decode batch 64 at context 512, CUDA graphs)
about 1.3 ms of a 3.0 ms step went to some 300 small kernels: RMSNorm (six kernels), RoPE (about
twelve), the KV write (two ``index_copy_``), SiLU-and-mul (two) run as eager PyTorch. These
kernels make each one launch:

- ``rms_norm`` / ``add_rms_norm``: one program per row; the residual update ``x += delta`` in
  x's dtype, written back in place, then the statistics in fp32 and the rounding of the
  reference (``weight * (x * rsqrt(mean(x^2) + eps)).to(x.dtype)``).
- ``rope_``: one program per token, rotating every query and key head in place (rotate-half
  convention, the full cos/sin rows as the reference reads them), in fp32 and rounded once to
  the dtype (eager PyTorch rounds after each of its ops: in bf16 the two differ by an ulp or
  two; in fp32 by the order of the sum).
- ``silu_mul``: ``silu(gate) * up`` of a gate | up row, silu in fp32 and rounded to the dtype
  before the product, as eager PyTorch does.
- ``write_kv``: one program per new token, its K and V rows into the pool at its slot.

The grids depend only on the tensors' shapes, never on their values, so each kernel can be
captured in a CUDA graph. Only imported where Triton is installed. The logic is tested on CPU
under Triton's interpreter (``TRITON_INTERPRET=1``, tests/unit/test_triton_layer_ops.py); the
speed only on a GPU (tools/bench_gpu.py, against its rows with the eager PyTorch ops).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rms_norm_kernel(X, Delta, W, Out, stride_x, stride_d, stride_o, H, eps,  # noqa: N803
                     HAS_DELTA: tl.constexpr, BLOCK_H: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_H)
    ok = offs < H
    x = tl.load(X + row * stride_x + offs, mask=ok, other=0.0)
    if HAS_DELTA:  # the residual update, rounded to x's dtype as ``x.add_(delta)`` does
        d = tl.load(Delta + row * stride_d + offs, mask=ok, other=0.0)
        x = (x.to(tl.float32) + d.to(tl.float32)).to(x.dtype)
        tl.store(X + row * stride_x + offs, x, mask=ok)
    xf = x.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(xf * xf, axis=0) / H + eps)
    y = (xf * rstd).to(x.dtype).to(tl.float32)
    w = tl.load(W + offs, mask=ok, other=0.0).to(tl.float32)
    tl.store(Out + row * stride_o + offs, (w * y).to(Out.dtype.element_ty), mask=ok)


@triton.jit
def _rope_rows(X, row, stride_t, stride_h, heads, c1, c2, s1, s2,  # noqa: N803
               HALF: tl.constexpr, BLOCK_HEADS: tl.constexpr, BLOCK_HALF: tl.constexpr):
    """Rotate the ``heads`` heads of token ``row`` of X in place: [x1, x2] -> [x1 c1 - x2 s1,
    x2 c2 + x1 s2] (``x * cos + rotate_half(x) * sin``)."""
    h = tl.arange(0, BLOCK_HEADS)
    j = tl.arange(0, BLOCK_HALF)
    ok = (h < heads)[:, None] & (j < HALF)[None, :]
    lo = X + row * stride_t + h[:, None] * stride_h + j[None, :]
    x1 = tl.load(lo, mask=ok, other=0.0).to(tl.float32)
    x2 = tl.load(lo + HALF, mask=ok, other=0.0).to(tl.float32)
    tl.store(lo, (x1 * c1 - x2 * s1).to(X.dtype.element_ty), mask=ok)
    tl.store(lo + HALF, (x2 * c2 + x1 * s2).to(X.dtype.element_ty), mask=ok)


@triton.jit
def _rope_kernel(Q, K, Cos, Sin, stride_qt, stride_qh, stride_kt, stride_kh,  # noqa: N803
                 stride_ct, q_heads, k_heads, HALF: tl.constexpr, BLOCK_QH: tl.constexpr,
                 BLOCK_KH: tl.constexpr, BLOCK_HALF: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    j = tl.arange(0, BLOCK_HALF)
    ok = j < HALF
    base = row * stride_ct + j
    c1 = tl.load(Cos + base, mask=ok, other=0.0).to(tl.float32)[None, :]
    c2 = tl.load(Cos + base + HALF, mask=ok, other=0.0).to(tl.float32)[None, :]
    s1 = tl.load(Sin + base, mask=ok, other=0.0).to(tl.float32)[None, :]
    s2 = tl.load(Sin + base + HALF, mask=ok, other=0.0).to(tl.float32)[None, :]
    _rope_rows(Q, row, stride_qt, stride_qh, q_heads, c1, c2, s1, s2, HALF, BLOCK_QH,
               BLOCK_HALF)
    _rope_rows(K, row, stride_kt, stride_kh, k_heads, c1, c2, s1, s2, HALF, BLOCK_KH,
               BLOCK_HALF)


@triton.jit
def _silu_mul_kernel(GU, Out, stride_gu, stride_o, inter, BLOCK: tl.constexpr):  # noqa: N803
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < inter
    g = tl.load(GU + row * stride_gu + offs, mask=ok, other=0.0)
    u = tl.load(GU + row * stride_gu + inter + offs, mask=ok, other=0.0).to(tl.float32)
    gf = g.to(tl.float32)
    silu = (gf / (1.0 + tl.exp(-gf))).to(g.dtype).to(tl.float32)
    tl.store(Out + row * stride_o + offs, (silu * u).to(Out.dtype.element_ty), mask=ok)


@triton.jit
def _write_kv_kernel(K, V, PoolK, PoolV, Slots, stride_kt, stride_kh, stride_vt,  # noqa: N803
                     stride_vh, stride_ph, stride_pt, kv_heads, D: tl.constexpr,
                     BLOCK_HEADS: tl.constexpr, BLOCK_D: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    slot = tl.load(Slots + row).to(tl.int64)
    h = tl.arange(0, BLOCK_HEADS)
    d = tl.arange(0, BLOCK_D)
    ok = (h < kv_heads)[:, None] & (d < D)[None, :]
    dst = slot * stride_pt + h[:, None].to(tl.int64) * stride_ph + d[None, :]
    k = tl.load(K + row * stride_kt + h[:, None] * stride_kh + d[None, :], mask=ok)
    v = tl.load(V + row * stride_vt + h[:, None] * stride_vh + d[None, :], mask=ok)
    tl.store(PoolK + dst, k.to(PoolK.dtype.element_ty), mask=ok)
    tl.store(PoolV + dst, v.to(PoolV.dtype.element_ty), mask=ok)


def _warps(block: int) -> int:
    return max(1, min(16, block // 256))


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             delta: torch.Tensor | None = None) -> torch.Tensor:
    """``layer.rms_norm`` (``delta`` None) or ``layer.add_rms_norm`` (``x += delta`` first, in
    place) for rows ``x`` [T, H] whose last dim is contiguous."""
    t, h = x.shape
    out = torch.empty((t, h), dtype=torch.promote_types(weight.dtype, x.dtype), device=x.device)
    if t == 0:
        return out
    block = triton.next_power_of_2(h)
    d = x if delta is None else delta
    _rms_norm_kernel[(t,)](x, d, weight, out, x.stride(0), d.stride(0), out.stride(0), h, eps,
                           HAS_DELTA=delta is not None, BLOCK_H=block, num_warps=_warps(block))
    return out


def rope_(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    """``layer.rope``: q [T, heads, D] and k [T, kv_heads, D] (last dim contiguous) rotated in
    place by cos, sin [T, 1, D] (contiguous)."""
    t, heads, dim = q.shape
    if t == 0:
        return
    half = dim // 2
    _rope_kernel[(t,)](q, k, cos, sin, q.stride(0), q.stride(1), k.stride(0), k.stride(1),
                       cos.stride(0), heads, k.shape[1], HALF=half,
                       BLOCK_QH=triton.next_power_of_2(heads),
                       BLOCK_KH=triton.next_power_of_2(k.shape[1]),
                       BLOCK_HALF=triton.next_power_of_2(half),
                       num_warps=_warps(triton.next_power_of_2(heads * half)))


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``layer.silu_mul`` for ``gate_up`` [T, 2I] (last dim contiguous) -> [T, I]."""
    t, width = gate_up.shape
    inter = width // 2
    out = torch.empty((t, inter), dtype=gate_up.dtype, device=gate_up.device)
    if t == 0:
        return out
    block = min(1024, triton.next_power_of_2(inter))
    _silu_mul_kernel[(t, triton.cdiv(inter, block))](gate_up, out, gate_up.stride(0),
                                                     out.stride(0), inter, BLOCK=block,
                                                     num_warps=_warps(block))
    return out


def write_kv(pool_k: torch.Tensor, pool_v: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             slots: torch.Tensor) -> None:
    """``attention.write_kv``: row i of k, v [T, kv_heads, D] (last dim contiguous) to token
    ``slots[i]`` of pool_k, pool_v [kv_heads, pool_tokens, D] (the same strides), for the
    ``len(slots)`` first rows."""
    n = slots.shape[0]
    if n == 0:
        return
    kv_heads, dim = k.shape[1], k.shape[2]
    assert pool_k.stride() == pool_v.stride() and pool_k.stride(2) == 1
    block_heads, block_d = triton.next_power_of_2(kv_heads), triton.next_power_of_2(dim)
    _write_kv_kernel[(n,)](k, v, pool_k, pool_v, slots, k.stride(0), k.stride(1), v.stride(0),
                           v.stride(1), pool_k.stride(0), pool_k.stride(1), kv_heads, D=dim,
                           BLOCK_HEADS=block_heads, BLOCK_D=block_d,
                           num_warps=_warps(block_heads * block_d))
