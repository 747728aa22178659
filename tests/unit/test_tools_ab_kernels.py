"""tools/ab_kernels.py: its "cold" calls find their data in DRAM."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))
import ab_kernels  # noqa: E402
from ab_kernels import hot_cold_ms  # noqa: E402

MEASURE_RESIDENT = """
import os, sys
sys.path.insert(0, sys.argv[1])
from ab_kernels import eviction_buffer
def resident():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
before = resident()
buf = eviction_buffer(64 << 20)
buf.sum()
print(resident() - before)
"""


@pytest.mark.skipif(not Path("/proc/self/statm").exists(), reason="needs Linux /proc")
def test_the_buffer_read_before_a_cold_call_is_real_memory():
    """An untouched buffer's pages all map the one zero page: reading it evicts nothing, and
    the "cold" call ran from L3 (session 55). Its whole size must be resident. Measured in a
    fresh process: in this one the allocator may hand back pages that earlier tests freed,
    already resident (session 56: the CI run failed so, growth 0)."""
    tools = str(Path(__file__).resolve().parents[2] / "tools")
    out = subprocess.run([sys.executable, "-c", MEASURE_RESIDENT, tools], capture_output=True,
                         text=True, timeout=120, check=True).stdout
    assert int(out.split()[-1]) >= 0.9 * (64 << 20)


def test_every_cold_call_comes_after_reading_the_eviction_buffer(monkeypatch):
    import torch

    events: list[str] = []

    class Buffer:
        def sum(self) -> torch.Tensor:
            events.append("evict")
            return torch.zeros(())

    monkeypatch.setattr(ab_kernels, "eviction_buffer", lambda nbytes=0: Buffer())

    def call(key: str):
        return lambda r: events.append(f"{key} {'hot' if r is None else 'cold'}")

    hot_cold_ms({"A": call("A"), "B": call("B")}, 2)
    colds = [i for i, e in enumerate(events) if e.endswith("cold")]
    assert len(colds) == 4 and all(events[i - 1] == "evict" for i in colds)


def test_pool_layouts_run_each_arm_on_its_own_pool(model_dir, capsys):
    """``--pool-layouts A,B``: A's engine has a pool of layout A and B's of layout B, both on the
    built ops; every step of the A/B runs on its arm's engine."""
    from tetri_server.engine.ops import load_cpu_ops

    if not load_cpu_ops():
        pytest.skip("the C++ ops do not build here")
    path = model_dir("llama", hidden_size=256, num_attention_heads=4, num_key_value_heads=4,
                     intermediate_size=512)
    a, b = ab_kernels.make_arms(path, set(), ("head-major", "token-major"))(2, 40)
    assert a.drv is not b.drv and a.kernels is b.kernels
    assert a.drv.eng.kv.is_contiguous()
    assert b.drv.eng.kv.stride(3) == 4 * 64  # a token's 4 kv heads of 64 side by side
    ran: list[object] = []

    def steps(drv):
        ran.append(drv)
        return drv.decode_step_times(2, 16, 2, 1, "ab")

    ma, mb, paired = ab_kernels.interleaved_ms(a, b, 2, steps)
    assert ran == [a.drv, b.drv, b.drv, a.drv] and min(ma, mb, paired) > 0
    ab_kernels.ab_prefill(["24/8"], 1, lambda batch, ctx: (a, b))
    assert "24 tokens in chunks of 8" in capsys.readouterr().out


@pytest.mark.parametrize("layout", ["head-major", "token-major"])
def test_attention_pools_have_the_engine_layout_and_the_same_result(layout):
    """``--attention-layout``: the op alone over a pool of that layout. A token's kv heads sit
    side by side in a token-major pool (the engine's strides), each head's rows in one run in a
    head-major one; the built op gives SDPA's result over either."""
    import math

    import torch
    import torch.nn.functional as F

    from tetri_server.engine.ops import load_cpu_ops

    if not load_cpu_ops():
        pytest.skip("the C++ ops do not build here")
    shape = ab_kernels.AttentionShape(3, 40, heads=4, kv_heads=2, head_dim=32)
    pool_k, pool_v = ab_kernels.attention_pools(shape, layout, torch.Generator().manual_seed(0))
    assert pool_k.shape == pool_v.shape == (2, 120, 32)
    row, head = (2 * 32, 32) if layout == "token-major" else (32, 120 * 32)
    assert (pool_k.stride(1), pool_k.stride(0)) == (row, head)
    q = torch.randn(3, 4, 32, generator=torch.Generator().manual_seed(1))
    out = torch.empty_like(q)
    torch.ops.tetri.ragged_attention(q, pool_k, pool_v, out, torch.arange(3),
                                     torch.ones(3, dtype=torch.long), torch.full((3,), 40),
                                     torch.arange(3) * 40, 1 / math.sqrt(32), 0)
    for b in range(3):
        keys = slice(40 * b, 40 * b + 40)
        ref = F.scaled_dot_product_attention(q[b].unsqueeze(1), pool_k[:, keys], pool_v[:, keys],
                                             enable_gqa=True)
        torch.testing.assert_close(out[b], ref.squeeze(1))
