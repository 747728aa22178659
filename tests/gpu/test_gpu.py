"""The same code on CUDA: our forward equals transformers on the GPU, the disaggregated
cluster hands KV over through CUDA IPC, and `tetri-server serve` on one GPU streams the tokens
transformers gives. Skipped without CUDA (run with `pytest -m gpu` on a lent device, as
tools/gpu_check.sh does)."""

from __future__ import annotations

import asyncio
import json
import urllib.request

import pytest
import torch

from tests.conftest import random_prompts
from tetri_server.engine.cuda_graphs import SCRATCH_BLOCKS
from tetri_server.llm import make_engine
from tetri_server.messages import SamplingParams

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)


def _hf_cuda(path, prompts, n):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).cuda().eval()
    out = []
    with torch.inference_mode():
        for p in prompts:
            ids = torch.tensor([p], device="cuda")
            gen = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                 max_new_tokens=n, min_new_tokens=n, eos_token_id=None,
                                 pad_token_id=0)
            out.append(gen[0, len(p):].tolist())
    return out


@pytest.mark.parametrize("family", ["llama", "opt"])
@pytest.mark.parametrize(("mode", "chunk"), [("coupled", 2048), ("coupled-chunked", 61)])
def test_greedy_equals_transformers_on_cuda(model_dir, family, mode, chunk):
    path = model_dir(family)
    prompts = random_prompts(16, 8000, (1, 300), seed=31)
    eng = make_engine(str(path), "cluster.device=cuda", "model.dtype=float32",  # auto: bf16
                      f"cluster.mode={mode}", f"prefill.token_budget={chunk}",
                      "kv.num_blocks=600")
    assert eng.generate(prompts, GREEDY) == _hf_cuda(path, prompts, GREEDY.max_tokens)
    # every block back, but the scratch block the decode graphs hold for good
    held = SCRATCH_BLOCKS if eng.runner.graphs is not None else 0
    assert eng.allocator.num_free == eng.allocator.num_blocks - held


def test_disaggregated_cluster_over_cuda_ipc(model_dir):
    pytest.importorskip("cupy")
    from tests.integration.conftest import make_cluster

    path = model_dir("llama")
    prompts = random_prompts(12, 8000, (1, 200), seed=32)
    ref = _hf_cuda(path, prompts, GREEDY.max_tokens)

    async def run():
        cluster = make_cluster(path, "disaggregated", "cluster.device=cuda",
                               "kv.transport=cuda_ipc", "model.dtype=float32")
        await cluster.start()
        try:
            async def one(p):
                out = []
                async for d in cluster.submit(p, GREEDY):
                    out.extend(d.token_ids)
                return out

            return await asyncio.gather(*(one(p) for p in prompts))
        finally:
            await cluster.stop()

    assert asyncio.run(run()) == ref


def stream_completion(url: str, model: str, prompt: list[int], max_tokens: int) -> tuple[str, str]:
    """One streamed /v1/completions request, greedy, EOS ignored: (its text, finish_reason)."""
    body = json.dumps({"model": model, "prompt": prompt, "max_tokens": max_tokens,
                       "temperature": 0, "ignore_eos": True, "stream": True}).encode()
    req = urllib.request.Request(url + "/v1/completions", body,
                                 {"Content-Type": "application/json"})
    parts, finish = [], ""
    with urllib.request.urlopen(req, timeout=120) as resp:
        for raw in resp:
            line = raw.decode().strip()
            if line.startswith("data: {"):
                choice = json.loads(line[len("data: "):])["choices"][0]
                parts.append(choice["text"])
                finish = choice.get("finish_reason") or finish
    return "".join(parts), finish


def test_served_disaggregated_on_one_gpu_streams_the_tokens_of_transformers(model_dir, tmp_path):
    """`tetri-server serve` as a user would start it on a one-GPU box: 1 prefill + 1 decode
    worker on cuda:0, KV over CUDA IPC, the chunk size calibrated at start-up; fp32, as the
    reference (the default on cuda, auto, is bf16)."""
    pytest.importorskip("cupy")
    from transformers import AutoTokenizer

    from tests.integration.conftest import start_server

    path = model_dir("llama", "bench")
    prompts = random_prompts(6, 8000, (1, 700), seed=33)
    n = 24
    want = [AutoTokenizer.from_pretrained(str(path)).decode(ids, skip_special_tokens=True)
            for ids in _hf_cuda(path, prompts, n)]
    proc, url = start_server(tmp_path, "cluster.device=cuda", "cluster.mode=disaggregated",
                             argv=(str(path), "--dtype", "float32", "--prefill-workers", "1",
                                   "--decode-workers", "1"))
    try:
        got = [stream_completion(url, str(path), p, n) for p in prompts]
    finally:
        proc.terminate()
        code = proc.wait(60)
    assert got == [(text, "length") for text in want]
    assert code == 0


