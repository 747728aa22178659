"""The tiled prefill kernel inside tetri::ragged_attention (prompt chunks of >= 16 rows,
fp32, AVX-512 or AVX2, head_dim 64/128, no window) against SDPA in float64: whole causal chunks,
later chunks at an offset, GQA, and the same bits for a sequence whatever else is in the batch or
however many threads run it."""

from __future__ import annotations

import shutil

import pytest
import torch
import torch.nn.functional as F

from tetri_server.engine import ops
from tetri_server.engine.attention import BatchMetadata, ragged_attention


@pytest.fixture(scope="module", autouse=True)
def built_op():
    if shutil.which("c++") is None and shutil.which("g++") is None:
        pytest.skip("no C++ compiler on this machine")
    if torch.backends.cpu.get_cpu_capability() not in ("AVX512", "AVX2"):
        pytest.skip("the tiled prefill kernel is built for AVX-512 and AVX2 (this build: "
                    f"{torch.backends.cpu.get_cpu_capability()}; such chunks take SDPA)")
    assert ops.load_cpu_ops(), "the C++ attention op did not build (see the WARNING above)"
    # else the op falls back to SDPA and every comparison below passes without the kernel
    assert all(torch.ops.tetri.tiled_prefill_covers(d, 0) for d in (64, 128))
    assert not torch.ops.tetri.tiled_prefill_covers(64, 32)  # a window: SDPA
    assert not torch.ops.tetri.tiled_prefill_covers(80, 0)


def batch(specs: list[tuple[int, int]], gap: int = 16) -> BatchMetadata:
    """specs: (q_len, ctx_len) per sequence, packed in order; extents `gap` tokens apart."""
    q_starts, kv_starts, t, kv = [], [], 0, gap
    for ql, ctx in specs:
        q_starts.append(t)
        kv_starts.append(kv)
        t += ql
        kv += ctx + gap
    return BatchMetadata(q_starts=q_starts, q_lens=[ql for ql, _ in specs],
                         ctx_lens=[ctx for _, ctx in specs], kv_starts=kv_starts,
                         slot_mapping=torch.zeros(t, dtype=torch.long),
                         positions=torch.zeros(t, dtype=torch.long), num_real=t)


