"""bench_respec_rl's reward comparison across RL seeds (gaps paired by seed, read against no speculation's spread)
and its reward trend over the run."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmark"))

import json  # noqa: E402

from bench_respec_rl import pooled_acceptance, reward_trend, seed_noise  # noqa: E402


def _run(seed: int, rewards):
    return {"seed": seed, "steps": [{"step": i, "reward_mean": r} for i, r in enumerate(rewards)]}


def test_gaps_are_paired_by_seed():
    runs = {
        "none": [_run(0, [0.2, 0.4]), _run(1, [0.5, 0.7])],  # run means 0.3 and 0.6
        "respec": [_run(1, [0.6, 0.6]), _run(0, [0.1, 0.3])],  # 0.6 (seed 1) and 0.2 (seed 0): listed out of order
    }
    out = seed_noise(runs)
    assert out["none_reward_by_seed"] == pytest.approx({0: 0.3, 1: 0.6})
    assert out["none_reward_spread"] == pytest.approx(0.3)
    assert out["respec"]["gap_min_max"] == pytest.approx([-0.1, 0.0])
    assert out["respec"]["gap_mean"] == pytest.approx(-0.05)


def test_a_seed_without_a_baseline_run_is_not_compared():
    out = seed_noise({"none": [_run(0, [0.5])], "naive": [_run(0, [0.7]), _run(3, [0.0])]})
    assert out["naive"]["gap_min_max"] == pytest.approx([0.2, 0.2])
    assert "none_reward_spread" not in out


def test_reward_trend_pools_seeds_and_reads_a_rise():
    rising = [_run(0, [0.1, 0.2, 0.3, 0.4, 0.5, 0.6]), _run(1, [0.2, 0.2, 0.4, 0.4, 0.6, 0.6])]
    t = reward_trend(rising)
    assert t["slope_per_step"] == pytest.approx(0.67 / 7, rel=1e-9)  # least squares: Sxy 3.35 over Sxx 35
    assert t["fitted_rise"] == pytest.approx(5 * t["slope_per_step"])
    assert t["p_rise"] < 1e-4 and t["first_third_mean"] == pytest.approx(0.175) and t["last_third_mean"] == 0.575
    flat = reward_trend([_run(0, [0.5, 0.1, 0.5, 0.1, 0.5, 0.1]), _run(1, [0.1, 0.5, 0.1, 0.5, 0.1, 0.5])])
    assert flat["slope_per_step"] == pytest.approx(0.0, abs=1e-12) and flat["p_rise"] == pytest.approx(0.5)
    assert reward_trend([_run(0, [0.1, 0.2])]) == {}  # two steps: no trend to read


def test_acceptance_trend_skips_steps_without_speculation():
    steps = [{"step": i, "reward_mean": 0.0, "accept_length": a} for i, a in enumerate([3.0, None, 2.5, 2.0, 1.5])]
    t = reward_trend([{"seed": 0, "steps": steps}], "accept_length")
    assert t["slope_per_step"] == pytest.approx(-13 / 35, rel=1e-9)  # steps 0, 2, 3, 4 only: Sxy -3.25 / Sxx 8.75
    assert t["p_rise"] > 0.99 and t["first_third_mean"] == 3.0
    assert reward_trend([{"seed": 0, "steps": steps[:2]}], "accept_length") == {}


def test_pooled_acceptance_names_learners_by_kd_variant_and_compares_slopes(tmp_path):
    def run(seed, accepts):
        return {
            "seed": seed,
            "steps": [{"step": i, "reward_mean": 0.0, "accept_length": a} for i, a in enumerate(accepts)],
        }

    falling = ([3.0, 2.9, 2.8, 2.7, 2.6, 2.5], [3.0, 2.8, 2.8, 2.6, 2.6, 2.4])  # slopes -0.1 and -3.8 / 35
    held = ([3.0, 3.0, 3.1, 3.0, 3.0, 3.1], [3.0, 3.1, 3.0, 3.0, 3.1, 3.0])
    files = []
    for k, variant in enumerate(("reward", None)):  # a file from before --kd-variant counts as "reward"
        args = {"kd_variant": variant} if variant else {}
        body = {
            "meta": {"args": args},
            "runs": {"naive": [run(k, falling[k])], "learner": [run(k, held[0]), run(k + 5, held[1])]},
        }
        files.append(tmp_path / f"r{k}.json")
        files[-1].write_text(json.dumps(body))
    out = pooled_acceptance([str(f) for f in files])
    assert set(out["modes"]) == {"naive", "learner-reward"}
    naive = out["modes"]["naive"]
    assert len(naive["runs"]) == 2 and naive["slope_mean"] == pytest.approx((-0.1 - 3.8 / 35) / 2)
    assert naive["change_mean"] == pytest.approx((2.55 / 2.95 + 2.5 / 2.9) / 2 - 1)  # last / first third per run
    assert len(out["modes"]["learner-reward"]["runs"]) == 4
    assert list(out["slope_welch_p"]) == ["learner-reward vs naive"]