def on_cuda(meta):
    """A BatchMetadata built on the CPU (tests.unit.test_attention_op.make_batch) with its
    tensors on the GPU."""
    from tetri_server.engine.attention import BatchMetadata

    return BatchMetadata(meta.q_starts, meta.q_lens, meta.ctx_lens, meta.kv_starts,
                         meta.slot_mapping.cuda(), meta.positions.cuda(), meta.num_real)


@pytest.mark.parametrize("pack", [True, False], ids=["grouped", "per-head"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("window", [0, 24])
def test_ragged_attention_kernel_equals_the_loop_on_cuda(dtype, window, pack):
    """The Triton kernel behind ragged_attention (one program per KV head's group of query
    heads, or per query head) against the per-sequence SDPA loop."""
    import math
    import random

    from tests.unit.test_attention_op import BLOCK, make_batch, random_specs
    from tetri_server.engine.attention import paged_attention, ragged_attention
    from tetri_server.engine.ops import ragged_attention_op
    from tetri_server.engine.ops.triton_attention import PACK_GROUPS, ragged_attention_triton

    assert ragged_attention_op("cuda") is not None, "no CUDA kernel (is Triton installed?)"
    rng = random.Random(1)
    for heads, kv_heads, dim in [(4, 2, 16), (8, 8, 64), (32, 8, 128)]:
        specs = random_specs(rng, 24) + [(1, 1), (1, BLOCK), (300, 300)]
        pool_tokens = BLOCK * sum(-(-ctx // BLOCK) + 2 for _, ctx in specs)
        cpu = make_batch(rng, specs, pool_tokens, num_pad=5)
        meta = on_cuda(cpu)
        q = torch.randn(cpu.num_real + 5, heads, dim, device="cuda", dtype=dtype)
        kv = torch.randn(2, kv_heads, pool_tokens, dim, device="cuda", dtype=dtype)
        got = torch.full_like(q, float("nan"))
        ragged_attention_triton(q, kv[0], kv[1], got, *meta.seq_tensors, 1 / math.sqrt(dim),
                                window, pack_groups=pack)
        if pack == PACK_GROUPS:  # the op runs the default layout: the same bits
            assert torch.equal(got, ragged_attention(q, kv[0], kv[1], meta, window=window))
        ref = paged_attention(q, kv[0], kv[1], meta, window=window)
        tol = 1e-4 if dtype == torch.float32 else 2e-2
        torch.testing.assert_close(got.float(), ref.float(), atol=tol, rtol=tol)
        assert not got[cpu.num_real:].any()


def test_ragged_attention_kernel_reads_kv_heads_past_2_31_elements_on_cuda():
    """A pool whose KV heads lie more than 2^31 elements apart (a model with few layers and a
    big pool): the kernel's head offset is computed in int64. With an int32 product of head and
    stride, head 2's keys were read from a wrapped address (found by reading, session 40)."""
    import math
    import random

    from tests.unit.test_attention_op import BLOCK, make_batch
    from tetri_server.engine.attention import paged_attention
    from tetri_server.engine.ops.triton_attention import ragged_attention_triton

    heads, kv_heads, dim = 6, 3, 64
    per_head = (1 << 24) + BLOCK  # tokens a KV head: head 2 starts past 2^31 elements
    assert 2 * per_head * dim > 2**31 > per_head * dim  # a stride Triton passes as int32
    specs = [(1, 40), (7, 23), (1, 1), (5, 5)]
    used = BLOCK * sum(-(-ctx // BLOCK) + 2 for _, ctx in specs)
    cpu = make_batch(random.Random(2), specs, used, at_end=False)
    meta = on_cuda(cpu)
    pool = torch.empty(kv_heads, per_head, dim, device="cuda", dtype=torch.float16)  # 6.4 GB
    try:
        pool[:, :used].normal_()  # what the batch reads; keys and values alike
        q = torch.randn(cpu.num_real, heads, dim, device="cuda", dtype=torch.float16)
        got = torch.full_like(q, float("nan"))
        ragged_attention_triton(q, pool, pool, got, *meta.seq_tensors, 1 / math.sqrt(dim), 0)
        ref = paged_attention(q, pool, pool, meta)
        torch.testing.assert_close(got.float(), ref.float(), atol=2e-2, rtol=2e-2)
    finally:
        del pool
        torch.cuda.empty_cache()


def test_decode_graphs_replay_the_eager_tokens_on_cuda(model_dir):
    """CUDA graphs captured at start-up (model.cuda_graphs, on by default) give the tokens of
    the eager engine, for batches that need padding rows."""
    path = model_dir("llama")
    prompts = random_prompts(13, 8000, (1, 200), seed=5)  # bucket 16: three padding rows
    sets = ("cluster.device=cuda", "model.dtype=float32", "kv.num_blocks=400",
            "model.max_model_len=512", "decode.max_batch=32")
    eager = make_engine(str(path), *sets, "model.cuda_graphs=false")
    graphs = make_engine(str(path), *sets)
    assert eager.runner.graphs is None and graphs.runner.graphs is not None
    assert graphs.runner.graphs.capture_s > 0 and len(graphs.runner.graphs.graphs) == 7
    assert graphs.generate(prompts, GREEDY) == eager.generate(prompts, GREEDY)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_layer_ops_take_the_triton_kernels_and_equal_the_references_on_cuda(dtype):
    """RMSNorm, add + RMSNorm, RoPE on strided q/k views, SiLU-and-mul and the KV write run
    the Triton kernels on CUDA (ops/triton_layer.py) and equal the eager references (bf16 is
    compared here only: Triton's CPU interpreter truncates to bf16)."""
    from tetri_server.engine.attention import BatchMetadata, write_kv, write_kv_ref
    from tetri_server.engine.ops import layer as L
    from tetri_server.engine.ops import triton_layer_ops

    assert triton_layer_ops() is not None, "no Triton kernels (is Triton installed?)"
    tol = {"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 5e-2, "rtol": 2e-2}
    g = torch.Generator(device="cuda").manual_seed(0)
    t, hidden, heads, kv_heads, dim, inter = 37, 2048, 16, 8, 128, 5632

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g, device="cuda").to(dtype)

    x, d, w = randn(t, hidden), randn(t, hidden), randn(hidden)
    assert L._triton(x, w) is not None
    torch.testing.assert_close(L.rms_norm(x, w, 1e-6), L.rms_norm_ref(x, w, 1e-6), **tol)
    x1, x2 = x.clone(), x.clone()
    torch.testing.assert_close(L.add_rms_norm(x1, d, w, 1e-5),
                               L.add_rms_norm_ref(x2, d, w, 1e-5), **tol)
    assert torch.equal(x1, x2)
    qkv = randn(t, (heads + 2 * kv_heads) * dim)
    angles = torch.rand(t, 1, dim // 2, generator=g, device="cuda") * 6.3
    cos = torch.cat((angles, angles), -1).cos().to(dtype)
    sin = torch.cat((angles, angles), -1).sin().to(dtype)
    ref = qkv.clone()

    def views(buf: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return (buf[:, :heads * dim].view(t, heads, dim),
                buf[:, heads * dim:(heads + kv_heads) * dim].view(t, kv_heads, dim),
                buf[:, (heads + kv_heads) * dim:].view(t, kv_heads, dim))

    L.rope(*views(qkv)[:2], cos, sin)
    L.rope_ref(*views(ref)[:2], cos, sin)
    torch.testing.assert_close(qkv, ref, **tol)
    gu = randn(t, 2 * inter) * 4
    torch.testing.assert_close(L.silu_mul(gu), L.silu_mul_ref(gu), **tol)
    slots = torch.randperm(500, generator=g, device="cuda")[:t]
    meta = BatchMetadata([0], [t], [t], [0], slots, torch.arange(t, device="cuda"), t)
    base = randn(2, kv_heads, 500, dim)
    pool = torch.stack((base, base.clone()))
    _, k, v = views(qkv)
    write_kv(pool[0, 0], pool[0, 1], k, v, meta)
    write_kv_ref(pool[1, 0], pool[1, 1], k, v, meta)
    assert torch.equal(pool[0], pool[1])
