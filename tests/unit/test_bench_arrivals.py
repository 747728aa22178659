"""Arrival processes: Poisson, trace windows, time scaling of real traces."""

from __future__ import annotations

import math

import numpy as np
import pytest

from tetri_server.bench import arrivals, data


def test_poisson_starts_at_zero_is_sorted_and_has_the_rate() -> None:
    times = arrivals.poisson_arrivals(20001, 4.0, np.random.default_rng(0))
    assert times[0] == 0.0 and times == sorted(times)
    assert 20000 / times[-1] == pytest.approx(4.0, rel=0.03)
    assert times == arrivals.poisson_arrivals(20001, 4.0, np.random.default_rng(0))


def test_poisson_runs_at_the_rate_it_is_labelled_with_at_a_benchmarks_size() -> None:
    """Regression (review of session 62): the draws were not scaled, and 60 or 80 of them
    with the default seed arrived at 1.30-1.33x the rate every sweep result was labelled
    with. The gaps stay random (Poisson given the span)."""
    for n in (2, 50, 60, 80, 120):
        for seed in range(4):
            times = arrivals.poisson_arrivals(n, 1.5, np.random.default_rng([seed, 2]))
            assert (n - 1) / times[-1] == pytest.approx(1.5, rel=1e-9)
            gaps = np.diff(times)
            assert len(gaps) < 2 or gaps.std() > 0.3 * gaps.mean()  # not evenly spaced
    assert arrivals.poisson_arrivals(1, 1.5, np.random.default_rng(0)) == [0.0]


def test_poisson_burst_and_bad_rate() -> None:
    assert arrivals.poisson_arrivals(3, math.inf, np.random.default_rng(0)) == [0.0] * 3
    with pytest.raises(ValueError):
        arrivals.poisson_arrivals(3, 0.0, np.random.default_rng(0))


def test_scaled_span_is_span_times_factor_and_order_is_kept() -> None:
    times = [5.0, 5.0, 6.5, 9.0, 20.0]
    for factor in (0.01, 0.5, 1.0, 3.0):
        scaled = arrivals.scale_times(times, factor)
        assert scaled[0] == 0.0
        assert scaled[-1] - scaled[0] == pytest.approx((times[-1] - times[0]) * factor)
        assert scaled == sorted(scaled)
        gaps = np.diff(times) * factor
        assert np.diff(scaled) == pytest.approx(gaps)


@pytest.mark.parametrize("name", sorted(data.TRACE_FILES))
def test_real_trace_window_scaled_to_a_rate(name: str) -> None:
    try:
        folder = data.data_dir()
    except FileNotFoundError:
        pytest.skip("shared data folder not present")
    rows = data.load_trace(folder, name)
    stamps = [r.time_s for r in rows]
    assert stamps[0] == 0.0 and stamps == sorted(stamps)
    window = arrivals.trace_window(stamps, 500, start_index=1000)
    original_span = stamps[1499] - stamps[1000]
    assert window[-1] == pytest.approx(original_span)
    factor = arrivals.scale_for_rate(window, rate_rps=2.0)
    scaled = arrivals.scale_times(window, factor)
    assert scaled[-1] == pytest.approx(original_span * factor)
    assert 499 / scaled[-1] == pytest.approx(2.0)
    # order kept: the permutation that sorts the scaled window is the identity
    assert list(np.argsort(scaled, kind="stable")) == list(range(500))


def test_azure_stamps_are_parsed_to_seconds() -> None:
    try:
        folder = data.data_dir()
    except FileNotFoundError:
        pytest.skip("shared data folder not present")
    rows = data.load_trace(folder, "azure_conv")
    # 18:15:46.6805900 -> 18:15:50.9951690 (first two rows of the file)
    assert rows[1].time_s == pytest.approx(4.314579, abs=1e-6)
    assert rows[-1].time_s == pytest.approx(3502, abs=1.0)  # README: span 3,502 s


def test_window_out_of_range_is_an_error() -> None:
    with pytest.raises(ValueError):
        arrivals.trace_window([0.0, 1.0], 3)


def test_constant_arrivals_are_evenly_spaced() -> None:
    assert arrivals.constant_arrivals(4, 2.0) == [0.0, 0.5, 1.0, 1.5]
    assert arrivals.constant_arrivals(2, math.inf) == [0.0, 0.0]
    assert arrivals.constant_arrivals(0, 1.0) == []
    with pytest.raises(ValueError):
        arrivals.constant_arrivals(3, 0.0)
