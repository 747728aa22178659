"""The small ops of a Llama-family layer: the eager PyTorch reference of each, the fused
``tetri::`` CPU op (``layer_ops.cpp``) used where it applies (CPU, float32, contiguous rows, the
library built), and on CUDA one Triton kernel each (``triton_layer.py``; floating dtypes, rows
whose last dim is contiguous, Triton installed). Measured in docs/benchmarks.md (Engine);
tests/unit/test_layer_ops.py holds the fused CPU ops to the references,
tests/unit/test_triton_layer_ops.py the Triton kernels (under Triton's interpreter)."""

from __future__ import annotations

from types import ModuleType

import torch
import torch.nn.functional as F

from tetri_server.engine.ops import load_cpu_ops, triton_layer_ops

FLOATS = (torch.float32, torch.bfloat16, torch.float16)


def _fused(*tensors: torch.Tensor) -> bool:
    return all(t.device.type == "cpu" and t.dtype == torch.float32 for t in tensors) \
        and load_cpu_ops()


def _triton(*tensors: torch.Tensor) -> ModuleType | None:
    """The Triton kernels where every tensor is a CUDA float tensor whose last dim is
    contiguous, else None."""
    if all(t.device.type == "cuda" and t.dtype in FLOATS and t.stride(-1) == 1
           for t in tensors):
        return triton_layer_ops()
    return None


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # Same order of operations as transformers' LlamaRMSNorm (fp32 statistics).
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def add_rms_norm_ref(x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor,
                     eps: float) -> torch.Tensor:
    x.add_(delta)
    return rms_norm_ref(x, weight, eps)


def rope_ref(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    for x in (q, k):
        half = x.shape[-1] // 2
        rot = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
        x.copy_(x * cos + rot * sin)


def silu_mul_ref(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``weight * x / rms(x)`` over the last dim of ``x`` [T, H]."""
    if x.is_contiguous() and _fused(x, weight):
        return torch.ops.tetri.rms_norm(x, weight, eps)
    if x.dim() == 2 and (tri := _triton(x, weight)):
        return tri.rms_norm(x, weight, eps)
    return rms_norm_ref(x, weight, eps)


def add_rms_norm(x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> torch.Tensor:
    """The residual update ``x += delta`` (in place), then ``rms_norm(x)``."""
    if x.is_contiguous() and delta.is_contiguous() and _fused(x, delta, weight):
        return torch.ops.tetri.add_rms_norm(x, delta, weight, eps)
    if x.dim() == 2 and x.shape == delta.shape and (tri := _triton(x, delta, weight)):
        return tri.rms_norm(x, weight, eps, delta)
    return add_rms_norm_ref(x, delta, weight, eps)


def rope(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    """Rotate q [T, heads, D] and k [T, kv_heads, D] in place; cos/sin [T, 1, D]
    (rotate-half convention)."""
    if q.stride(-1) == 1 and k.stride(-1) == 1 and cos.is_contiguous() and sin.is_contiguous() \
            and _fused(q, k, cos, sin):
        torch.ops.tetri.rope_(q, k, cos, sin)
    elif cos.is_contiguous() and sin.is_contiguous() and q.shape[-1] % 2 == 0 \
            and cos.shape == sin.shape == (q.shape[0], 1, q.shape[-1]) \
            and (tri := _triton(q, k, cos, sin)):
        tri.rope_(q, k, cos, sin)
    else:
        rope_ref(q, k, cos, sin)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` for ``gate_up`` [T, 2I] = gate | up."""
    if gate_up.is_contiguous() and _fused(gate_up):
        return torch.ops.tetri.silu_mul(gate_up)
    if gate_up.dim() == 2 and (tri := _triton(gate_up)):
        return tri.silu_mul(gate_up)
    return silu_mul_ref(gate_up)


def argmax_rows(x: torch.Tensor) -> torch.Tensor:
    """``x.argmax(dim=-1)`` for logits ``x`` [S, V] (same ties: the first maximum; a row with a
    NaN gives its first NaN)."""
    if x.dim() == 2 and x.shape[1] > 0 and x.is_contiguous() and _fused(x):
        return torch.ops.tetri.argmax_rows(x)
    return x.argmax(dim=-1)
