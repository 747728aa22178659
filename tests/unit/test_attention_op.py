"""tetri::ragged_attention (the one attention call per layer) equals the per-sequence SDPA loop
it replaces on random ragged batches over the KV pool, gives a sequence the same bits whatever
else is in the batch, and falls back to the loop with a WARNING when it cannot be built."""

from __future__ import annotations

import os
import random
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tetri_server.engine import ops
from tetri_server.engine.attention import BatchMetadata, paged_attention, ragged_attention

from .triton_interpreter import run_interpreted

BLOCK = 16
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module", autouse=True)
def built_op():
    """Build (or load) the op once for the module; a build failure here is a test failure."""
    if shutil.which("c++") is None and shutil.which("g++") is None:
        pytest.skip("no C++ compiler on this machine")
    assert ops.load_cpu_ops(), "the C++ attention op did not build (see the WARNING above)"


def make_batch(rng: random.Random, specs: list[tuple[int, int]], pool_tokens: int,
               num_pad: int = 0, at_end: bool = True) -> BatchMetadata:
    """specs: (q_len, ctx_len) per sequence. Extents start on block edges with random gaps;
    with ``at_end`` the last extent ends exactly at the end of the pool."""
    q_starts, kv_starts, slots = [], [], []
    t = 0
    cursor = 0
    for i, (ql, ctx) in enumerate(specs):
        q_starts.append(t)
        t += ql
        if at_end and i == len(specs) - 1:
            start = pool_tokens - ctx
            assert start >= cursor, "pool too small for the batch"
        else:
            start = cursor + BLOCK * rng.randint(0, 2)
        kv_starts.append(start)
        cursor = min(pool_tokens, start + -(-ctx // BLOCK) * BLOCK)
        slots += range(start + ctx - ql, start + ctx)
    assert cursor <= pool_tokens
    return BatchMetadata(q_starts=q_starts, q_lens=[ql for ql, _ in specs],
                         ctx_lens=[ctx for _, ctx in specs], kv_starts=kv_starts,
                         slot_mapping=torch.tensor(slots, dtype=torch.long),
                         positions=torch.zeros(t + num_pad, dtype=torch.long), num_real=t)


def random_specs(rng: random.Random, n: int) -> list[tuple[int, int]]:
    """Decode rows (context 1, block edges, random) mixed with prompt chunks at any offset,
    short ones (the kernel) and long ones (SDPA inside the op)."""
    specs = []
    for _ in range(n):
        kind = rng.choice(["decode", "decode", "edge", "chunk", "long", "first"])
        if kind == "decode":
            specs.append((1, rng.randint(1, 300)))
        elif kind == "edge":
            specs.append((1, BLOCK * rng.randint(1, 8) + rng.choice([-1, 0, 1])))
        elif kind == "chunk":
            ql = rng.randint(2, 15)
            specs.append((ql, ql + rng.randint(0, 200)))
        elif kind == "long":
            ql = rng.randint(16, 90)
            specs.append((ql, ql + rng.choice([0, rng.randint(1, 150)])))
        else:
            specs.append((rng.randint(1, 40),) * 2)
    return specs


def tensors(rng: random.Random, tokens: int, heads: int, kv_heads: int, dim: int,
            pool_tokens: int, dtype: torch.dtype,
            layout: str = "head-major") -> tuple[torch.Tensor, ...]:
    """q and the pools [kv_heads, pool_tokens, dim]; token-major: views of a buffer with a
    token's kv heads side by side (as ``PoolGeometry.view``), the same values."""
    gen = torch.Generator().manual_seed(rng.randrange(1 << 30))
    q = torch.randn(tokens, heads, dim, generator=gen).to(dtype)
    kv = torch.randn(2, kv_heads, pool_tokens, dim, generator=gen).to(dtype)
    if layout == "token-major":
        return q, as_token_major(kv[0]), as_token_major(kv[1])
    return q, kv[0], kv[1]


def as_token_major(pool: torch.Tensor) -> torch.Tensor:
    """The same values stored with a token's kv heads side by side (as ``PoolGeometry.view``)."""
    return pool.transpose(0, 1).contiguous().transpose(0, 1)


# (heads, kv_heads, D); on AVX2 D is 2, 8, 8, 5, 9, 10, 16 and 20 Vecs (72 and 80: a register
# path in two passes of unequal width; 160: past the register paths, the generic one); on AVX-512
# 160 is 10 Vecs, the value pass in two
SHAPES = [(4, 2, 16), (8, 8, 64), (8, 2, 64), (6, 3, 40), (4, 2, 72), (4, 2, 80), (4, 2, 128),
          (4, 2, 160)]


@pytest.mark.parametrize("layout", ["head-major", "token-major"])
@pytest.mark.parametrize("window", [0, 1, 5, 16, 64])
@pytest.mark.parametrize(("heads", "kv_heads", "dim"), SHAPES)
def test_op_equals_the_sdpa_loop_on_random_ragged_batches(heads, kv_heads, dim, window, layout):
    for seed in range(3):
        rng = random.Random(seed * 1000 + heads + dim + window)
        specs = random_specs(rng, rng.randint(1, 12))
        pool_tokens = BLOCK * sum(-(-ctx // BLOCK) + 2 for _, ctx in specs) + BLOCK * 4
        num_pad = rng.choice([0, 0, 3])
        meta = make_batch(rng, specs, pool_tokens, num_pad)
        q, pk, pv = tensors(rng, meta.num_real + num_pad, heads, kv_heads, dim, pool_tokens,
                            torch.float32, layout)
        got = ragged_attention(q, pk, pv, meta, window=window)
        ref = paged_attention(q, pk, pv, meta, window=window)
        torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5,
                                   msg=lambda m, specs=specs: f"{specs}: {m}")
        assert not got[meta.num_real:].any(), "padding rows must stay zero"


@pytest.mark.parametrize("layout", ["head-major", "token-major"])
@pytest.mark.parametrize("window", [0, 24])
@pytest.mark.parametrize(("heads", "kv_heads", "dim"), [(4, 2, 16), (8, 8, 64)])
def test_bf16_within_tolerance_of_fp32(heads, kv_heads, dim, window, layout):
    """(kv.layout = token-major set by hand with a bf16 model: the head-by-head walk over it)"""
    rng = random.Random(7)
    specs = random_specs(rng, 10) + [(1, 1), (1, BLOCK), (3, 3)]
    pool_tokens = BLOCK * sum(-(-ctx // BLOCK) + 2 for _, ctx in specs)
    meta = make_batch(rng, specs, pool_tokens)
    q, pk, pv = tensors(rng, meta.num_real, heads, kv_heads, dim, pool_tokens, torch.bfloat16,
                        layout)
    got = ragged_attention(q, pk, pv, meta, window=window)
    assert got.dtype == torch.bfloat16
    ref = paged_attention(q.float(), pk.float(), pv.float(), meta, window=window)
    torch.testing.assert_close(got.float(), ref, atol=2e-2, rtol=2e-2)


def test_strided_q_and_explicit_scale():
    """OPT passes q as a strided view of the fused qkv output."""
    rng = random.Random(3)
    specs = [(1, 40), (5, 37), (20, 20), (1, 1)]
    meta = make_batch(rng, specs, 512)
    qkv = torch.randn(meta.num_real, 3, 4, 16)
    pool = torch.randn(2, 4, 512, 16)
    q = qkv.unbind(1)[0]
    assert not q.is_contiguous()
    got = ragged_attention(q, pool[0], pool[1], meta, scale=0.3)
    torch.testing.assert_close(got, paged_attention(q, pool[0], pool[1], meta, scale=0.3),
                               atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("window", [0, 20])
@pytest.mark.parametrize(("heads", "kv_heads", "dim"), [(4, 2, 16), (8, 8, 64)])
def test_a_sequence_gets_the_same_bits_alone_or_in_any_batch(heads, kv_heads, dim, window):
    rng = random.Random(11)
    pool_tokens = 4096
    q_all, pk, pv = tensors(rng, 400, heads, kv_heads, dim, pool_tokens, torch.float32)
    for spec in [(1, 1), (1, 200), (7, 150), (40, 90), (33, 33)]:
        ql, ctx = spec
        ks = 1024
        alone = BatchMetadata([0], [ql], [ctx], [ks], torch.zeros(0, dtype=torch.long),
                              torch.zeros(ql, dtype=torch.long), ql)
        ref = ragged_attention(q_all[:ql], pk, pv, alone, window=window)
        for trial in range(3):
            others = random_specs(rng, rng.randint(1, 6))
            pos = rng.randint(0, len(others))
            specs = others[:pos] + [spec] + others[pos:]
            q_starts, t = [], 0
            for s_ql, _ in specs:
                q_starts.append(t)
                t += s_ql
            kv = [2048 + 128 * i for i in range(len(specs))]
            kv[pos] = ks
            meta = BatchMetadata(q_starts, [s[0] for s in specs], [s[1] for s in specs], kv,
                                 torch.zeros(0, dtype=torch.long),
                                 torch.zeros(t, dtype=torch.long), t)
            q = torch.randn(t, heads, dim)
            q[q_starts[pos]:q_starts[pos] + ql] = q_all[:ql]
            got = ragged_attention(q, pk, pv, meta, window=window)
            assert torch.equal(got[q_starts[pos]:q_starts[pos] + ql], ref), (spec, trial, specs)


def rows_alone(q: torch.Tensor, ql: int, ctx: int, ks: int) -> BatchMetadata:
    """The ql rows of one prompt chunk over ctx keys from ks, each sent as its own one-row
    sequence at its own position (the same keys, ctx - ql + r + 1 of them)."""
    return BatchMetadata(list(range(ql)), [1] * ql, [ctx - ql + r + 1 for r in range(ql)],
                         [ks] * ql, torch.zeros(0, dtype=torch.long),
                         torch.zeros(ql, dtype=torch.long), ql)


@pytest.mark.parametrize("rows_only", [True, False])
@pytest.mark.parametrize("window", [0, 20])
@pytest.mark.parametrize(("heads", "kv_heads", "dim"), SHAPES)
def test_a_prompt_row_gets_the_bits_of_the_row_alone(heads, kv_heads, dim, window, rows_only):
    """The row kernel takes a prompt chunk's rows in tiles that share each whole key block
    (session 51); every row must still get exactly the bits it gets as a one-row sequence,
    whatever the chunk's length, its offset in the context and the block edges. With
    rows_only (model.batch_invariant) every chunk takes that kernel, else chunks under 16
    rows."""
    rng = random.Random(heads * 100 + dim + window)
    pool_tokens = 1024
    q_all, pk, pv = tensors(rng, 300, heads, kv_heads, dim, pool_tokens, torch.float32)
    specs = [(2, 2), (3, 129), (5, 70), (15, 200), (64, 64), (65, 65), (37, 300), (130, 130),
             (131, 260)]
    torch.ops.tetri.set_attention_rows_only(rows_only)
    try:
        for ql, ctx in specs:
            if not rows_only and ql >= 16:
                continue
            ks = 16 * rng.randint(0, 40)
            chunk = BatchMetadata([0], [ql], [ctx], [ks], torch.zeros(0, dtype=torch.long),
                                  torch.zeros(ql, dtype=torch.long), ql)
            got = ragged_attention(q_all[:ql], pk, pv, chunk, window=window)
            alone = ragged_attention(q_all[:ql], pk, pv, rows_alone(q_all, ql, ctx, ks),
                                     window=window)
            assert torch.equal(got, alone), (ql, ctx, (got - alone).abs().max().item())
            ref = paged_attention(q_all[:ql], pk, pv, chunk, window=window)
            torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)
    finally:
        torch.ops.tetri.set_attention_rows_only(False)


@pytest.mark.parametrize("window", [0, 3, 70])
@pytest.mark.parametrize(("heads", "kv_heads", "dim"), SHAPES)
def test_a_token_major_pool_gives_the_bits_of_a_head_major_one(heads, kv_heads, dim, window):
    """Decode rows over a token-major pool walk each key's rows of every head in address order
    (session 56) with the float operations of the head-by-head walk: the same values in either
    layout give the same bits, whatever the batch, the block edges and the thread count (which
    splits a sequence's heads over items)."""
    rng = random.Random(heads * 7 + dim + window)
    specs = random_specs(rng, 10) + [(1, 1), (1, 4), (1, 63), (1, 64), (1, 65), (1, 130)]
    rng.shuffle(specs)
    pool_tokens = BLOCK * sum(-(-ctx // BLOCK) + 2 for _, ctx in specs)
    meta = make_batch(rng, specs, pool_tokens, num_pad=2)
    q, pk, pv = tensors(rng, meta.num_real + 2, heads, kv_heads, dim, pool_tokens, torch.float32)
    tk, tv = as_token_major(pk), as_token_major(pv)
    assert tk.stride(1) == kv_heads * dim and torch.equal(tk, pk)
    # one decode row alone: with 2 or 3 threads its heads are split over items; two rows with 3
    # threads: 6 items of ceil(kv_heads / 6) heads each, the last ones empty with 8 kv heads
    one = BatchMetadata([0], [1], [150], [meta.kv_starts[0]], torch.zeros(0, dtype=torch.long),
                        torch.zeros(1, dtype=torch.long), 1)
    two = BatchMetadata([0, 1], [1, 1], [150, 70], meta.kv_starts[:2],
                        torch.zeros(0, dtype=torch.long), torch.zeros(2, dtype=torch.long), 2)
    threads = torch.get_num_threads()
    try:
        for n in (1, 2, 3):
            torch.set_num_threads(n)
            for m, rows in ((meta, q), (one, q[:1]), (two, q[:2])):
                head_major = ragged_attention(rows, pk, pv, m, window=window)
                token_major = ragged_attention(rows, tk, tv, m, window=window)
                assert torch.equal(head_major, token_major), (
                    n, m.q_lens, (head_major - token_major).abs().max())
    finally:
        torch.set_num_threads(threads)


def test_bad_metadata_is_a_clear_error():
    q, pool = torch.randn(3, 4, 16), torch.randn(2, 2, 64, 16)
    meta = BatchMetadata([0], [3], [3], [62], torch.zeros(0, dtype=torch.long),
                         torch.zeros(3, dtype=torch.long), 3)  # extent runs past the pool
    with pytest.raises(RuntimeError, match="out of range"):
        ragged_attention(q, pool[0], pool[1], meta)


ZERO_HEADS_SCRIPT = """
import torch
from tetri_server.engine.ops import load_cpu_ops
assert load_cpu_ops()
q = torch.randn(3, 0, 16)
meta = (torch.tensor([0]), torch.tensor([3]), torch.tensor([3]), torch.tensor([0]))
try:
    torch.ops.tetri.ragged_attention(q, torch.randn(2, 64, 16), torch.randn(2, 64, 16),
                                     torch.empty_like(q), *meta, 0.25, 0)
except RuntimeError as e:
    print(str(e).splitlines()[0])
"""


def test_zero_query_heads_are_a_clear_error():
    """0 query heads passed the heads % kv_heads check and the row kernel divided by the group
    size (0): the process died of SIGFPE. Run in a fresh process so that a crash is a failure,
    not the end of the test session."""
    proc = subprocess.run([sys.executable, "-c", ZERO_HEADS_SCRIPT], cwd=ROOT,
                          capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, f"rc {proc.returncode}: {proc.stderr[-2000:]}"
    assert "positive multiple of kv_heads" in proc.stdout, proc.stdout + proc.stderr[-2000:]


def test_fake_implementation_for_tracing():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        q, pool, out = torch.empty(5, 4, 16), torch.empty(2, 2, 64, 16), torch.empty(5, 4, 16)
        meta = [torch.zeros(2, dtype=torch.long) for _ in range(4)]
        torch.ops.tetri.ragged_attention(q, pool[0], pool[1], out, *meta, 0.25, 0)
        assert out.shape == (5, 4, 16)


NO_COMPILER_SCRIPT = """
import logging, torch
logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s %(message)s")
from tetri_server.engine.attention import BatchMetadata, paged_attention, ragged_attention
meta = BatchMetadata([0, 1], [1, 4], [9, 4], [0, 16], torch.zeros(0, dtype=torch.long),
                     torch.zeros(5, dtype=torch.long), 5)
q, pool = torch.randn(5, 4, 16), torch.randn(2, 2, 64, 16)
for _ in range(3):
    got = ragged_attention(q, pool[0], pool[1], meta)
assert torch.equal(got, paged_attention(q, pool[0], pool[1], meta))
print("LOOP OK")
"""


def test_without_a_compiler_it_warns_once_and_takes_the_loop(tmp_path):
    """A fresh process (the op is already loaded in this one) with empty caches and a compiler
    that does not exist."""
    env = dict(os.environ, TETRI_CACHE_DIR=str(tmp_path), HOME=str(tmp_path / "home"),
               CXX=str(tmp_path / "no-such-c++"))
    proc = subprocess.run([sys.executable, "-c", NO_COMPILER_SCRIPT], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0 and "LOOP OK" in proc.stdout, proc.stderr[-3000:]
    warnings = [ln for ln in proc.stderr.splitlines() if ln.startswith("WARNING tetri.ops")]
    assert len(warnings) == 1, proc.stderr[-3000:]
    assert "per-sequence SDPA loop" in warnings[0]


def test_one_build_per_isa_never_native(monkeypatch):
    folders, flags = {}, {}
    for isa in ["AVX2", "AVX512", "DEFAULT"]:
        monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda isa=isa: isa)
        name, flags[isa], folders[isa] = ops.build_spec()
        assert isa.lower() in name and folders[isa].name.startswith(name)
        assert not any("native" in f for f in flags[isa])
    assert len(set(folders.values())) == 3
    assert "-mavx2" in flags["AVX2"] and not any("avx512" in f for f in flags["AVX2"])
    assert "-mavx512f" in flags["AVX512"]
    assert not any(f.startswith("-m") for f in flags["DEFAULT"])


def test_a_finished_build_in_the_default_cache_serves_any_cache_dir(monkeypatch, tmp_path):
    monkeypatch.setattr(ops, "DEFAULT_CACHE", tmp_path / "default")
    monkeypatch.setenv("TETRI_CACHE_DIR", str(tmp_path / "fresh"))
    name, _, folder = ops.build_spec()
    assert folder.parent == tmp_path / "fresh" / "ops"
    assert ops.build_folder(folder, name) == folder  # nothing built anywhere: build here
    done = tmp_path / "default" / "ops" / folder.name
    done.mkdir(parents=True)
    (done / f"{name}.so").touch()
    assert ops.build_folder(folder, name) == done


_KILLED_BUILD = """
import os, shutil, sys, torch, torch.utils.cpp_extension as ce
from tetri_server.engine import ops
real, calls = sys.argv[1], []
def fake_build(name, sources, build_directory, **kw):
    calls.append(build_directory)
    so = os.path.join(build_directory, name + ".so")
    if len(calls) == 1:  # killed mid-link: half a library written
        with open(so, "wb") as f:
            f.write(open(real, "rb").read()[:4096])
        raise RuntimeError("killed")
    shutil.copy(real, so)
    torch.ops.load_library(so)
ce.load = fake_build
first = ops.load_cpu_ops()
ops.load_cpu_ops.cache_clear()
print("RESULT", first, ops.load_cpu_ops(), len(calls))
"""


def test_a_build_killed_part_way_leaves_nothing_a_later_start_loads(tmp_path):
    """Regression (session 66 review): a cached library was trusted because it existed, and a
    build writes it in place: a build killed mid-link left half a library that every later
    start loaded (a SIGBUS, or the slow path for good). The build now runs in a folder of its
    own and renames the finished library in. (A subprocess: this one has the ops loaded.)"""
    import os
    import subprocess
    import sys

    assert ops.load_cpu_ops()
    name, _, folder = ops.build_spec()
    real = ops.build_folder(folder, name) / f"{name}.so"
    assert real.is_file()
    env = {**os.environ, "HOME": str(tmp_path), "TETRI_CACHE_DIR": str(tmp_path / "cache")}
    out = subprocess.run([sys.executable, "-c", _KILLED_BUILD, str(real)], env=env,
                         capture_output=True, text=True, timeout=300)
    assert "RESULT False True 2" in out.stdout, (out.returncode, out.stdout, out.stderr[-2000:])
    [built] = (tmp_path / "cache" / "ops").glob(f"{name}-*/{name}.so")
    assert built.read_bytes() == real.read_bytes()
    assert not list((tmp_path / "cache" / "ops").glob("*.build-*"))


def test_results_do_not_depend_on_the_thread_count():
    rng = random.Random(5)
    specs = random_specs(rng, 12)
    pool_tokens = BLOCK * sum(-(-ctx // BLOCK) + 2 for _, ctx in specs)
    meta = make_batch(rng, specs, pool_tokens)
    q, pk, pv = tensors(rng, meta.num_real, 4, 2, 16, pool_tokens, torch.float32)
    threads = torch.get_num_threads()
    try:
        outs = []
        for n in (1, 2, 3):
            torch.set_num_threads(n)
            outs.append(ragged_attention(q, pk, pv, meta, window=9))
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])


TRITON_SCRIPT = """
import random, torch
from tests.unit.test_attention_op import make_batch, random_specs, tensors, BLOCK
from tetri_server.engine.attention import paged_attention
from tetri_server.engine.ops.triton_attention import ragged_attention_triton
n = 0
# GQA groups of 2, 3 (a tile with a spare row) and 4, MHA; False: one program per query head
# (a token-major pool for two of them)
for heads, kv_heads, dim, pack, layout in [
        (4, 2, 16, True, "head-major"), (6, 3, 40, True, "head-major"),
        (6, 2, 16, True, "head-major"), (8, 2, 16, True, "head-major"),
        (4, 4, 16, True, "head-major"), (4, 2, 16, False, "head-major"),
        (4, 2, 16, True, "token-major"), (4, 4, 16, False, "token-major")]:
    for window in (0, 5, 16):
        rng = random.Random(heads + window)
        specs = random_specs(rng, 5) + [(1, 1), (1, BLOCK)]
        pool_tokens = BLOCK * sum(-(-ctx // BLOCK) + 2 for _, ctx in specs)
        meta = make_batch(rng, specs, pool_tokens, num_pad=2)
        q, pk, pv = tensors(rng, meta.num_real + 2, heads, kv_heads, dim, pool_tokens,
                            torch.float32, layout)
        out = torch.full_like(q, float("nan"))
        ragged_attention_triton(q, pk, pv, out, *meta.seq_tensors, dim ** -0.5, window,
                                pack_groups=pack)
        ref = paged_attention(q, pk, pv, meta, window=window)
        torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
        n += 1
print("TRITON OK", n)
"""


def test_triton_kernel_logic_in_the_interpreter():
    """The CUDA kernel's indexing, masks and online softmax, run by Triton's CPU interpreter."""
    proc = run_interpreted(TRITON_SCRIPT)
    assert proc.returncode == 0 and "TRITON OK 24" in proc.stdout, proc.stderr[-3000:]


def test_the_triton_launch_fits_cudas_grid_limits_for_a_128k_step(monkeypatch):  # type: ignore[no-untyped-def]
    """Regression (review of session 64): the row blocks were on grid axis 2, whose CUDA limit
    is 65,535: with a GQA group of 9 (one query row a program) a step of 140,000 tokens (a 128k
    prompt, coupled mode) failed to launch, killing the worker. They are on axis 0 now."""
    triton_attention = pytest.importorskip("tetri_server.engine.ops.triton_attention")
    grids = []

    class Launch:
        def __getitem__(self, grid):  # type: ignore[no-untyped-def]
            grids.append(grid)
            return lambda *args, **kwargs: None

    monkeypatch.setattr(triton_attention, "_ragged_attention_kernel", Launch())
    tokens = 140_000
    q = torch.zeros(tokens, 9, 1)
    pool = torch.zeros(1, tokens, 1)
    meta = (torch.tensor([0]), torch.tensor([tokens]), torch.tensor([tokens]), torch.tensor([0]))
    triton_attention.ragged_attention_triton(q, pool, pool, torch.empty_like(q), *meta, 1.0, 0,
                                             pack_groups=True)
    [grid] = grids
    assert grid[0] == tokens and grid[0] < 2**31 and max(grid[1:]) <= 65_535
