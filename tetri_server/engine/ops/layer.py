"""The small ops of a Llama-family layer: the eager PyTorch reference of each, and the fused
``tetri::`` CPU op (``layer_ops.cpp``) used where it applies (CPU, float32, contiguous rows, the
library built). Measured in docs/benchmarks.md (Engine); tests/unit/test_layer_ops.py holds the
fused ops to the references."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tetri_server.engine.ops import load_cpu_ops


def _fused(*tensors: torch.Tensor) -> bool:
    return all(t.device.type == "cpu" and t.dtype == torch.float32 for t in tensors) \
        and load_cpu_ops()


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
    return rms_norm_ref(x, weight, eps)


def add_rms_norm(x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> torch.Tensor:
    """The residual update ``x += delta`` (in place), then ``rms_norm(x)``."""
    if x.is_contiguous() and delta.is_contiguous() and _fused(x, delta, weight):
        return torch.ops.tetri.add_rms_norm(x, delta, weight, eps)
    return add_rms_norm_ref(x, delta, weight, eps)


def rope(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    """Rotate q [T, heads, D] and k [T, kv_heads, D] in place; cos/sin [T, 1, D]
    (rotate-half convention)."""
    if q.stride(-1) == 1 and k.stride(-1) == 1 and cos.is_contiguous() and sin.is_contiguous() \
            and _fused(q, k, cos, sin):
        torch.ops.tetri.rope_(q, k, cos, sin)
    else:
        rope_ref(q, k, cos, sin)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` for ``gate_up`` [T, 2I] = gate | up."""
    if gate_up.is_contiguous() and _fused(gate_up):
        return torch.ops.tetri.silu_mul(gate_up)
    return silu_mul_ref(gate_up)


def argmax_rows(x: torch.Tensor) -> torch.Tensor:
    """``x.argmax(dim=-1)`` for logits ``x`` [S, V] (same ties: the first maximum; a row with a
    NaN gives its first NaN)."""
    if x.dim() == 2 and x.shape[1] > 0 and x.is_contiguous() and _fused(x):
        return torch.ops.tetri.argmax_rows(x)
    return x.argmax(dim=-1)
