"""SLO attainment and goodput (bench/slo.py) on hand-made request records."""

from __future__ import annotations

import pytest

from tetri_server.bench.client import RequestRecord
from tetri_server.bench.slo import (
    Calibration,
    SLOScale,
    attainment,
    calibration_from_samples,
    fit_prefill,
    goodput_rps,
    meets_slo,
    tpot_slo_s,
    ttft_slo_s,
)

# unloaded prefill = 10 ms + 1 ms/token, step = 20 ms: with 5x / 3x, a 100-token prompt has a
# TTFT SLO of 5 * 0.110 = 0.55 s and every request a TPOT SLO of 60 ms
CAL = Calibration(prefill_base_s=0.010, prefill_per_token_s=0.001, step_s=0.020)
SCALE = SLOScale()


def rec(
    ttft: float, tpot: float | None, prompt_len: int = 100, send: float = 1.0, error: str = ""
) -> RequestRecord:
    """A completed request: sent at ``send``, first token ``ttft`` later, then 11 tokens
    ``tpot`` apart (or a one-token request when ``tpot`` is None)."""
    n = 1 if tpot is None else 11
    first = send + ttft
    times = [first + i * (tpot or 0.0) for i in range(n)]
    return RequestRecord(
        0,
        "LPLD",
        prompt_len,
        n,
        arrival_s=send,
        send_s=send,
        first_token_s=first,
        token_times_s=times,
        end_s=times[-1],
        num_output_tokens=n,
        error=error or None,
    )


def test_slos_scale_the_unloaded_latencies() -> None:
    assert ttft_slo_s(CAL, SCALE, 100) == pytest.approx(0.55)
    assert ttft_slo_s(CAL, SCALE, 1000) == pytest.approx(5.05)
    assert tpot_slo_s(CAL, SCALE) == pytest.approx(0.060)
    assert tpot_slo_s(CAL, SLOScale(tpot_x=2)) == pytest.approx(0.040)


def test_thresholds_are_inclusive_and_both_must_hold() -> None:
    assert meets_slo(rec(0.55, 0.060), CAL, SCALE)  # exactly on both lines
    assert not meets_slo(rec(0.5501, 0.030), CAL, SCALE)  # TTFT just over
    assert not meets_slo(rec(0.10, 0.0601), CAL, SCALE)  # TPOT just over
    # the TTFT objective follows the prompt: 2 s is fine for 1000 tokens, not for 100
    assert meets_slo(rec(2.0, 0.03, prompt_len=1000), CAL, SCALE)
    assert not meets_slo(rec(2.0, 0.03, prompt_len=100), CAL, SCALE)


def test_one_token_requests_have_no_tpot_and_failures_miss() -> None:
    assert meets_slo(rec(0.2, None), CAL, SCALE)
    assert not meets_slo(rec(0.1, 0.01, error="timeout"), CAL, SCALE)
    unfinished = RequestRecord(1, "LPLD", 100, 10, 0.0, send_s=0.0)
    assert not meets_slo(unfinished, CAL, SCALE)


def test_attainment_counts_every_request_sent() -> None:
    good, slow = rec(0.1, 0.02), rec(1.0, 0.02)
    failed = rec(0.1, 0.02, error="HTTP 500")
    assert attainment([good] * 9 + [slow], CAL, SCALE) == pytest.approx(0.9)
    assert attainment([good, good, failed, slow], CAL, SCALE) == pytest.approx(0.5)
    assert attainment([], CAL, SCALE) == 0.0


def test_goodput_is_the_highest_rate_before_the_first_failure() -> None:
    # 90% passes exactly; 89% fails
    assert goodput_rps([(0.2, 1.0), (0.4, 0.9), (0.6, 0.89)]) == 0.4
    assert goodput_rps([(0.6, 0.5), (0.2, 0.95), (0.4, 0.92)]) == 0.4  # order of points
    assert goodput_rps([(0.2, 1.0), (0.4, 1.0)]) == 0.4  # never failed: the highest tested
    # a pass above a failing rate is noise and does not count
    assert goodput_rps([(0.2, 1.0), (0.4, 0.7), (0.6, 0.95)]) == 0.2
    assert goodput_rps([(0.2, 0.8), (0.4, 1.0)]) == 0.0  # below the lowest rate tested
    assert goodput_rps([(0.2, 0.8), (0.4, 0.8)], target=0.75) == 0.4


def test_prefill_fit_recovers_a_line_and_stays_positive() -> None:
    a, b = fit_prefill([(100, 0.11), (500, 0.51), (1000, 1.01), (100, 0.11)])
    assert (a, b) == (pytest.approx(0.01), pytest.approx(0.001))
    # noise giving a falling line: a flat one at the median
    assert fit_prefill([(100, 0.30), (1000, 0.20), (500, 0.25)]) == (pytest.approx(0.25), 0.0)
    # a negative intercept: a line through the origin, so short prompts keep a positive SLO
    a, b = fit_prefill([(100, 0.01), (1000, 1.0)])
    assert a == 0.0 and b > 0 and ttft_slo_s(Calibration(a, b, 0.02), SCALE, 16) > 0
    assert fit_prefill([(256, 0.2), (256, 0.3), (256, 0.4)]) == (pytest.approx(0.3), 0.0)
    with pytest.raises(ValueError):
        fit_prefill([])


def test_a_short_prompt_is_not_held_to_less_than_the_shortest_lone_ttft() -> None:
    # session 20's LPHD calibration (no short probe then): TTFT grows faster than linearly with
    # the prompt, the intercept fits negative, and a 7-token prompt got 5 x 2.6 ms = 13 ms,
    # under one round trip + one step; every miss at the low rates was such a prompt
    long_only = [(127, 0.0494), (511, 0.1773), (1022, 0.3751), (1022, 0.4133)]
    shortest = [(4, 0.0121), (4, 0.0110), (4, 0.0135)]
    cal = calibration_from_samples([*shortest, *long_only], [0.0086], "coupled")
    assert cal.prefill_floor_s == pytest.approx(0.0121)  # the median of the 4-token TTFTs
    assert ttft_slo_s(cal, SCALE, 7) >= 5 * 0.0121
    ok = rec(ttft=0.030, tpot=0.010, prompt_len=7)  # 30 ms: what the misses took
    assert meets_slo(ok, cal, SCALE)
    # long prompts keep the line's SLO: the floor only lifts what falls below it
    assert cal.prefill_s(1022) == pytest.approx(cal.prefill_base_s + cal.prefill_per_token_s * 1022)
    assert cal.prefill_s(1022) > 0.3


def test_calibration_round_trips_through_json() -> None:
    cal = calibration_from_samples([(128, 0.05), (512, 0.2)], [0.03, 0.02, 0.025], "coupled")
    assert cal.step_s == pytest.approx(0.025)  # the median
    assert cal.prefill_s(128) == pytest.approx(0.05) and cal.prefill_s(512) == pytest.approx(0.2)
    assert Calibration.from_dict(cal.to_dict()) == cal
    assert cal.prefill_floor_s == pytest.approx(0.05)  # the shortest prompt sampled: 128
    # a calibration saved before the floor existed loads with none
    old = {k: v for k, v in cal.to_dict().items() if k != "prefill_floor_s"}
    assert Calibration.from_dict(old).prefill_floor_s == 0.0
    with pytest.raises(ValueError):
        calibration_from_samples([(128, 0.05)], [])
    with pytest.raises(ValueError):
        SLOScale(target=0.0)