def tensors(meta: BatchMetadata, heads: int, kv_heads: int, dim: int, seed: int,
            q_gain: float = 1.0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    pool_tokens = meta.kv_starts[-1] + meta.ctx_lens[-1] + 16
    q = q_gain * torch.randn(meta.num_real, heads, dim, generator=gen)
    kv = torch.randn(2, kv_heads, pool_tokens, dim, generator=gen)
    return q, kv[0], kv[1]


def sdpa(q: torch.Tensor, pk: torch.Tensor, pv: torch.Tensor, meta: BatchMetadata, i: int,
         dtype: torch.dtype) -> torch.Tensor:
    """Sequence i's rows [q_len, heads, D] by ATen's SDPA in `dtype`."""
    qs, ql, ctx, ks = meta.q_starts[i], meta.q_lens[i], meta.ctx_lens[i], meta.kv_starts[i]
    groups = q.shape[1] // pk.shape[0]
    k = pk[:, ks:ks + ctx].to(dtype).repeat_interleave(groups, 0)
    v = pv[:, ks:ks + ctx].to(dtype).repeat_interleave(groups, 0)
    mask = torch.ones(ql, ctx, dtype=torch.bool).tril(ctx - ql)  # row i sees keys <= ctx-ql+i
    o = F.scaled_dot_product_attention(q[qs:qs + ql].to(dtype).transpose(0, 1), k, v,
                                       attn_mask=mask)
    return o.transpose(0, 1)


def assert_as_accurate_as_fp32_sdpa(q: torch.Tensor, pk: torch.Tensor, pv: torch.Tensor,
                                    meta: BatchMetadata) -> None:
    """The op's rows of sequence 0 are within 2x (+1e-6) of fp32 SDPA's max abs error against
    fp64 SDPA (fp32 scores carry an error that grows with their size)."""
    got = ragged_attention(q, pk, pv, meta)
    qs, ql = meta.q_starts[0], meta.q_lens[0]
    want = sdpa(q, pk, pv, meta, 0, torch.float64)
    err = (got[qs:qs + ql].double() - want).abs().max().item()
    err_fp32 = (sdpa(q, pk, pv, meta, 0, torch.float32).double() - want).abs().max().item()
    assert err <= 2 * err_fp32 + 1e-6, f"max abs error {err:.2e}, fp32 SDPA {err_fp32:.2e}"


CASES = [  # (q_len, ctx_len): a whole chunk (no multiple of the 48- or 16-row tile), later chunks
    # at an offset; 29 rows end in an odd partial 16-row tile (13 rows)
    (200, 200), (70, 300), (16, 16), (17, 600), (256, 1024), (29, 300)]


@pytest.mark.parametrize(("heads", "kv_heads"), [(8, 8), (8, 2)])
@pytest.mark.parametrize("dim", [64, 128])
@pytest.mark.parametrize(("q_len", "ctx_len"), CASES)
def test_tiled_prefill_matches_fp64_sdpa(q_len, ctx_len, dim, heads, kv_heads):
    meta = batch([(q_len, ctx_len)])
    q, pk, pv = tensors(meta, heads, kv_heads, dim, seed=q_len * 7 + ctx_len + dim)
    assert_as_accurate_as_fp32_sdpa(q, pk, pv, meta)


@pytest.mark.parametrize("dim", [64, 128])
def test_peaked_softmax_matches_fp64_sdpa(dim):
    """Large scores (keys far below a row's max, some under 2^-126 of it)."""
    meta = batch([(90, 250)])
    q, pk, pv = tensors(meta, 4, 2, dim, seed=dim, q_gain=12.0)
    assert_as_accurate_as_fp32_sdpa(q, pk, pv, meta)


def test_strided_queries_as_the_models_pass_them():
    """q a view into the qkv rows (stride 3 x heads x D), as the Llama layer hands it over."""
    meta = batch([(120, 300)])
    heads, dim = 8, 64
    gen = torch.Generator().manual_seed(9)
    qkv = torch.randn(meta.num_real, 3 * heads * dim, generator=gen)
    q = qkv[:, :heads * dim].view(meta.num_real, heads, dim)
    assert not q.is_contiguous()
    _, pk, pv = tensors(meta, heads, heads, dim, seed=10)
    assert_as_accurate_as_fp32_sdpa(q, pk, pv, meta)
    assert torch.equal(ragged_attention(q, pk, pv, meta),
                       ragged_attention(q.contiguous(), pk, pv, meta))


@pytest.mark.parametrize("dim", [64, 128])
def test_a_sequence_gets_the_same_bits_beside_others_and_on_any_thread_count(dim):
    alone = batch([(130, 400)])
    q, pk, pv = tensors(alone, 8, 2, dim, seed=3)
    want = ragged_attention(q, pk, pv, alone)
    # The same sequence second in a batch: other rows before it, its extent elsewhere.
    mixed = batch([(40, 90), (1, 33), (130, 400)], gap=48)
    q2, pk2, pv2 = tensors(mixed, 8, 2, dim, seed=4)
    qs, ks = mixed.q_starts[2], mixed.kv_starts[2]
    q2[qs:qs + 130] = q
    pk2[:, ks:ks + 400] = pk[:, alone.kv_starts[0]:alone.kv_starts[0] + 400]
    pv2[:, ks:ks + 400] = pv[:, alone.kv_starts[0]:alone.kv_starts[0] + 400]
    threads = torch.get_num_threads()
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            assert torch.equal(ragged_attention(q, pk, pv, alone), want), f"{n} threads"
            got = ragged_attention(q2, pk2, pv2, mixed)[qs:qs + 130]
            assert torch.equal(got, want), f"beside other sequences, {n} threads"
    finally:
        torch.set_num_threads(threads)
