"""Linear layers with the weight prepacked for oneDNN (CPU, fp32).

Measured on one core (docs/benchmarks.md, Engine): MKL's ``F.linear`` is slow at the row counts
of decode steps (M = 8 takes 3x the time of M = 1 for the same weight); oneDNN's matmul over a
weight reordered once at load (``torch.ops.mkldnn._reorder_linear_weight``) is 1.2-2x faster for
2 <= M <= 256, slightly slower at M = 1 and equal from M ~ 1024. So rows in
[PACKED_MIN_ROWS, PACKED_MAX_ROWS] take the packed weight, others ``F.linear``. Greedy output
still equals transformers (tests/unit/test_engine.py). The packed copy doubles the memory of
the weights it packs.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

PACKED_MIN_ROWS = 2
PACKED_MAX_ROWS = 512
PACK_HINT_ROWS = 32  # the batch size oneDNN picks the weight layout for; any M runs on it


def pack_weight(w: torch.Tensor) -> torch.Tensor | None:
    """The oneDNN-reordered copy of ``w`` ([out, in]), or None where it does not apply (not
    CPU fp32, or a torch without mkldnn)."""
    if w.device.type != "cpu" or w.dtype != torch.float32 or w.dim() != 2:
        return None
    if not torch.backends.mkldnn.is_available() or not hasattr(torch.ops.mkldnn,
                                                               "_reorder_linear_weight"):
        return None
    with torch.no_grad():
        return torch.ops.mkldnn._reorder_linear_weight(w.detach(), PACK_HINT_ROWS)


def linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None,
           packed: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, w, b)`` for x [M, in]; on ``packed`` (from ``pack_weight(w)``) when M is in
    the range where that is faster."""
    if packed is not None and PACKED_MIN_ROWS <= x.shape[0] <= PACKED_MAX_ROWS and x.dim() == 2:
        return torch.ops.mkldnn._linear_pointwise(x.contiguous(), packed, b, "none", [], "")
    return F.linear(x, w, b)
