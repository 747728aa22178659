"""``tetri::packed_linear`` (engine/ops/linear_ops.cpp) against float64 matmuls, on shapes off
the panel and tile sizes, and the properties the engine relies on: a row's result does not
depend on the rest of the batch, the row count or the thread count; bad input is a clear error;
``tetri::packed_glu`` gives the bits of ``packed_linear`` then ``tetri::silu_mul``; and
``tetri::write_kv`` stores what ``index_copy_`` stores."""

from __future__ import annotations

import pytest
import torch

from tetri_server.engine.attention import BatchMetadata, write_kv, write_kv_ref
from tetri_server.engine.ops import load_cpu_ops
from tetri_server.engine.ops.layer import silu_mul
from tetri_server.engine.ops.linear import (
    glu,
    linear,
    pack_glu_weight,
    pack_weight,
    tall_tile_rows,
    tetri_linear_supported,
)
from tetri_server.hostinfo import cpuinfo

pytestmark = pytest.mark.skipif(not load_cpu_ops() or not tetri_linear_supported(),
                                reason="the C++ ops (AVX2 or AVX-512) could not be built")

# rows across the tall tile (<= 48 rows) and the wide one in row blocks; out features off the
# panel width; in features odd and larger than a row block's budget
ROWS = [1, 5, 12, 13, 47, 48, 49, 97, 600]
SHAPES = [(64, 64), (65, 17), (1000, 300), (7, 3), (96, 2100)]


@pytest.fixture(params=[48, 0], ids=["tall-to-48", "wide-only"], autouse=True)
def tiles(request: pytest.FixtureRequest):  # noqa: ANN201
    """Every test under both tile settings (linear.py picks one per CPU: both must hold)."""
    before = torch.ops.tetri.packed_linear_tall_rows()
    torch.ops.tetri.set_packed_linear_tall_rows(request.param)
    yield request.param
    torch.ops.tetri.set_packed_linear_tall_rows(before)


def test_both_tiles_give_the_same_bits_and_the_setting_is_checked() -> None:
    g = torch.Generator().manual_seed(3)
    w, b = torch.randn(130, 70, generator=g), torch.randn(130, generator=g)
    gu = torch.randn(2 * 64, 70, generator=g)
    packed, gu_packed = pack_weight(w), pack_glu_weight(gu)
    x = torch.randn(48, 70, generator=g)
    before = torch.ops.tetri.packed_linear_tall_rows()
    try:
        outs = []
        for rows in (48, 0):
            torch.ops.tetri.set_packed_linear_tall_rows(rows)
            outs.append((linear(x, w, b, packed), glu(x, gu, gu_packed)))
        assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1])
        with pytest.raises(RuntimeError, match="rows must be in"):
            torch.ops.tetri.set_packed_linear_tall_rows(-1)
    finally:
        torch.ops.tetri.set_packed_linear_tall_rows(before)


def test_the_tall_tile_rows_per_cpu() -> None:
    assert tall_tile_rows("AuthenticAMD", "AVX512") == 0  # measured: the wide tile is faster
    assert tall_tile_rows("GenuineIntel", "AVX512") == 48
    assert tall_tile_rows("AuthenticAMD", "AVX2") == 48  # unmeasured: as before
    torch.ops.tetri.set_packed_linear_tall_rows(7)
    tetri_linear_supported.cache_clear()
    assert tetri_linear_supported()  # what the engine calls before packing: sets this CPU's
    assert torch.ops.tetri.packed_linear_tall_rows() == tall_tile_rows(
        cpuinfo("vendor_id"), torch.backends.cpu.get_cpu_capability())


@pytest.mark.parametrize(("n", "k"), SHAPES)
@pytest.mark.parametrize("bias", [False, True])
def test_equals_a_float64_matmul(n: int, k: int, bias: bool) -> None:
    g = torch.Generator().manual_seed(n * k)
    w = torch.randn(n, k, generator=g)
    b = torch.randn(n, generator=g) if bias else None
    packed = pack_weight(w)
    assert packed is not None and packed.dim() == 3
    for m in ROWS:
        x = torch.randn(m, k, generator=g)
        ref = x.double() @ w.double().t() + (b.double() if b is not None else 0)
        y = linear(x, w, b, packed)
        assert y.shape == (m, n) and y.dtype == torch.float32 and y.is_contiguous()
        torch.testing.assert_close(y.double(), ref, rtol=1e-5, atol=1e-4 * k ** 0.5)


def test_a_row_gets_the_same_bits_alone_or_in_any_batch() -> None:
    g = torch.Generator().manual_seed(7)
    w, b = torch.randn(200, 150, generator=g), torch.randn(200, generator=g)
    packed = pack_weight(w)
    rows = torch.randn(600, 150, generator=g)
    alone = torch.cat([linear(rows[i:i + 1], w, b, packed) for i in range(0, 600, 37)])
    for m in (2, 13, 48, 49, 300, 600):  # both tiles, several row blocks
        batch = linear(rows[:m], w, b, packed)
        for j, i in enumerate(range(0, 600, 37)):
            if i < m:
                assert torch.equal(batch[i], alone[j]), (m, i)


