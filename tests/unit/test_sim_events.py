"""The simulator's event loop and cost model on hand-made cases."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tetri_server.policy import pick_chunk_size
from tetri_server.sim.cost import CostModel, knee_chunk_size
from tetri_server.sim.events import EventLoop
from tetri_server.sim.predictor import EmulatedPredictor
from tetri_server.sim.profiles import HARDWARE, MODELS, load_hardware, load_model


def v100_opt13b() -> CostModel:
    hw = load_hardware("V100-32GB")
    return CostModel(hw, load_model("OPT-13B"), hw.link("ts-roce"))


def test_events_run_in_time_order_then_push_order() -> None:
    loop = EventLoop()
    seen: list[tuple[float, str]] = []
    loop.at(2.0, lambda: seen.append((loop.now_s, "b")))
    loop.at(1.0, lambda: (seen.append((loop.now_s, "a")), loop.after(1.0, lambda: seen.append(
        (loop.now_s, "c")))))
    loop.at(2.0, lambda: seen.append((loop.now_s, "d")))
    assert loop.run() == 2.0
    assert seen == [(1.0, "a"), (2.0, "b"), (2.0, "d"), (2.0, "c")]
    with pytest.raises(ValueError):
        loop.at(1.0, lambda: None)


def test_run_until_leaves_later_events() -> None:
    loop = EventLoop()
    loop.at(1.0, lambda: None)
    loop.at(5.0, lambda: None)
    loop.run(until_s=2.0)
    assert (loop.now_s, len(loop)) == (1.0, 1)


def test_decode_step_grows_with_context_and_batch_as_the_roofline_says() -> None:
    cost = v100_opt13b()
    m = cost.model
    # batch 1, context c: memory-bound, so time = (weights + KV) / effective bandwidth + overhead
    for ctx in (128, 1024):
        want = (m.weight_bytes + m.kv_bytes_per_token * (ctx + 1)) / (900e9 * 0.8) + 0.002
        assert cost.decode_s([ctx]) == pytest.approx(want)
    assert cost.decode_s([1024]) > cost.decode_s([128])
    times = [cost.decode_s([512] * b) for b in (1, 8, 32, 128)]
    assert times == sorted(times) and times[-1] > 1.5 * times[0]
    assert cost.bound([(1, 512)] * 8) == "memory"


def test_512_token_chunk_is_compute_bound_on_v100_for_opt13b_and_the_knee() -> None:
    cost = v100_opt13b()
    assert cost.bound([(512, 0)]) == "compute"
    assert cost.prefill_s(512) > 3 * cost.decode_s([0])
    assert knee_chunk_size(cost, prompt_tokens=128) == 512  # the paper's ChunkSize (128-token
    # prompts), through policy.knee
    # padding costs compute on a GPU (the padded shape runs), not on the CPU runner
    assert cost.step_s([(100, 0)], num_pad=412) == pytest.approx(cost.step_s([(512, 0)]), 0.05)
    cpu = CostModel(load_hardware("this-cpu"), load_model("bench"))
    assert cpu.step_s([(100, 0)], num_pad=412) == cpu.step_s([(100, 0)])
    assert 64 <= pick_chunk_size([(n, cpu.prefill_s(n)) for n in (64, 128, 256)]) <= 256


def test_the_knee_with_as_many_decode_rows_as_a_pass_has_tokens_skips_that_pass() -> None:
    """Regression (review of session 62): ``sim --chunk-size 0`` with a
    ``local_decode_batch`` of 64 divided by zero (a pass of 64 tokens, all of them rows),
    and of 100 raised; the worker skips the sizes not above its rows."""
    cpu = CostModel(load_hardware("this-cpu"), load_model("bench"))
    for rows in (0, 16, 64, 100):
        assert rows < knee_chunk_size(cpu, rows=rows) <= 4096


def test_handoff_is_bytes_over_link_plus_latency() -> None:
    cost = v100_opt13b()
    assert cost.model.kv_bytes_per_token == 2 * 40 * 5120 * 2  # 0.82 MB
    assert cost.handoff_s(512) == pytest.approx(512 * 819200 / 25e9 + 10e-6)  # ~17 ms
    nvlink = CostModel(cost.hw, cost.model, cost.hw.link("ts-nvlink"))
    assert nvlink.handoff_s(512) == pytest.approx(512 * 819200 / 300e9 + 5e-6)


def test_kv_blocks_fit_beside_weights_and_big_models_do_not_fit_small_devices() -> None:
    assert 300 < v100_opt13b().num_kv_blocks(16) < 500  # ~5 GB of a 32 GB V100
    h200 = CostModel(load_hardware("H200"), load_model("Llama-3-8B"))
    assert h200.num_kv_blocks(16) > 20 * v100_opt13b().num_kv_blocks(16)
    # the H200's memory in GiB, as the 80 GB cards' (it was 141e9 bytes: 131 GiB, a pool 7%
    # too small)
    assert load_hardware("H200").memory_bytes > 1.7 * load_hardware("H100").memory_bytes
    with pytest.raises(ValueError, match="does not fit"):
        CostModel(load_hardware("this-cpu"), load_model("OPT-13B")).num_kv_blocks(16)


def test_every_profile_loads_and_user_files_are_checked(tmp_path) -> None:  # type: ignore[no-untyped-def]
    for name in (*HARDWARE, "this-cpu"):
        for model in MODELS:
            CostModel(load_hardware(name), load_model(model)).decode_s([10])
    spec = json.loads((load_hardware.__globals__["PROFILE_DIR"] / "this-cpu.json").read_text())
    path = tmp_path / "mine.json"
    path.write_text(json.dumps({**spec, "peak_flops": 1e12}))
    assert load_hardware(str(path)).peak_flops == 1e12
    del spec["mem_bw_Bps"]
    path.write_text(json.dumps(spec))
    with pytest.raises(ValueError, match="mem_bw_Bps"):
        load_hardware(str(path))
    with pytest.raises(ValueError):
        load_model("GPT-5")


def test_emulated_predictor_hits_its_accuracy_and_misses_by_one_bucket() -> None:
    oracle = EmulatedPredictor(granularity=200, num_buckets=11, accuracy=1.0)
    assert [oracle.predict(n) for n in (0, 199, 200, 5000)] == [0, 0, 1, 10]
    pred = EmulatedPredictor(granularity=200, num_buckets=11, accuracy=0.749, seed=3)
    lens = [(i * 37) % 2000 for i in range(4000)]
    got = [pred.predict(n) for n in lens]
    true = [n // 200 for n in lens]
    hits = sum(g == t for g, t in zip(got, true, strict=True)) / len(lens)
    assert 0.72 < hits < 0.78
    assert all(abs(g - t) <= 1 for g, t in zip(got, true, strict=True))
    again = EmulatedPredictor(granularity=200, num_buckets=11, accuracy=0.749, seed=3)
    assert [again.predict(n) for n in lens] == got


def test_sim_package_imports_no_torch() -> None:
    code = ("import json, sys\nimport tetri_server.sim, tetri_server.sim.cli, "
            "tetri_server.sim.paper\nprint(json.dumps([m for m in ('torch', 'cupy', "
            "'transformers') if m in sys.modules]))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, check=True)
    assert json.loads(out.stdout.strip().splitlines()[-1]) == []


def test_uniform_misses_land_anywhere_but_the_true_bucket() -> None:
    """The far-off predictor: the same hit rate, but a miss is any other bucket, uniformly."""
    pred = EmulatedPredictor(granularity=200, num_buckets=11, accuracy=0.749, seed=3,
                             miss="uniform")
    lens = [(i * 37) % 2000 for i in range(4000)]
    got = [pred.predict(n) for n in lens]
    true = [n // 200 for n in lens]
    misses = [abs(g - t) for g, t in zip(got, true, strict=True) if g != t]
    assert 0.72 < 1 - len(misses) / len(lens) < 0.78
    assert all(0 <= g < 11 for g in got)
    assert max(misses) >= 8 and sum(misses) / len(misses) > 3  # a neighbour miss: always 1
    with pytest.raises(ValueError, match="miss"):
        EmulatedPredictor(granularity=200, num_buckets=11, miss="far")


def test_simulated_oracle_buckets_like_the_server_whatever_the_context_length() -> None:
    """The server's oracle takes its buckets from the shipped artifact (the last, open bucket
    starts at the 1024-token training clip); the simulator's must match at any max_model_len."""
    import dataclasses

    from tetri_server.predictor import artifact, load_predictor
    from tetri_server.sim.cluster import SimConfig
    from tetri_server.sim.instances import SimRequest
    from tetri_server.sim.run import predict

    for name in artifact.shipped_artifacts():
        server = load_predictor("oracle", name)
        cfg = dataclasses.replace(SimConfig(), max_model_len=4096,
                                  granularity=server.granularity)
        reqs = [SimRequest(i, 16, n, 0.0) for i, n in enumerate((0, 199, 1023, 1100, 3000))]
        predict(reqs, cfg)
        assert [r.bucket for r in reqs] == [server.bucket_of(r.output_len) for r in reqs], name


