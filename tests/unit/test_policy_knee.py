"""Chunk-size calibration on hand-made throughput curves. The pick is read off the curve between
the measured sizes (rounded up to 16 tokens): on a curve that is flat from its knee on, the size
where it reaches 95% of the plateau, just under the knee."""

from __future__ import annotations

import math
import random
import statistics
from collections.abc import Callable

import pytest

from tetri_server.policy import pick_chunk_size, throughput_curve

SIZES = [32, 64, 128, 256, 512, 1024, 2048, 4096]


def samples_from_throughput(tps: dict[int, float]) -> list[tuple[int, float]]:
    return [(n, n / t) for n, t in tps.items()]


def saturating(knee: int, plateau_tps: float = 10_000.0) -> dict[int, float]:
    return {n: plateau_tps * min(n, knee) / knee for n in SIZES}


def near(knee: int) -> int:
    """Where ``saturating(knee)`` reaches 95% of its plateau, rounded up to 16 tokens."""
    return math.ceil(0.95 * knee / 16) * 16


def test_clean_knee_is_found() -> None:
    assert pick_chunk_size(samples_from_throughput(saturating(512))) == near(512) == 496
    assert pick_chunk_size(samples_from_throughput(saturating(2048))) == near(2048) == 1952
    assert pick_chunk_size(samples_from_throughput(saturating(512)), multiple=1) == 487


def test_tolerance_accepts_a_size_just_below_the_plateau() -> None:
    tps = saturating(1024)
    tps[512] = 0.96 * tps[1024]
    assert pick_chunk_size(samples_from_throughput(tps)) == 512
    # 99% of the plateau lies between 512 (96%) and 1024 (100%): three quarters of the way
    assert pick_chunk_size(samples_from_throughput(tps), tolerance=0.01) == 896


def test_a_single_lucky_small_measurement_is_not_picked() -> None:
    tps = saturating(512)
    tps[64] = 3 * tps[512]  # one spike, e.g. a timer glitch
    assert pick_chunk_size(samples_from_throughput(tps)) == near(512)


def test_a_single_spike_does_not_raise_the_plateau() -> None:
    tps = saturating(512)
    tps[2048] = 2 * tps[512]
    assert pick_chunk_size(samples_from_throughput(tps)) == near(512)


def test_a_lucky_first_measurement_is_capped_by_its_neighbour() -> None:
    tps = saturating(512)
    tps[32] = 1.5 * tps[512]
    assert pick_chunk_size(samples_from_throughput(tps)) == near(512)


def test_a_slow_measurement_at_the_knee_costs_at_most_one_size_step() -> None:
    tps = saturating(512)
    tps[512] *= 0.7  # the machine was busy during this one measurement
    assert 512 < pick_chunk_size(samples_from_throughput(tps)) <= 1024
    tps = saturating(512)
    tps[2048] *= 0.5  # a slow one well past the knee changes nothing
    assert pick_chunk_size(samples_from_throughput(tps)) == near(512)


def test_noisy_curve_with_repeats_finds_the_knee() -> None:
    rng = random.Random(0)
    samples = [
        (n, n / (t * rng.uniform(0.98, 1.02))) for n, t in saturating(256).items() for _ in range(5)
    ]
    samples.append((1024, 1024 / 1.0))  # one absurdly slow repeat: the median ignores it
    assert near(256) - 16 <= pick_chunk_size(samples) <= 256


def test_curve_that_never_flattens_returns_about_the_largest_size() -> None:
    tps = {n: float(n) for n in SIZES}  # linear: no knee in range
    assert pick_chunk_size(samples_from_throughput(tps)) == near(4096)


def test_curve_that_declines_after_the_knee_uses_the_peak_as_plateau() -> None:
    tps = saturating(512)
    tps.update({1024: tps[512] * 0.97, 2048: tps[512] * 0.9, 4096: tps[512] * 0.8})
    assert pick_chunk_size(samples_from_throughput(tps)) == near(512)


def gradual(overhead_s: float) -> Callable[[int], float]:
    """A CPU's pass time: a fixed cost, a cost per token and attention over packed prompts of
    at most 1024 tokens (fitted to 8 interleaved rounds on an AMD EPYC, bench model, 1 core;
    the fixed cost varies here). Throughput approaches its plateau slowly."""
    return lambda n: overhead_s + 1.97e-4 * n + 7.65e-8 * n * min(n, 1024)


def test_the_pick_moves_a_little_with_noise_where_a_measured_size_sits_on_the_line() -> None:
    """Regression: with 5% noise on each pass and the best of three rounds, a pick limited to
    the measured sizes went 128 in 131 draws and 256 in 69 of 200 on this curve (whose 95%
    crossing is at about 128); the session-25 build went 64 <-> 256 between runs. The
    interpolated crossing stays within 1.5x."""
    time_of = gradual(7e-3)
    clean = pick_chunk_size([(n, time_of(n)) for n in SIZES])
    picks = []
    for seed in range(200):
        rng = random.Random(seed)
        picks.append(pick_chunk_size(
            [(n, min(time_of(n) * rng.uniform(1.0, 1.05) for _ in range(3))) for n in SIZES]))
    assert clean == 128
    assert max(picks) <= 1.5 * min(picks) and min(picks) >= 112 and max(picks) <= 192
    assert statistics.median(picks) in (128, 144)


def test_decode_rows_riding_in_every_chunk_raise_the_pick() -> None:
    """A prefill worker's own decode rows take part of each chunk at a cost per step about the
    same whatever the chunk: the prompt rate of a small chunk suffers most, so its knee lies
    above the knee of bare prompt passes."""

    def step_s(num_prompt: int, num_rows: int) -> float:
        return 1e-3 + num_rows * 0.6e-3 + num_prompt / 4000

    bare = [(n, step_s(n, 0)) for n in SIZES]
    mixed = [(n, step_s(n - 16, 16)) for n in SIZES]
    assert pick_chunk_size(bare) == 96
    assert pick_chunk_size(mixed, riders=16) >= 3 * 96
    assert throughput_curve(mixed, riders=16)[0] == (32, 16 / step_s(16, 16))
    with pytest.raises(ValueError):
        throughput_curve([(16, 1.0)], riders=16)  # a chunk of decode rows only


def test_throughput_curve_sorts_and_takes_median_time() -> None:
    curve = throughput_curve([(200, 1.0), (100, 1.0), (100, 3.0), (100, 2.0)])
    assert curve == [(100, 50.0), (200, 200.0)]


def test_bad_samples_are_refused() -> None:
    with pytest.raises(ValueError):
        pick_chunk_size([])
    with pytest.raises(ValueError):
        pick_chunk_size([(128, 0.0)])
    with pytest.raises(ValueError):
        pick_chunk_size([(0, 1.0)])
    assert pick_chunk_size([(128, 0.5)]) == 128
    with pytest.raises(ValueError):
        pick_chunk_size([(128, 0.5)], multiple=0)