def test_results_do_not_depend_on_the_thread_count() -> None:
    g = torch.Generator().manual_seed(3)
    w, x = torch.randn(700, 64, generator=g), torch.randn(40, 64, generator=g)
    packed = pack_weight(w)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = linear(x, w, None, packed)
        torch.set_num_threads(2)
        two = linear(x, w, None, packed)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, two)


def test_a_pack_of_another_shape_is_a_clear_error() -> None:
    w = torch.randn(100, 32)
    packed = pack_weight(w)
    with pytest.raises(RuntimeError, match="not a pack_linear_weight"):
        torch.ops.tetri.packed_linear(torch.randn(4, 31), packed, None, 100)
    with pytest.raises(RuntimeError, match="not a pack_linear_weight"):
        torch.ops.tetri.packed_linear(torch.randn(4, 32), packed, None, 200)
    with pytest.raises(RuntimeError, match="bias"):
        torch.ops.tetri.packed_linear(torch.randn(4, 32), packed, torch.randn(99), 100)


def test_other_dtypes_and_devices_keep_f_linear() -> None:
    w = torch.randn(16, 8, dtype=torch.bfloat16)
    assert pack_weight(w) is None
    x = torch.randn(3, 8, dtype=torch.bfloat16)
    assert torch.equal(linear(x, w, None, None), torch.nn.functional.linear(x, w))


# inter sizes: the bench model's; one whole panel pair short (the last panel holds one gate/up
# pair); a single pair
@pytest.mark.parametrize(("inter", "k"), [(1408, 512), (48, 37), (16, 300)])
def test_glu_gives_the_bits_of_linear_then_silu_mul(inter: int, k: int) -> None:
    g = torch.Generator().manual_seed(inter + k)
    w = torch.randn(2 * inter, k, generator=g) * k ** -0.5
    fused, plain = pack_glu_weight(w), pack_weight(w)
    assert fused is not None and fused.dim() == 4  # the GLU pack
    for m in ROWS:
        x = torch.randn(m, k, generator=g)
        want = silu_mul(linear(x, w, None, plain))
        got = glu(x, w, fused)
        assert got.shape == (m, inter) and got.is_contiguous()
        assert torch.equal(got, want), m
        gate, up = (x.double() @ w.double().t()).chunk(2, dim=-1)
        torch.testing.assert_close(got.double(), torch.nn.functional.silu(gate) * up,
                                   rtol=1e-5, atol=1e-5)


def test_glu_rows_do_not_depend_on_the_batch() -> None:
    g = torch.Generator().manual_seed(11)
    w, rows = torch.randn(2 * 96, 64, generator=g), torch.randn(300, 64, generator=g)
    packed = pack_glu_weight(w)
    alone = torch.cat([glu(rows[i:i + 1], w, packed) for i in range(0, 300, 29)])
    for m in (7, 48, 49, 300):
        batch = glu(rows[:m], w, packed)
        for j, i in enumerate(range(0, 300, 29)):
            if i < m:
                assert torch.equal(batch[i], alone[j]), (m, i)


def test_a_glu_pack_is_refused_by_linear_and_an_odd_size_keeps_the_plain_pack() -> None:
    w = torch.randn(64, 16)
    packed = pack_glu_weight(w)
    with pytest.raises(ValueError, match="glu"):
        linear(torch.randn(2, 16), w, None, packed)
    with pytest.raises(RuntimeError, match="not a pack_linear_weight"):
        torch.ops.tetri.packed_linear(torch.randn(2, 16), packed, None, 64)
    with pytest.raises(RuntimeError, match="not a pack_glu_weight"):
        torch.ops.tetri.packed_glu(torch.randn(2, 16), packed, 64)
    odd = torch.randn(2 * 20, 16)  # 20 features: not a whole number of vectors
    pack = pack_glu_weight(odd)
    assert pack is not None and pack.dim() == 3
    x = torch.randn(3, 16)
    assert torch.equal(glu(x, odd, pack), silu_mul(linear(x, odd, None, pack)))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_write_kv_stores_what_index_copy_stores(dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(11)
    kv_heads, d, t = 3, 40, 9
    qkv = torch.randn(t + 2, (4 + 2 * kv_heads) * d, generator=g).to(dtype)  # strided k, v
    k = qkv[:, 4 * d:(4 + kv_heads) * d].view(t + 2, kv_heads, d)
    v = qkv[:, (4 + kv_heads) * d:].view(t + 2, kv_heads, d)
    slots = torch.randperm(64, generator=g)[:t]  # the first t rows are real, 2 are padding
    meta = BatchMetadata([0], [t], [t], [0], slot_mapping=slots,
                         positions=torch.zeros(t + 2, dtype=torch.long), num_real=t)
    pools = [torch.zeros(kv_heads, 64, d, dtype=dtype) for _ in range(4)]
    write_kv(pools[0], pools[1], k, v, meta)
    write_kv_ref(pools[2], pools[3], k, v, meta)
    assert torch.equal(pools[0], pools[2]) and torch.equal(pools[1], pools[3])
    assert pools[0].abs().sum() > 0


def test_write_kv_outside_the_pool_is_a_clear_error() -> None:
    pool = torch.zeros(2, 8, 4)
    k = torch.randn(1, 2, 4)
    with pytest.raises(RuntimeError, match="outside the pool"):
        torch.ops.tetri.write_kv(pool, pool.clone(), k, k, torch.tensor([8]))
