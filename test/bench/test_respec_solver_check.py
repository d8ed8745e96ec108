"""bench_respec_solver's tables: the model's prediction per state, paired measured ratios, plan vs oracle."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmark"))

from bench_respec_solver import choices_vs_oracle, measured_speedups, predicted_table  # noqa: E402

from sglang_spex.respec.profiler import PLAIN, Point, Profile  # noqa: E402
from sglang_spex.respec.solver import solve  # noqa: E402

CHAIN, TREE = "EAGLE3:s3t1n4", "EAGLE3:s2t2n4"


def _profile():
    prof = Profile("m", "d", "cpu")
    curves = {
        PLAIN: {1: (0.050, 1.0), 16: (0.110, 1.0)},
        CHAIN: {1: (0.070, 2.1), 16: (0.300, 2.1)},  # 1.5x at B=1, 0.77x at 16
        TREE: {1: (0.080, 2.0), 16: (0.200, 2.0)},  # 1.25x at B=1, 1.1x at 16
    }
    for key, pts in curves.items():
        for b, (step, tps) in pts.items():
            prof.add(key, Point(b, step, tps, b * tps / step))
    return prof


def test_prediction_is_the_speedup_model_at_profiled_and_interpolated_sizes():
    pred = predicted_table(_profile(), [1, 16, 4])
    assert set(pred) == {CHAIN, TREE}
    assert pred[CHAIN][1] == pytest.approx(2.1 * 0.050 / 0.070)
    assert pred[TREE][16] == pytest.approx(2.0 * 0.110 / 0.200)
    # between profiled sizes both costs interpolate linearly
    plain4, chain4 = 0.050 + 0.06 * 3 / 15, 0.070 + 0.23 * 3 / 15
    assert pred[CHAIN][4] == pytest.approx(2.1 * plain4 / chain4)


def test_measured_speedups_pair_each_repeat_with_plain_of_the_same_repeat():
    tput = {PLAIN: {1: [10.0, 20.0]}, CHAIN: {1: [15.0, 20.0]}, TREE: {1: [5.0, 40.0]}}
    m = measured_speedups(tput)
    assert m[CHAIN][1]["median"] == pytest.approx(1.25) and m[CHAIN][1]["min"] == pytest.approx(1.0)
    assert m[TREE][1]["min"] == pytest.approx(0.5) and m[TREE][1]["max"] == pytest.approx(2.0)
    assert PLAIN not in m


def test_plan_against_the_measured_best():
    plan = solve(_profile(), max_batch=16, configs=[CHAIN, TREE])
    assert plan.choose(1) == CHAIN and plan.choose(16) == TREE
    measured = {
        CHAIN: {1: {"median": 1.4}, 16: {"median": 0.8}},
        TREE: {1: {"median": 1.5}, 16: {"median": 1.01}},  # 1.01 is under the 2 % gain: plain is the oracle
    }
    v = choices_vs_oracle(plan, measured, [1, 16])
    assert v[1]["oracle"] == TREE and v[1]["plan"] == CHAIN and v[1]["of_oracle"] == pytest.approx(1.4 / 1.5)
    assert v[16]["oracle"] is None and v[16]["of_oracle"] == pytest.approx(1.01)
    # a NaN measurement never wins
    measured[TREE][1]["median"] = math.nan
    assert choices_vs_oracle(plan, measured, [1])[1]["oracle"] == CHAIN


def test_mean_accept_prediction_uses_sglangs_accept_length_with_the_same_step_costs():
    prof = _profile()
    for key in (CHAIN, TREE):  # a fixed batch's slowest request gains less than the mean request
        for b, pt in prof.points[key].items():
            prof.points[key][b] = Point(b, pt.step_s, pt.tokens_per_step, pt.throughput, accept_length=3.0)
    pred = predicted_table(prof, [1, 16], gain="accept_length")
    assert pred[CHAIN][1] == pytest.approx(3.0 * 0.050 / 0.070)
    assert pred[TREE][16] == pytest.approx(3.0 * 0.110 / 0.200)
    assert pred[TREE][16] > predicted_table(prof, [16])[TREE][16]
