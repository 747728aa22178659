"""The fused per-layer CPU ops (engine/ops/layer_ops.cpp) against their eager references, on
shapes off the vector width, and the fallbacks where they do not apply."""

from __future__ import annotations

import pytest
import torch

from tetri_server.engine.ops import layer as L
from tetri_server.engine.ops import load_cpu_ops

pytestmark = pytest.mark.skipif(not load_cpu_ops(), reason="the C++ ops could not be built")
TOL = {"rtol": 1e-5, "atol": 1e-5}


@pytest.mark.parametrize(("t", "h"), [(1, 64), (7, 37), (33, 512), (130, 17)])
def test_norms_match_the_reference(t: int, h: int) -> None:
    g = torch.Generator().manual_seed(t * h)
    x, d = torch.randn(t, h, generator=g), torch.randn(t, h, generator=g)
    w = torch.randn(h, generator=g)
    torch.testing.assert_close(L.rms_norm(x, w, 1e-6), L.rms_norm_ref(x, w, 1e-6), **TOL)
    x1, x2 = x.clone(), x.clone()
    out = L.add_rms_norm(x1, d, w, 1e-5)
    torch.testing.assert_close(out, L.add_rms_norm_ref(x2, d, w, 1e-5), **TOL)
    assert torch.equal(x1, x2)  # the residual update is exact and in place


@pytest.mark.parametrize(("t", "heads", "kv_heads", "d"), [(1, 8, 8, 64), (5, 4, 2, 10),
                                                           (40, 6, 3, 128)])
def test_rope_rotates_strided_q_and_k_in_place_like_the_reference(t, heads, kv_heads, d):
    g = torch.Generator().manual_seed(d)
    width = (heads + 2 * kv_heads) * d
    qkv = torch.randn(t, width, generator=g)
    cos, sin = torch.randn(t, 1, d, generator=g), torch.randn(t, 1, d, generator=g)
    ref = qkv.clone()

    def views(buf):  # noqa: ANN001, ANN202
        return (buf[:, :heads * d].view(t, heads, d),
                buf[:, heads * d:(heads + kv_heads) * d].view(t, kv_heads, d))

    L.rope(*views(qkv), cos, sin)
    L.rope_ref(*views(ref), cos, sin)
    torch.testing.assert_close(qkv, ref, **TOL)
    assert torch.equal(qkv[:, (heads + kv_heads) * d:], ref[:, (heads + kv_heads) * d:])  # v


@pytest.mark.parametrize(("t", "inter"), [(1, 16), (9, 37), (64, 1376)])
def test_silu_mul_matches_the_reference(t: int, inter: int) -> None:
    gu = torch.randn(t, 2 * inter, generator=torch.Generator().manual_seed(inter)) * 4
    torch.testing.assert_close(L.silu_mul(gu), L.silu_mul_ref(gu), **TOL)


def test_other_dtypes_and_layouts_take_the_reference() -> None:
    x = torch.randn(6, 32, dtype=torch.bfloat16)
    w = torch.randn(32, dtype=torch.bfloat16)
    assert torch.equal(L.rms_norm(x, w, 1e-6), L.rms_norm_ref(x, w, 1e-6))
    xt = torch.randn(32, 6).t()  # not contiguous
    wf = torch.randn(32)
    assert torch.equal(L.rms_norm(xt, wf, 1e-6), L.rms_norm_ref(xt, wf, 1e-6))
    gu = torch.randn(4, 20, dtype=torch.float64)
    assert torch.equal(L.silu_mul(gu), L.silu_mul_ref(gu))


@pytest.mark.parametrize(("s", "v"), [(1, 1), (3, 15), (32, 8192), (5, 100003)])
def test_argmax_rows_equals_torch_argmax_with_ties_nans_and_infs(s: int, v: int) -> None:
    g = torch.Generator().manual_seed(s + v)
    x = torch.randn(s, v, generator=g)
    if v > 1:
        x[0, v // 2] = x[0, -1] = x[0].max() + 1  # a tie: the first one wins
    if s > 1:
        x[1] = float("-inf")  # no finite entry
    if s > 2:
        x[2, v - 1] = float("nan")
        x[2, v // 3] = float("nan")  # the first NaN wins
        x[2, 0] = float("inf")
    if s > 3:
        x[3, -1] = float("inf")
    assert torch.equal(L.argmax_rows(x), x.argmax(dim=-1))


def test_argmax_rows_falls_back_off_float32() -> None:
    x = torch.randn(4, 9, dtype=torch.bfloat16)
    assert torch.equal(L.argmax_rows(x), x.argmax(dim=-1))
