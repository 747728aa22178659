"""The same code on CUDA: our forward equals transformers on the GPU, and the disaggregated
cluster hands KV over through CUDA IPC. Skipped without CUDA (run with `pytest -m gpu` on a
lent device)."""

from __future__ import annotations

import asyncio

import pytest
import torch

from tests.conftest import random_prompts
from tetri_server.engine.llm import EngineConfig, LLMEngine
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
@pytest.mark.parametrize(("mode", "chunk"), [("coupled", 2048), ("chunked", 61)])
def test_greedy_equals_transformers_on_cuda(model_dir, family, mode, chunk):
    path = model_dir(family)
    prompts = random_prompts(16, 8000, (1, 300), seed=31)
    eng = LLMEngine(EngineConfig(str(path), device="cuda", mode=mode, chunk_size=chunk,
                                 num_blocks=600))
    assert eng.generate(prompts, GREEDY) == _hf_cuda(path, prompts, GREEDY.max_tokens)
    assert eng.allocator.num_free == eng.allocator.num_blocks


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
