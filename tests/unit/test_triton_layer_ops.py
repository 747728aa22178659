"""The Triton kernels of the small layer ops and the KV write (engine/ops/triton_layer.py, the
CUDA path) against their eager references, run by Triton's CPU interpreter: fp32 and fp16, odd
sizes, strided q/k views of the qkv rows, the residual update in place. bf16 is compared on a
GPU (tests/gpu): the interpreter truncates to bf16 where the GPU rounds."""

from __future__ import annotations

import json
from pathlib import Path

from tests.conftest import hf_greedy, random_prompts

from .triton_interpreter import run_interpreted

SCRIPT = """
import torch
from tetri_server.engine.ops import layer as L
from tetri_server.engine.ops import triton_layer as T
n = 0
for dtype, tol in ((torch.float32, 1e-5), (torch.float16, 2e-3)):
    close = lambda a, b: torch.testing.assert_close(a, b, atol=tol, rtol=tol)
    for t, h in ((1, 64), (7, 37), (33, 512), (3, 1500)):
        g = torch.Generator().manual_seed(t * h)
        x, d = (torch.randn(t, h, generator=g).to(dtype) for _ in range(2))
        w = torch.randn(h, generator=g).to(dtype)
        close(T.rms_norm(x, w, 1e-6), L.rms_norm_ref(x, w, 1e-6))
        wide = torch.randn(t, h + 5, generator=g).to(dtype)[:, 2:h + 2]  # strided rows
        close(T.rms_norm(wide, w, 1e-6), L.rms_norm_ref(wide, w, 1e-6))
        x1, x2 = x.clone(), x.clone()
        close(T.rms_norm(x1, w, 1e-5, d), L.add_rms_norm_ref(x2, d, w, 1e-5))
        assert torch.equal(x1, x2)  # the residual update, in place, rounded as PyTorch does
        n += 1
    for t, heads, kv_heads, dim in ((1, 8, 8, 64), (5, 4, 2, 10), (9, 6, 3, 128)):
        g = torch.Generator().manual_seed(dim)
        qkv = torch.randn(t, (heads + 2 * kv_heads) * dim, generator=g).to(dtype)
        cos, sin = (torch.randn(t, 1, dim, generator=g).to(dtype) for _ in range(2))
        ref = qkv.clone()
        def views(buf):
            return (buf[:, :heads * dim].view(t, heads, dim),
                    buf[:, heads * dim:(heads + kv_heads) * dim].view(t, kv_heads, dim))
        T.rope_(*views(qkv), cos, sin)
        L.rope_ref(*views(ref), cos, sin)
        close(qkv, ref)
        assert torch.equal(qkv[:, (heads + kv_heads) * dim:], ref[:, (heads + kv_heads) * dim:])
        # the KV write: rows of strided k/v views to scattered slots, the rest untouched
        pool = torch.randn(2, kv_heads, 50, dim, generator=g).to(dtype)
        ref_pool = pool.clone()
        k = qkv[:, heads * dim:(heads + kv_heads) * dim].view(t, kv_heads, dim)
        v = qkv[:, (heads + kv_heads) * dim:].view(t, kv_heads, dim)
        slots = torch.randperm(50, generator=g)[:t]
        T.write_kv(pool[0], pool[1], k, v, slots)
        ref_pool[0].index_copy_(1, slots, k.transpose(0, 1))
        ref_pool[1].index_copy_(1, slots, v.transpose(0, 1))
        assert torch.equal(pool, ref_pool)
        n += 1
    for t, inter in ((1, 16), (9, 37), (4, 1376), (2, 2500)):
        gu = (torch.randn(t, 2 * inter, generator=torch.Generator().manual_seed(inter)) * 4)
        gu = gu.to(dtype)
        close(T.silu_mul(gu), L.silu_mul_ref(gu))
        n += 1
# no rows: nothing launched, empty results
assert T.rms_norm(torch.empty(0, 8), torch.ones(8), 1e-6).shape == (0, 8)
assert T.silu_mul(torch.empty(0, 8)).shape == (0, 4)
print("TRITON OK", n)
"""


def test_triton_layer_kernels_equal_the_references_in_the_interpreter() -> None:
    proc = run_interpreted(SCRIPT)
    assert proc.returncode == 0 and "TRITON OK 22" in proc.stdout, \
        proc.stdout[-2000:] + proc.stderr[-3000:]


MODEL_SCRIPT = """
import dataclasses, json, sys, torch
from tetri_server.engine.kernels import unfused_glu
from tetri_server.engine.ops import triton_layer as T
from tetri_server.engine.ops.linear import linear
from tetri_server.llm import make_engine
from tetri_server.messages import SamplingParams
path, chunk, prompts = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
eng = make_engine(path, "cluster.mode=coupled-chunked", f"prefill.token_budget={chunk}",
                  "kv.num_blocks=200")
calls = {}
def count(name, fn):
    def run(*args, **kwargs):
        calls[name] = calls.get(name, 0) + 1
        return fn(*args, **kwargs)
    return run
eng.model.kernels = dataclasses.replace(
    eng.model.kernels, rms_norm=count("rms_norm", T.rms_norm),
    add_rms_norm=count("add_rms_norm", lambda x, d, w, eps: T.rms_norm(x, w, eps, d)),
    rope=count("rope", T.rope_), glu=unfused_glu(linear, count("silu_mul", T.silu_mul)),
    write_kv=count("write_kv", lambda pk, pv, k, v, meta: T.write_kv(
        pk, pv, k, v, meta.slot_mapping[:meta.num_real])))
greedy = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
print("TOKENS", json.dumps(eng.generate(prompts, greedy)))
print("CALLS", json.dumps(calls))
"""


def test_llama_with_the_triton_kernels_equals_transformers_in_the_interpreter(model_dir):
    """The Llama forward with every small op and the KV write on the Triton kernels (what CUDA
    runs), under the interpreter on CPU in fp32: prompt chunks of 7 tokens (chunks at an
    offset, decode rows beside them), token for token equal to transformers' generate."""
    path: Path = model_dir("llama")
    prompts = random_prompts(3, 500, (9, 20), seed=4)
    ref = hf_greedy(path, prompts, 6)
    proc = run_interpreted(MODEL_SCRIPT, str(path), "7", json.dumps(prompts))
    out = {line.split(" ", 1)[0]: json.loads(line.split(" ", 1)[1])
           for line in proc.stdout.splitlines() if line.startswith(("TOKENS", "CALLS"))}
    assert proc.returncode == 0 and "TOKENS" in out, proc.stderr[-3000:]
    assert out["TOKENS"] == ref
    assert set(out["CALLS"]) == {"rms_norm", "add_rms_norm", "rope", "silu_mul", "write_kv"}
