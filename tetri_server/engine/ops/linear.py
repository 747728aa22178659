"""Linear layers over a weight packed once at load (CPU, fp32).

``pack_weight(w)`` makes the copy a layer keeps beside its weight; ``linear(x, w, b, packed)``
runs on it:

- ``tetri::packed_linear`` (``linear_ops.cpp``) where the C++ ops are built with an AVX2 or
  AVX-512 kernel: panels of the weight stored in the order the kernel reads them, a register
  tile per row count (decode rows or prefill rows), the next panel prefetched while a panel
  runs (up to ``tall_tile_rows`` rows a tall tile, chosen per CPU). Measured on one core
  (docs/benchmarks.md, Engine): faster than oneDNN at every decode
  batch size, within a few % of it at prefill sizes. Each output is one FMA chain over the
  input dim, so a row's result does not depend on the other rows of the batch.
- else oneDNN's matmul over a weight reordered once (``torch.ops.mkldnn._reorder_linear_weight``:
  1.2-2x faster than MKL's ``F.linear`` for 2 <= M <= 256, not at M = 1 or from M ~ 1024);
- else ``F.linear``.

``pack_glu_weight(w)`` and ``glu(x, w, packed)`` do the same for a gate|up weight followed by
SiLU-and-mul (``silu(x @ gate.T) * (x @ up.T)``): ``tetri::packed_glu`` applies it in the
tile, so the [M, 2I] product never goes through memory; the bits are those of
``packed_linear`` then ``tetri::silu_mul``.

Greedy output still equals transformers (tests/unit/test_engine.py). The packed copy doubles
the memory of the weights it packs.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from tetri_server.engine.ops import load_cpu_ops
from tetri_server.engine.ops.layer import silu_mul
from tetri_server.hostinfo import cpuinfo

PACKED_MIN_ROWS = 2  # oneDNN's copy: the rows it is faster for
PACKED_MAX_ROWS = 512
PACK_HINT_ROWS = 32  # the batch size oneDNN picks the weight layout for; any M runs on it


@functools.cache
def tetri_linear_supported() -> bool:
    """The C++ ops are built here with a packed-linear kernel (AVX2 or AVX-512); sets the
    kernel's tall-tile rows for this CPU (``tall_tile_rows``)."""
    if not (load_cpu_ops() and bool(torch.ops.tetri.packed_linear_supported())):
        return False
    torch.ops.tetri.set_packed_linear_tall_rows(
        tall_tile_rows(cpuinfo("vendor_id"), torch.backends.cpu.get_cpu_capability()))
    return True


def tall_tile_rows(vendor: str, capability: str) -> int:
    """Up to how many rows ``packed_linear`` runs its tall tile (12 rows x 2 vectors on
    AVX-512) rather than the wide one (6 x 4). Measured with tools/ab_kernels.py: on an AMD
    EPYC with AVX-512 (Zen 4, session 39) the wide tile was 4-7% faster at 32 and 48 rows and
    level at 8 and 16, the decode step at batch 32 4% faster; on Intel the tall one was the
    faster for decode (session 18). Elsewhere unmeasured: the tall tile up to 48 rows."""
    return 0 if vendor == "AuthenticAMD" and capability == "AVX512" else 48


def _is_tetri_pack(packed: torch.Tensor) -> bool:
    return packed.dim() == 3  # [panels, in, panel width]; oneDNN's copies are 2-D


def _cpu_fp32_matrix(w: torch.Tensor) -> bool:
    return w.device.type == "cpu" and w.dtype == torch.float32 and w.dim() == 2


def _is_glu_pack(packed: torch.Tensor | None) -> bool:
    return packed is not None and packed.dim() == 4  # [panels, in, vectors, lanes]


def pack_weight(w: torch.Tensor) -> torch.Tensor | None:
    """The packed copy of ``w`` ([out, in]) for ``linear``, or None where none applies (not
    CPU fp32, or neither the C++ kernel nor mkldnn here)."""
    if not _cpu_fp32_matrix(w):
        return None
    if tetri_linear_supported():
        with torch.no_grad():
            return torch.ops.tetri.pack_linear_weight(w.detach())
    return onednn_pack_weight(w)


def linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None,
           packed: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, w, b)`` for x [M, in], on ``packed`` (from ``pack_weight(w)``) where it
    applies."""
    if _is_glu_pack(packed):
        raise ValueError("linear: this weight is packed for glu() (gate/up pairs)")
    if packed is not None and x.dim() == 2:
        if _is_tetri_pack(packed):
            return torch.ops.tetri.packed_linear(x, packed, b, w.shape[0])
        if PACKED_MIN_ROWS <= x.shape[0] <= PACKED_MAX_ROWS:
            return torch.ops.mkldnn._linear_pointwise(x.contiguous(), packed, b, "none", [], "")
    return F.linear(x, w, b)


def pack_glu_weight(w: torch.Tensor) -> torch.Tensor | None:
    """The packed copy of a gate|up weight ``w`` ([2I, in]) for ``glu``: the fused GLU pack
    where the C++ kernel runs here and I is a whole number of its vectors, else
    ``pack_weight(w)``."""
    if (_cpu_fp32_matrix(w) and tetri_linear_supported()
            and w.shape[0] % (2 * torch.ops.tetri.packed_linear_lanes()) == 0):
        with torch.no_grad():
            return torch.ops.tetri.pack_glu_weight(w.detach())
    return pack_weight(w)


def glu(x: torch.Tensor, w: torch.Tensor, packed: torch.Tensor | None = None) -> torch.Tensor:
    """``silu(gate) * up`` of ``x @ w.T`` = gate | up, for x [M, in] and ``packed`` from
    ``pack_glu_weight(w)``."""
    if _is_glu_pack(packed) and x.dim() == 2:
        return torch.ops.tetri.packed_glu(x, packed, w.shape[0] // 2)
    return silu_mul(linear(x, w, None, packed))


def onednn_pack_weight(w: torch.Tensor) -> torch.Tensor | None:
    """oneDNN's reordered copy of ``w`` (the fallback where the C++ kernel is missing, and the
    engine before ``tetri::packed_linear`` that benchmarks compare it with), or None without
    mkldnn."""
    if not _cpu_fp32_matrix(w):
        return None
    if not torch.backends.mkldnn.is_available() or not hasattr(torch.ops.mkldnn,
                                                               "_reorder_linear_weight"):
        return None
    with torch.no_grad():
        return torch.ops.mkldnn._reorder_linear_weight(w.detach(), PACK_HINT_ROWS)
