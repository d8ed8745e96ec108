"""The live knee is reported only when the decode step times support it: enough batch sizes over a wide enough
range and a slope whose error leaves the knee inside the measured batches (pure logic, no engine)."""

from __future__ import annotations

import random
from typing import Iterable, Sequence

import pytest

from sglang_spex.srt.live_curve import KNEE_SE, MIN_BATCH_RANGE, MIN_BATCH_SIZES, LiveCurve, fit_line
from sglang_spex.srt.scheduling import SpexSchedulerState

A, B = 0.118, 0.07 * 0.118  # the 1-query host: a ≈ 118 ms, b/a = 0.07 (true knee ≈ 14)


def test_rule_constants():
    assert (MIN_BATCH_SIZES, MIN_BATCH_RANGE, KNEE_SE) == (4, 2.0, 2.0)


def test_noisy_narrow_range_shows_no_knee_at_any_refit():
    rng = random.Random(16)
    curve = LiveCurve()
    for _ in range(2000):
        batch = rng.choice((1, 2, 3))
        curve.add(batch, (A + B * batch) * (1 + rng.uniform(-0.2, 0.2)))
        assert curve.knee() is None
    assert curve.line() is not None and curve.quality()["why"] == "few batch sizes"


def test_correlated_host_noise_no_longer_sets_a_knee_of_two():
    """The incident: the batch-3 steps ran in a slow spell, the batch-1 steps in a fast one (±20%). The line reads
    a ≈ 65 ms, b ≈ 35 ms per row (knee 2, inside the measured 1..3); the old rule held speculation to 1-2 rows."""
    curve = LiveCurve(refit_every=1)
    for _ in range(curve.window):
        for batch, f in ((1, 0.8), (2, 1.0), (3, 1.2)):
            curve.add(batch, (A + B * batch) * f)
    a, b = curve.line()
    assert a / b < 3 and b == pytest.approx(0.035, rel=0.02)  # what the ungated fit made of it
    assert curve.knee() is None and curve.quality()["why"] == "few batch sizes"


def feed(curve: LiveCurve, batches: Sequence[int], step, rounds: int) -> None:
    for _ in range(rounds):
        for batch in batches:
            curve.add(batch, step(batch))


def test_clean_compute_bound_curve_over_1_to_32_shows_its_knee():
    curve = LiveCurve()
    feed(curve, (1, 2, 4, 8, 16, 32), lambda b: 0.020 + 0.002 * b, 16)  # half the step scales with B at B = 10
    assert curve.knee() == 10
    q = curve.quality()
    assert q["why"] == "ok" and q["knee_lo"] == 10 and q["batch_sizes"] == 6 and q["batch_range"] == 32


def test_mildly_noisy_compute_bound_curve_still_shows_its_knee():
    rng = random.Random(7)
    curve = LiveCurve()
    feed(curve, (1, 2, 4, 8, 16, 32), lambda b: (0.020 + 0.002 * b) * (1 + rng.uniform(-0.05, 0.05)), 16)
    assert 9 <= curve.knee() <= 11 and curve.quality()["knee_lo"] <= 32


def samples(median: float, spread: Iterable[float]):
    return [median * (1 + d) for d in spread]


@pytest.mark.parametrize(
    "spread, knee", [((-0.01, -0.005, 0.0, 0.005, 0.01), 2), ((-0.5, -0.25, 0.0, 0.25, 0.5), None)]
)
def test_the_knee_must_survive_the_slope_error_of_the_steps(spread, knee):
    """Same medians (t = 10 ms + 5 ms·B over 1..8, knee 2): tight steps show it, steps spread ±50% do not."""
    curve = LiveCurve(refit_every=1)
    for batch in (1, 2, 4, 8):
        for t in samples(0.010 + 0.005 * batch, spread):
            curve.add(batch, t)
    assert curve.knee() == knee
    assert curve.quality()["why"] == ("ok" if knee else "uncertain")
    assert curve.line()[1] == pytest.approx(0.005)  # the line itself is the same either way


def test_medians_off_any_line_show_no_knee():
    fit = fit_line([(1, 0.010, 0.0), (2, 0.040, 0.0), (4, 0.012, 0.0), (8, 0.060, 0.0)])
    assert fit.knee is None and fit.why == "uncertain" and fit.line is not None


def test_a_narrow_batch_range_shows_no_knee():
    fit = fit_line([(b, 0.010 + 0.005 * b, 0.0) for b in (10, 11, 12, 13)])
    assert fit.knee is None and fit.why == "narrow range"
    assert fit_line([(b, 0.010 + 0.005 * b, 0.0) for b in (7, 9, 11, 14)]).knee == 2


def test_flat_and_past_range_curves_say_so():
    assert fit_line([(b, 0.010, 0.0) for b in (1, 2, 4, 8)]).why == "flat"
    assert fit_line([(b, 0.010 + 0.0001 * b, 0.0) for b in (1, 2, 4, 8)]).why == "past range"


def test_stats_report_the_fit_quality():
    state = SpexSchedulerState()
    assert state.report()["live_fit"] is None
    feed(state.curve, (1, 2, 3), lambda b: A + B * b, 16)
    rep = state.report()
    assert rep["live_knee"] is None and rep["live_fit"]["why"] == "few batch sizes"
    assert rep["live_fit"]["batch_sizes"] == 3
