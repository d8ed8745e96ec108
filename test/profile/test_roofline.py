"""Knee detection on synthetic step-time curves with a known knee; cache and drift logic (no server)."""

from __future__ import annotations

import json
import time

import numpy as np
import pytest

from sglang_spex.profile import cache
from sglang_spex.profile.cache import PLAIN, Point, Profile
from sglang_spex.profile.drift import DriftMonitor
from sglang_spex.profile.roofline import find_knee, fit_segments, k_total_from_knee

B = np.array([1, 2, 4, 8, 16, 32, 64, 128, 256, 512], dtype=float)


@pytest.mark.parametrize("knee", [12.0, 48.0, 100.0, 200.0])
def test_ideal_roofline_knee(knee):
    base = 0.010
    t = np.maximum(base, base / knee * B)  # flat (memory-bound) then ∝ B (compute-bound)
    fit = find_knee(B, t)
    assert fit.bounded and fit.knee == pytest.approx(knee, rel=0.02)
    assert k_total_from_knee(fit) == pytest.approx(knee, abs=1)


@pytest.mark.parametrize("seed", range(5))
def test_noisy_knee(seed):
    rng = np.random.default_rng(seed)
    t = np.maximum(0.02, 0.02 / 64 * B) + 0.0005 * B / 512  # slightly sloped memory-bound part
    t = t * (1 + 0.03 * rng.standard_normal(B.size))
    fit = find_knee(B, t)
    assert fit.knee == pytest.approx(64, rel=0.25)


def test_linear_cpu_curve_knee_is_a_over_b():
    # the measured CPU shape: 50 ms + 4.2 ms × batch, no sharp knee → throughput at half its asymptote
    b = np.array([1, 2, 4, 8, 16, 32], dtype=float)
    fit = find_knee(b, 0.050 + 0.0042 * b)
    assert fit.knee == pytest.approx(0.050 / 0.0042, rel=1e-6)
    assert fit.b1 == pytest.approx(fit.b2)


def test_memory_bound_everywhere_is_unbounded():
    fit = find_knee(B[:5], 0.01 + 1e-6 * B[:5])
    assert not fit.bounded and fit.knee == B[4]


def test_bad_input():
    with pytest.raises(ValueError):
        find_knee([1], [0.1])
    with pytest.raises(ValueError):
        find_knee([1, 2], [0.1, 0.2], threshold=1.5)


def _profile(key=None, times=(0.05, 0.054, 0.067, 0.084)):
    return Profile.from_points(key or {"model": "m", "hardware": "h", "flags": {}}, [1, 2, 4, 8], times, 20)


def test_cache_roundtrip_and_staleness(tmp_path):
    prof = _profile()
    cache.save(prof, tmp_path)
    again = cache.load(prof.key, tmp_path)
    assert again is not None and again.step_times == prof.step_times and again.fit == prof.fit
    assert cache.load({**prof.key, "model": "other"}, tmp_path) is None
    old = _profile()
    old.created_at = time.time() - 10 * 24 * 3600
    cache.save(old, tmp_path)
    assert cache.load(old.key, tmp_path) is None  # stale → re-measure
    assert cache.latest_profile(tmp_path) is not None


def test_drift_monitor():
    prof = _profile()
    mon = DriftMonitor(prof.predict, threshold=0.2, min_samples=4)
    for _ in range(10):
        assert not mon.observe(4, prof.predict(4) * 1.1)  # 10% off: fine
    mon.reset()
    flags = [mon.observe(4, prof.predict(4) * 1.3) for _ in range(6)]
    assert flags[:3] == [False] * 3 and flags[-1] and mon.drift == pytest.approx(0.3)


def test_one_profile_for_roofline_and_respec_curves(tmp_path):
    prof = _profile()
    assert prof.batch_sizes == [1, 2, 4, 8] and prof.points[PLAIN][4].step_s == 0.067 and prof.configs == []
    prof.add("NGRAM:s4t1n4", Point(4, 0.08, 2.0, 100.0, 2.1, 7))  # a ReSpec curve in the same profile
    again = Profile.load(prof.save(tmp_path / "p.json"))
    assert again.points == prof.points and again.fit == prof.fit and again.key == prof.key
    assert again.configs == ["NGRAM:s4t1n4"] and again.k_total == prof.k_total


def test_profile_built_point_by_point_fits_its_roofline_on_demand():
    prof = Profile("m", "", "cpu")
    for b in (1, 2, 4, 8, 16, 32):
        prof.add(PLAIN, Point.plain(b, 0.05 + 0.004 * b))
    assert prof.fit is None and prof.predict(4) == pytest.approx(0.066)
    assert prof.knee == pytest.approx(0.05 / 0.004, rel=1e-6) and prof.k_total >= 1
    with pytest.raises(ValueError):
        Profile("m").predict(1)
    with pytest.raises(ValueError):
        Profile.from_points({"model": "m", "gpu": "x"}, [1, 2], [0.1, 0.2], 1)


def test_format_1_roofline_profile_is_read_and_stale(tmp_path):
    key = {"model": "m", "hardware": "h", "flags": {"dtype": "bfloat16"}}
    old = _profile(key).to_dict()
    v1 = {k: old[k] for k in ("key", "batch_sizes", "step_times", "context_len", "fit", "k_total", "created_at")}
    v1.update(raw={"spec": {"repeats": 2}}, versions={**old["versions"], "format": "1"})
    cache.path_for(key, tmp_path).write_text(json.dumps(v1))
    prof = Profile.from_dict(v1)
    assert prof.step_times == list(old["step_times"]) and prof.key == key and prof.meta["spec"] == {"repeats": 2}
    assert cache.load(key, tmp_path) is None  # another file format: re-measure
    assert cache.latest_profile(tmp_path).step_times == prof.step_times


@pytest.mark.parametrize("noise", [0.005, 0.01, 0.02])
def test_timing_noise_alone_buys_no_breakpoint(noise):
    """A straight CPU line with a ±noise zig-zag stays one line: a break that cuts the residual by less than 30 %
    is not kept (without that guard the zig-zag reads as a break near B = 32)."""
    b = np.array([1, 2, 4, 8, 16, 32, 64], dtype=float)
    t = (0.050 + 0.0042 * b) * (1 + noise * (-1.0) ** np.arange(b.size))
    a, b1, b2, k, _ = fit_segments(b, t)
    assert k == 64.0 and b1 == b2 and b1 == pytest.approx(0.0042, rel=0.02)


def test_a_slope_clipped_to_zero_leaves_the_weighted_mean_as_intercept():
    """Step times that fall a little with the batch (a disturbed flat curve) fit a slope of 0; the intercept is
    then re-centred to their relative-error-weighted mean, not left where the negative slope put it."""
    b = np.array([1, 2, 4, 8, 16], dtype=float)
    t = np.array([0.0105, 0.0103, 0.0101, 0.0099, 0.0097])
    a, b1, b2, _, _ = fit_segments(b, t)
    w2 = 1 / t**2
    assert b1 == b2 == 0.0 and a == pytest.approx(float(np.sum(w2 * t) / np.sum(w2)), rel=1e-9)
