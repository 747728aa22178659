"""The engine's swappable kernels and the phase timing built on them: another attention path
is one assignment (same greedy output), and timing the phases changes nothing and leaves
nothing behind."""

from __future__ import annotations

from tests.conftest import random_prompts
from tetri_server.bench.phases import INSIDE_FORWARD, KERNEL_PHASES, REST_OF_FORWARD, engine_phases
from tetri_server.engine.kernels import REFERENCE, Kernels
from tetri_server.llm import make_engine
from tetri_server.messages import SamplingParams

GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


def test_swapped_kernels_give_the_same_tokens_and_phases_add_up(model_dir):
    eng = make_engine(str(model_dir("llama")), "kv.num_blocks=200")
    prompts = random_prompts(4, 8000, (3, 40), seed=5)
    ref = eng.generate(prompts, GREEDY)
    calls: list[str] = []

    def counting(name, fn):
        def call(*a, **k):
            calls.append(name)
            return fn(*a, **k)
        return call

    eng.model.kernels = REFERENCE.wrapped(counting)
    assert eng.generate(prompts, GREEDY) == ref  # eager PyTorch for every kernel
    num_attention = calls.count("attention")
    assert num_attention == calls.count("write_kv") and num_attention >= eng.spec.num_layers
    eng.model.kernels = Kernels()

    ticks = iter(range(10**6))  # a fake clock: every reading is one tick later
    with engine_phases(eng.runner, lambda: float(next(ticks))) as acc:
        assert eng.generate(prompts, GREEDY) == ref
    steps = {"build metadata", "model forward", "sample"}
    assert steps | set(INSIDE_FORWARD) == set(acc)
    assert all(v > 0 for v in acc.values())
    # the forward contains its kernels: what is left of it is never negative
    kernels_s = sum(acc[p] for p in KERNEL_PHASES.values())
    assert acc[REST_OF_FORWARD] == acc["model forward"] - kernels_s
    assert acc[REST_OF_FORWARD] >= 0
    # restored: default kernels, no accumulator
    assert eng.model.kernels == Kernels() and eng.runner.phases is None
    assert eng.generate(prompts, GREEDY) == ref


def _bench_engine_tool():
    """tools/bench_engine.py as a module."""
    import importlib.util
    import sys
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "tools" / "bench_engine.py"
    spec = importlib.util.spec_from_file_location("bench_engine_tool", path)
    assert spec is not None and spec.loader is not None
    tool = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = tool  # its dataclasses look their module up
    try:
        spec.loader.exec_module(tool)
    finally:
        sys.modules.pop(spec.name, None)
    return tool


def test_bench_engine_rates_against_the_best_of_the_start_and_end_baselines(model_dir):
    """The header promises the max of the start and end baselines; the prefill % of peak and
    the decode roofline were once computed before the end ones were measured (a machine that
    sped up during the run flattered us). Each section's table is rendered after them."""
    from tetri_server.bench.cpu import Timer
    from tetri_server.bench.engine_driver import Baselines, EngineDriver

    tool = _bench_engine_tool()
    timer = Timer("cpu")
    ours = EngineDriver(timer, model_dir("llama"), 2, 32, 6)
    hf = tool.HF(timer, model_dir("llama"))
    p = tool.Params([16, 32], [2], [16], prefill_reps=1, decode_steps=2, decode_warmup=1,
                    hf_new_tokens=3, layout_steps=1, pack_len=16, layout_configs=[])
    # the start's; the roofline reads bytes at the read rate, not the (lower) copy rate
    base = Baselines(timer, peak_gflops=[100.0], mem_gbps=[10.0], read_gbps=[15.0])
    prefill, _knee = tool.bench_prefill(ours, hf, base, p)
    decode = tool.bench_decode(ours, hf, base, p)
    base.peak_gflops.append(200.0)  # the end's, measured after the sections ran
    base.mem_gbps.append(20.0)
    base.read_gbps.append(30.0)
    lines, knee_pct = prefill()
    assert "matmul peak 200.0 GFLOP/s" in lines[0]
    c32 = next(line for line in lines if line.startswith("| 32 ") or line.startswith("| **32**"))
    gflops, pct = (c32.split("|")[i].strip() for i in (3, 4))
    assert abs(100 * float(gflops) / 200.0 - float(pct.rstrip("%"))) <= 1
    lines, _ = decode()
    row = next(line for line in lines if line.startswith("| 16 | 2 |"))
    roof_ms = float(row.split("|")[10])
    assert abs(roof_ms - 1e3 * tool.roofline_s(ours.shape, base, 2, 16)) < 0.06
    sh = ours.shape
    bytes_s = (sh.weight_bytes + sh.kv_bytes(2, 16)) / 30e9
    assert tool.roofline_s(sh, base, 2, 16) == max(sh.decode_flops(2, 16) / 200e9, bytes_s)
    assert "read 30.0 GB/s" in lines[0]
    assert 0 < knee_pct < 100


