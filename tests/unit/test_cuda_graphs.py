"""The decode-graph logic (engine/cuda_graphs.py), exercised on CPU with ``capture=False``: the
same persistent buffers, buckets, padding rows and scratch slot as the CUDA graphs, run
eagerly. Greedy output through them equals the eager engine's (and so transformers'), padding
rows never touch a sequence's KV, and the steps the graphs do not cover stay eager. The CUDA
capture itself runs in tests/gpu (a GPU machine)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from tests.conftest import random_prompts
from tetri_server.engine.cuda_graphs import (
    SCRATCH_BLOCKS,
    DecodeGraphs,
    bucket_for,
    buckets,
    decode_graphs,
)
from tetri_server.llm import make_engine
from tetri_server.messages import SamplingParams

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


def test_buckets_cover_every_batch_up_to_the_max():
    assert buckets(1) == [1]
    assert buckets(32) == [1, 2, 4, 8, 16, 24, 32]
    assert buckets(50) == [1, 2, 4, 8, 16, 24, 32, 48, 50]
    sizes = buckets(300)
    assert sizes[-1] == 300 and sizes == sorted(set(sizes))
    for n in range(1, 301):
        b = bucket_for(n, sizes)
        assert b is not None and b >= n and all(s < n for s in sizes if s < b)
    assert bucket_for(301, sizes) is None
    with pytest.raises(ValueError):
        buckets(0)


def with_graphs(eng, max_batch: int) -> tuple[DecodeGraphs, list[int]]:  # noqa: ANN001
    """The engine's runner on eager-replayed decode graphs, set up as a worker sets them up
    (the scratch block taken from the end of the pool)."""
    total, free = eng.allocator.num_blocks, eng.allocator.num_free
    graphs = decode_graphs(eng.model, eng.kv, eng.allocator, eng.kv_manager.block_size,
                           max_batch, eng.device, capture=False)
    # out of the allocator for good: an empty pool is all free again (a flip's drain check,
    # admission's total), and no extent can reach the scratch block
    assert eng.allocator.num_blocks == total - SCRATCH_BLOCKS
    assert eng.allocator.num_free == free - SCRATCH_BLOCKS == eng.allocator.num_blocks
    eng.runner.graphs = graphs
    scratch = graphs.scratch_slot // eng.kv_manager.block_size
    assert scratch == total - 1
    return graphs, [scratch]


def counting(graphs: DecodeGraphs) -> list[int]:
    """The batch size of every step the graphs ran from now on (-1: none held it, eager)."""
    calls: list[int] = []
    forward = graphs.forward

    def counted(*args):  # noqa: ANN002, ANN202
        out = forward(*args)
        calls.append(len(args[0]) if out is not None else -1)
        return out

    graphs.forward = counted  # type: ignore[method-assign]
    return calls


@pytest.mark.parametrize("family", ["llama", "opt", "qwen2"])
def test_greedy_output_through_the_graph_buffers_equals_the_eager_engine(model_dir, family):
    prompts = random_prompts(7, 8000, (3, 50), seed=3)  # 7 rows: bucket 8, one padding row
    sets = ("kv.num_blocks=120", "model.max_model_len=256")
    ref = make_engine(str(model_dir(family)), *sets).generate(prompts, GREEDY)
    eng = make_engine(str(model_dir(family)), *sets)
    graphs, _ = with_graphs(eng, 8)
    calls = counting(graphs)
    assert eng.generate(prompts, GREEDY) == ref
    assert calls and max(calls) == 7 and -1 not in calls  # decode steps ran on the buffers


def test_padding_rows_write_only_the_scratch_block(model_dir):
    eng = make_engine(str(model_dir("llama")), "kv.num_blocks=120", "model.max_model_len=256")
    _, scratch = with_graphs(eng, 16)
    held: set[int] = set()  # every block a sequence held during the run
    reserve = eng.kv_manager.reserve

    def tracking(seq, num_tokens):  # noqa: ANN001, ANN202
        ok = reserve(seq, num_tokens)
        held.update(seq.blocks)
        return ok

    eng.kv_manager.reserve = tracking
    before = eng.kv.clone()
    eng.generate(random_prompts(3, 8000, (5, 20), seed=4), GREEDY)  # bucket 4: one pad row
    bs = eng.kv_manager.block_size
    changed = (eng.kv != before).flatten(0, 2).any(-1).any(0)  # per pool token
    written = {t // bs for t in changed.nonzero().flatten().tolist()}
    assert scratch[0] in written  # the padding row wrote its K/V there
    assert written - {scratch[0]} <= held and scratch[0] not in held


def test_steps_the_graphs_do_not_cover_run_eagerly(model_dir):
    eng = make_engine(str(model_dir("llama")), "kv.num_blocks=200", "model.max_model_len=256")
    graphs, _ = with_graphs(eng, 2)
    sizes = counting(graphs)
    prompts = random_prompts(3, 8000, (5, 20), seed=6)
    sets = ("kv.num_blocks=200", "model.max_model_len=256")
    ref = make_engine(str(model_dir("llama")), *sets).generate(prompts, GREEDY)
    assert eng.generate(prompts, GREEDY) == ref
    assert -1 in sizes  # 3 decoding rows: no bucket holds them, the step ran eagerly
    logprobs = SamplingParams(max_tokens=3, temperature=0.0, prompt_logprobs=2, ignore_eos=True)
    eng.generate(prompts[:1], logprobs)  # prompt logprobs: the prefill never asks the graphs


def test_capture_is_cuda_only_and_times_itself():
    g = DecodeGraphs(lambda *a: torch.zeros(1), torch.zeros(1), 0, 4, torch.device("cpu"),
                     capture=False)
    assert g.capture() == 0.0 and g.graphs == {}


def test_the_gpu_benchmark_runs_its_code_on_cpu(tmp_path, capsys):
    """tools/bench_gpu.py end to end on a small shape on the CPU (graphs replayed eagerly): the
    tool works before a GPU machine runs it."""
    import importlib.util
    import sys
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "tools" / "bench_gpu.py"
    spec = importlib.util.spec_from_file_location("bench_gpu_tool", path)
    assert spec is not None and spec.loader is not None
    tool = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = tool
    try:
        spec.loader.exec_module(tool)
        assert tool.main(["--device", "cpu", "--hidden", "64", "--layers", "2", "--heads", "4",
                          "--kv-heads", "2", "--intermediate", "128", "--dtype", "float32",
                          "--batch", "3", "--ctx", "16", "--steps", "4", "--profile", "2",
                          "--prefill", "8,4x2",
                          "--out", str(tmp_path / "m")]) == 0
    finally:
        sys.modules.pop(spec.name, None)
    out = capsys.readouterr().out
    assert "| eager |" in out and "| graphs |" in out and "graphs / eager" in out
    assert "| eager, eager layer ops |" in out and "| graphs, eager layer ops |" in out
    from tetri_server.engine.ops import triton_missing
    assert ("| graphs, attention per query head |" in out) == (not triton_missing())
    assert "Profile of 2 eager steps" in out and "Profile of 2 graphs steps" in out
    assert "aten::" in out  # the profiler's operators
    assert "| 1 x 8 | 8 |" in out and "| 2 x 4 | 8 |" in out
    assert "fused / eager |" in out and "Profile of 2 prefill (1 x 8) steps" in out


def test_graphs_are_refused_where_attention_would_read_the_captures_lists(model_dir,
                                                                          monkeypatch):
    """Regression: with no tetri::ragged_attention kernel for the device (a GPU without
    Triton, or older than sm80), attention fell back to the per-sequence loop, which reads
    the metadata's Python lists — the capture's, one token at the scratch slot — so every
    replayed decode step attended to that alone (garbage tokens, HTTP 200). Now no graphs
    are made (a warning) and the pool keeps its scratch block; decode runs eagerly."""
    from tetri_server.engine import cuda_graphs
    from tetri_server.engine.attention import paged_attention

    eng = make_engine(str(model_dir("llama")), "kv.num_blocks=200")
    total = eng.allocator.num_blocks
    bs = eng.kv_manager.block_size
    monkeypatch.setattr(cuda_graphs, "ragged_attention_op", lambda device_type: None)
    assert "no tetri::ragged_attention kernel" in cuda_graphs.graphs_unsupported(
        eng.model, eng.device)
    assert decode_graphs(eng.model, eng.kv, eng.allocator, bs, 8, eng.device,
                         capture=False) is None
    monkeypatch.undo()
    kernels = eng.model.kernels
    eng.model.kernels = dataclasses.replace(kernels, attention=paged_attention)
    assert decode_graphs(eng.model, eng.kv, eng.allocator, bs, 8, eng.device,
                         capture=False) is None
    eng.model.kernels = kernels
    assert eng.allocator.num_blocks == total
    assert cuda_graphs.graphs_unsupported(eng.model, eng.device) is None