def test_a_knee_with_no_pass_above_the_riding_rows_names_the_setting() -> None:
    """local_decode_batch >= the largest calibration pass leaves no size to measure (it failed
    with a bare "no samples")."""
    with pytest.raises(ValueError, match="local_decode_batch 4096"):
        knee_chunk_size(v100_opt13b(), rows=4096)
    assert knee_chunk_size(v100_opt13b(), rows=2048) == 4096


def test_the_knee_passes_hold_every_prompt_token_they_are_counted_with() -> None:
    """Regression (review of session 63): with decode rows riding, each pass packed whole
    128-token prompts only (the 256-token pass held 16 rows and 128 prompt tokens, counted as
    240), so the prompt rate looked 1.9x higher at small sizes and the knee came out far too
    small (240 against 832 for OPT-13B on a V100), unlike the worker, which fills each
    pass."""
    cost = v100_opt13b()
    seen: list[list[tuple[int, int]]] = []
    step_s = cost.step_s

    def record(items, num_pad, num_sampled):  # noqa: ANN001, ANN202
        seen.append(list(items))
        return step_s(items, num_pad, num_sampled)

    cost.step_s = record  # type: ignore[method-assign]
    knee_chunk_size(cost, rows=16)
    for items in seen:
        assert sum(n for n, ctx in items if ctx == 0) + 16 in (32, 64, 128, 256, 512, 1024,
                                                                 2048, 4096)


def test_a_simulated_prefill_chunk_costs_its_real_tokens_as_the_worker_runs_it() -> None:
    """Regression (review of session 63): on the GPU profiles a prefill chunk was costed with
    its padding to chunk_size, which the prefill worker never runs (one 100-token prompt in a
    1024 chunk: 4x its time). Only the paper's preset pads (``pad_chunks``)."""
    import dataclasses

    from tetri_server.sim.cluster import SimConfig, Simulation
    from tetri_server.sim.instances import SimRequest
    from tetri_server.sim.paper import PAPER_CONFIG

    assert PAPER_CONFIG.pad_chunks
    cost = v100_opt13b()
    ttft = {}
    for pad in (False, True):
        cfg = dataclasses.replace(SimConfig(), chunk_size=1024, pad_chunks=pad,
                                  local_decode_batch=0)
        [req] = Simulation(cfg, cost, [SimRequest(0, 100, 2, 0.0)]).run().requests
        assert req.first_token_s is not None
        ttft[pad] = req.first_token_s
    alone = cost.step_s([(100, 0)], 0, 1)
    assert ttft[False] < 1.5 * alone < ttft[True]