def test_bench_engine_checks_every_attention_variant_on_a_real_batch(model_dir):
    """tools/bench_engine.py's layout section builds a real decode batch's metadata through the
    runner and holds each attention variant to the reference (it broke once when the runner's
    build gained a return value)."""
    from tetri_server.bench.cpu import Timer
    from tetri_server.bench.engine_driver import EngineDriver

    tool = _bench_engine_tool()
    ours = EngineDriver(Timer("cpu"), model_dir("llama"), 4, 64, 4)
    fns = [tool.ragged_attention, tool.make_gather_attention(ours.block_size),
           tool.make_batched_gather(ours.block_size)]
    tool.check_attention(ours, fns, 4, 40)  # raises if a variant disagrees or the build changed


def test_the_mixed_step_runs_a_chunk_beside_decode_rows_and_gives_the_blocks_back(model_dir):
    """``EngineDriver.mixed`` (tools/bench_engine.py's mixed section): a real runner step of a
    prompt chunk and decode rows over KV already in the pool, repeatable, every block freed."""
    from tetri_server.bench.cpu import Timer
    from tetri_server.bench.engine_driver import EngineDriver

    ours = EngineDriver(Timer("cpu"), model_dir("llama"), 4, 64, 4)
    alloc = ours.eng.kv_manager.allocator
    free = alloc.num_free
    for chunk, rows in ((24, 3), (0, 3), (24, 0)):
        with ours.mixed(chunk, rows, 40) as run:
            assert alloc.num_free < free
            run()
            run()  # the same step again: its sequences are reset each time
        assert alloc.num_free == free


def test_the_phase_bound_adds_the_linears_and_the_attention_bounds() -> None:
    """``Shape.decode_phase_bound_s``: at batch 32 and a long context the linears are
    FLOPs-bound and the attention bytes-bound, so the step's bound on one core is their sum,
    longer than the roofline (the max over the whole step); at batch 1 both phases are
    bytes-bound and the two bounds agree."""
    from tetri_server.bench.engine_driver import Shape

    # the bench Llama's shape, roughly: 8 layers of 8 x 64 heads, 3.4 M weights a token
    sh = Shape(layers=8, heads=8, kv_heads=8, head_dim=64, matmul_params=3_400_000 * 8,
               head_params=8192 * 512, after_qkv_params=0,
               weight_bytes=4 * (3_400_000 * 8 + 8192 * 512), dtype_bytes=4)
    peak, rate = 35.0, 14.0  # GFLOP/s, GB/s: this AVX2 VM
    linear_s = 32 * 2 * (sh.matmul_params + sh.head_params) / (peak * 1e9)
    attn_s = sh.kv_bytes(32, 1024) / (rate * 1e9)
    got = sh.decode_phase_bound_s(32, 1024, peak, rate)
    assert abs(got - (linear_s + attn_s)) < 1e-3 * got
    roofline = max(sh.decode_flops(32, 1024) / (peak * 1e9),
                   (sh.weight_bytes + sh.kv_bytes(32, 1024)) / (rate * 1e9))
    assert got > 1.5 * roofline
    one = sh.decode_phase_bound_s(1, 1024, peak, rate)
    assert abs(one - (sh.weight_bytes + sh.kv_bytes(1, 1024)) / (rate * 1e9)) < 1e-3 * one
