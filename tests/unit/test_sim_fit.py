"""Fitting a hardware profile: a known cost model's times in -> its parameters out."""

from __future__ import annotations

import dataclasses
import json

import pytest

from tetri_server.sim.cost import CostModel
from tetri_server.sim.fit import StepSample, fit_hardware, predict, profile_json, with_params
from tetri_server.sim.profiles import load_hardware, load_model


def _shapes() -> list[StepSample]:
    """The shapes `sim fit` measures: packed and 1-prompt prefill chunks, decode steps."""
    out = []
    for num in (16, 32, 64, 128, 256, 512, 1024):
        lens = [128] * (num // 128) + ([num % 128] if num % 128 else [])
        out.append(StepSample("prefill", tuple((n, 0) for n in lens), 1.0))
    out += [StepSample("prefill-1seq", ((n, 0),), 1.0) for n in (256, 512, 1024)]
    out += [StepSample("decode", ((1, ctx),) * b, 1.0)
            for b in (1, 4, 16, 32) for ctx in (64, 256, 1024)]
    return out


def _timed(hw, model, factor=lambda i: 1.0):  # type: ignore[no-untyped-def]
    shapes = _shapes()
    times = predict(shapes, hw, model)
    return [dataclasses.replace(s, time_s=t * factor(i))
            for i, (s, t) in enumerate(zip(shapes, times, strict=True))]


@pytest.mark.parametrize("truth", [
    dict(peak_eff_flops=74e9, mem_eff_Bps=9.8e9, half_tokens=27.0, step_overhead_s=1e-3),
    dict(peak_eff_flops=150e9, mem_eff_Bps=4e9, half_tokens=60.0, step_overhead_s=3e-3),
    # a CPU core: compute and memory in series, no knee beyond the weights' read
    dict(peak_eff_flops=160e9, mem_eff_Bps=12e9, half_tokens=2.0, step_overhead_s=1.5e-3,
         overlap=0.0),
])
def test_fit_recovers_a_known_profile(truth: dict[str, float]) -> None:
    model = load_model("bench")
    base = load_hardware("this-cpu")
    samples = _timed(with_params(base, truth), model)
    fit = fit_hardware(samples, model, base, peak_flops=200e9, mem_bw_Bps=13e9)
    for key, want in truth.items():
        assert fit.params[key] == pytest.approx(want, rel=0.02, abs=1e-3), key
    assert max(abs(e) for e in fit.rel_errors) < 1e-3
    # efficiencies are expressed against the measured baselines
    assert fit.hardware.peak_flops == 200e9
    assert fit.hardware.compute_eff == pytest.approx(truth["peak_eff_flops"] / 200e9, rel=0.02)
    assert 0 < fit.hardware.mem_eff <= 1


def test_noisy_measurements_give_close_parameters_and_times() -> None:
    model = load_model("bench")
    base = load_hardware("this-cpu")
    truth = dict(peak_eff_flops=80e9, mem_eff_Bps=10e9, half_tokens=30.0, step_overhead_s=2e-3)
    noise = [1.05, 0.96, 1.02, 0.97, 1.04, 0.99, 1.01, 0.95, 1.03]  # +-5%, fixed
    samples = _timed(with_params(base, truth), model, lambda i: noise[i % len(noise)])
    fit = fit_hardware(samples, model, base)
    assert fit.params["peak_eff_flops"] == pytest.approx(80e9, rel=0.1)
    assert max(abs(e) for e in fit.rel_errors) < 0.08
    # the fitted model times a 512-token chunk and a batch-32 decode step within 5%
    true_cost, fit_cost = CostModel(with_params(base, truth), model), CostModel(fit.hardware,
                                                                              model)
    for items in ([(128, 0)] * 4, [(1, 500)] * 32):
        assert fit_cost.step_s(items) == pytest.approx(true_cost.step_s(items), rel=0.05)


def test_overlap_sums_compute_and_memory_on_a_cpu_and_takes_the_max_on_a_gpu() -> None:
    model = load_model("bench")
    gpu = with_params(load_hardware("this-cpu"), dict(
        peak_eff_flops=100e9, mem_eff_Bps=10e9, half_tokens=1e-3, step_overhead_s=1e-8,
        overlap=1.0))
    cpu = dataclasses.replace(gpu, overlap=0.0)
    items = [(1, 1000)] * 32  # decode: compute and memory of the same order
    c_gpu, c_cpu = CostModel(gpu, model).step_s(items), CostModel(cpu, model).step_s(items)
    c_flops = CostModel(dataclasses.replace(gpu, mem_bw_Bps=1e30), model).step_s(items)
    c_mem = CostModel(dataclasses.replace(gpu, peak_flops=1e30), model).step_s(items)
    assert c_gpu == pytest.approx(max(c_flops, c_mem), rel=1e-6)
    assert c_cpu == pytest.approx(c_flops + c_mem, rel=1e-6)


def test_a_baseline_below_the_fitted_rate_is_raised_to_keep_efficiency_at_most_one() -> None:
    hw = with_params(load_hardware("this-cpu"), dict(
        peak_eff_flops=120e9, mem_eff_Bps=5e9, half_tokens=10.0, step_overhead_s=1e-3),
        peak_flops=100e9, mem_bw_Bps=13e9)
    assert (hw.peak_flops, hw.compute_eff) == (120e9, 1.0)
    assert hw.mem_eff == pytest.approx(5 / 13)


def test_profile_file_round_trips_through_load_hardware(tmp_path) -> None:  # type: ignore[no-untyped-def]
    model, base = load_model("bench"), load_hardware("this-cpu")
    truth = dict(peak_eff_flops=74e9, mem_eff_Bps=9.8e9, half_tokens=27.0, step_overhead_s=1e-3)
    samples = _timed(with_params(base, truth), model)
    fit = fit_hardware(samples, model, base, 95e9, 13e9)
    path = tmp_path / "fitted.json"
    path.write_text(json.dumps(profile_json(fit, samples, "test")))
    loaded = load_hardware(str(path))
    assert loaded.half_tokens == pytest.approx(27.0, rel=0.02)
    assert loaded.links == base.links
    assert len(json.loads(path.read_text())["fit"]["samples"]) == len(samples)


def test_fit_refuses_too_few_or_non_positive_samples() -> None:
    model, base = load_model("bench"), load_hardware("this-cpu")
    with pytest.raises(ValueError, match="at least"):
        fit_hardware(_shapes()[:3], model, base)
    with pytest.raises(ValueError, match="> 0"):
        fit_hardware([dataclasses.replace(s, time_s=0.0) for s in _shapes()], model, base)


def test_rows_not_sampled_skip_the_last_layers_o_projection_and_mlp() -> None:
    """As in the engine: of a 1,024-token prompt pass, every row pays q|k|v and attention in
    every layer, but only the sampled row pays the last layer's o-projection and MLP (and the
    LM head)."""
    hw, m = load_hardware("this-cpu"), load_model("bench")
    cost = CostModel(hw, m)
    every_row = cost._parts([(1024, 0)], 0, 1024)[0]
    one_row = cost._parts([(1024, 0)], 0, 1)[0]
    o_and_mlp = m.hidden * (m.num_heads * m.head_dim + 3 * m.ffn)  # llama: gate, up, down
    saved_flops = 2 * 1023 * (o_and_mlp + m.hidden * m.vocab)
    eff = hw.compute_eff * 1024 / (1024 + hw.half_tokens)
    assert every_row - one_row == pytest.approx(saved_flops / (hw.peak_flops * eff))
