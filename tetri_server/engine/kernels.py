"""The primitives a model's forward calls, as one set the model holds (``model.kernels``).

A benchmark or a test that wants another attention path, plain matmuls or timed calls builds a
``Kernels`` and assigns it to the model; nothing patches modules. ``Kernels()`` is what serving
runs: the one attention op per layer, ``tetri::write_kv`` into the pool, linears on the packed
weights of ``ops/linear.py`` (the gate|up one with SiLU-and-mul in its tiles), and the fused
norm/RoPE ops of ``ops/layer.py``;
``REFERENCE`` is eager PyTorch for all of them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, fields, replace
from typing import Any

import torch
import torch.nn.functional as F

from tetri_server.engine.attention import (
    BatchMetadata,
    paged_attention,
    ragged_attention,
    write_kv,
    write_kv_ref,
)
from tetri_server.engine.ops.layer import (
    add_rms_norm,
    add_rms_norm_ref,
    rms_norm,
    rms_norm_ref,
    rope,
    rope_ref,
    silu_mul_ref,
)
from tetri_server.engine.ops.linear import glu, linear

# (q, pool_k, pool_v, meta, scale=None, window=0) -> out
AttentionFn = Callable[..., torch.Tensor]
WriteKVFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, BatchMetadata],
                     None]
# (x, w, b=None, packed=None) -> x @ w.T + b
LinearFn = Callable[..., torch.Tensor]


def unpacked_linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None,
                    packed: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear`` whatever the weight's prepacked copy (the engine before prepacking)."""
    return F.linear(x, w, b)


@dataclass(frozen=True)
class Kernels:
    attention: AttentionFn = ragged_attention
    write_kv: WriteKVFn = write_kv
    linear: LinearFn = linear
    # Llama-family layers (ops/layer.py: fused on CPU float32, else eager PyTorch)
    rms_norm: Callable[..., torch.Tensor] = rms_norm  # (x, weight, eps)
    add_rms_norm: Callable[..., torch.Tensor] = add_rms_norm  # (x!, delta, weight, eps)
    rope: Callable[..., None] = rope  # (q!, k!, cos, sin)
    # (x, gate|up weight, packed=None) -> silu(x @ gate.T) * (x @ up.T), fused on its pack
    glu: Callable[..., torch.Tensor] = glu

    def wrapped(self, wrap: Callable[[str, Callable[..., Any]], Callable[..., Any]]) -> Kernels:
        """Every primitive replaced by ``wrap(name, fn)`` (e.g. a timer around it)."""
        return replace(self, **{f.name: wrap(f.name, getattr(self, f.name))
                                for f in fields(self)})


def unfused_glu(linear: LinearFn, silu_mul: Callable[..., torch.Tensor]) -> Callable[...,
                                                                                    torch.Tensor]:
    """``glu`` as ``silu_mul(linear(x, w))``: for kernel sets whose linear does not take the
    GLU pack (it is passed no pack)."""
    def run(x: torch.Tensor, w: torch.Tensor, packed: torch.Tensor | None = None) -> torch.Tensor:
        return silu_mul(linear(x, w, None, None))
    return run


def eager_layer_ops(kern: Kernels) -> Kernels:
    """``kern`` with RMSNorm, add + RMSNorm, RoPE, SiLU-and-mul and the KV write as eager
    PyTorch (the CUDA path before ``ops/triton_layer.py``): tools/bench_gpu.py's A/B."""
    return replace(kern, write_kv=write_kv_ref, rms_norm=rms_norm_ref,
                   add_rms_norm=add_rms_norm_ref, rope=rope_ref,
                   glu=unfused_glu(kern.linear, silu_mul_ref))


REFERENCE = Kernels(attention=paged_attention, write_kv=write_kv_ref, linear=unpacked_linear,
                    rms_norm=rms_norm_ref, add_rms_norm=add_rms_norm_ref, rope=rope_ref,
                    glu=unfused_glu(unpacked_linear, silu_mul_ref))
