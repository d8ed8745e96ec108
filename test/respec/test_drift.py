"""The one drift monitor (``profile/drift.py``) as SPEX's roofline and ReSpec's re-profiler use it (no server)."""

from __future__ import annotations

import pytest

from sglang_spex.profile.drift import DriftMonitor
from sglang_spex.respec.drift import OnlineReprofiler
from sglang_spex.respec.profiler import PLAIN, Point, Profile

KEY = "NGRAM:s4t1n4"


def _flat(value: float):
    return lambda batch: value


def test_median_ignores_outliers_mean_does_not():
    med = DriftMonitor(_flat(1.0), threshold=0.2, window=10, min_samples=10, statistic="median")
    mean = DriftMonitor(_flat(1.0), threshold=0.2, window=10, min_samples=10, statistic="mean")
    for i in range(10):
        v = 10.0 if i == 0 else 1.0  # one step ten times slower
        med.observe(1, v)
        mean.observe(1, v)
    assert med.drift == pytest.approx(0.0) and not med.drifted
    assert mean.drift == pytest.approx(0.9) and mean.drifted


def test_mean_of_a_small_count_is_not_its_median():
    # a 1-draft chain accepting 40 % of the time: 1, 2, 1, 1, 2, ... (median 1, mean 1.4) against a mean of 1.4
    obs = [2.0 if i % 5 in (1, 4) else 1.0 for i in range(20)]
    med = DriftMonitor(_flat(1.4), window=20, min_samples=20, statistic="median")
    mean = DriftMonitor(_flat(1.4), window=20, min_samples=20, statistic="mean")
    for v in obs:
        med.observe(4, v)
        mean.observe(4, v)
    assert med.drifted and med.drift == pytest.approx(1.0 / 1.4 - 1.0)
    assert not mean.drifted and mean.drift == pytest.approx(0.0)


def test_verdict_waits_for_min_samples_and_window_slides():
    mon = DriftMonitor(_flat(2.0), threshold=0.2, window=4, min_samples=3)
    assert [mon.observe(1, 3.0) for _ in range(3)] == [False, False, True]
    for _ in range(4):  # four good samples push every bad one out of the window
        mon.observe(1, 2.0)
    assert mon.samples == 4 and mon.drift == 0.0 and not mon.drifted
    assert not mon.observe(0, 9.0) and not mon.observe(1, 0.0) and mon.samples == 4  # ignored
    mon.reset(_flat(4.0))
    assert mon.samples == 0 and mon.observe(1, 4.0) is False and mon.drift == 0.0


def test_bad_arguments():
    with pytest.raises(ValueError):
        DriftMonitor(_flat(1.0), statistic="mode")
    with pytest.raises(ValueError):
        DriftMonitor(_flat(1.0), window=8, min_samples=9)


def _profile() -> Profile:
    prof = Profile("m", "d", "cpu")
    for b in (1, 4, 16):
        prof.add(PLAIN, Point(b, 0.010, 1.0, b / 0.010))
        prof.add(KEY, Point(b, 0.012, 2.0, b * 2.0 / 0.012, 2.0))
    return prof


def test_reprofiler_defaults_128_step_windows_64_samples_before_a_verdict():
    rp = OnlineReprofiler(_profile(), [KEY], max_batch=16)
    plans = [rp.observe(KEY, 4, 0.012, 1.0) for _ in range(64)]  # acceptance halved from the first step on
    assert all(p is None for p in plans[:63]) and plans[63] is not None and rp.reprofiles == 1
    mons = {w: rp._monitor(KEY, w) for w in ("cost", "tokens")}
    assert {w: (m.window, m.min_samples, m.statistic) for w, m in mons.items()} == {
        "cost": (128, 64, "median"),
        "tokens": (128, 64, "mean"),
    }
