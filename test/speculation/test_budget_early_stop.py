"""T2 budget split and T3 early-stop rule on hand-computed cases."""

from __future__ import annotations

import math

import pytest

from sglang_spex.speculation.budget import QueryDemand, effective_k_total, running_hit_rate, split_budget
from sglang_spex.speculation.early_stop import EarlyStop


def demands(*specs):
    return [QueryDemand(f"q{i}", c, p, skv, tkv) for i, (c, p, skv, tkv) in enumerate(specs)]


def test_shares_sum_to_k_total_and_follow_softmax():
    d = demands((10, 0.9, 0, 0), (10, 0.1, 0, 0))
    shares = split_budget(d, k_total=8, temperature=0.5)
    assert sum(shares.values()) == 8
    # softmax(0.9/0.5, 0.1/0.5) = (0.832, 0.168) -> 6.65, 1.35: both above the minimum share 1 (a floor, not
    # added on top) -> largest remainders 7 / 1
    w = [math.exp(1.8), math.exp(0.2)]
    hi = 8 * w[0] / sum(w)
    assert shares["q0"] == round(hi) == 7 and shares["q1"] == 1


def test_caps_are_respected_and_excess_redistributed():
    d = demands((1, 0.9, 0, 0), (2, 0.8, 0, 0), (50, 0.1, 0, 0))
    shares = split_budget(d, k_total=10, temperature=0.1, min_share=0)
    assert shares == {"q0": 1, "q1": 2, "q2": 7}
    assert sum(split_budget(demands((1, 0.5, 0, 0), (2, 0.5, 0, 0)), k_total=10).values()) == 3  # all caps


def test_min_share_prevents_starvation():
    d = demands((5, 0.99, 0, 0), (5, 0.01, 0, 0), (5, 0.01, 0, 0))
    shares = split_budget(d, k_total=6, temperature=0.01, min_share=1)
    assert shares["q1"] >= 1 and shares["q2"] >= 1 and sum(shares.values()) == 6
    tight = split_budget(d, k_total=2, temperature=0.01, min_share=1)  # not enough for everyone: best first
    assert tight["q0"] == 1 and sum(tight.values()) == 2


def test_shared_kv_raises_score():
    d = demands((10, 0.5, 900, 1000), (10, 0.5, 0, 1000))
    shares = split_budget(d, k_total=9, temperature=0.05, min_share=0, weight_bytes=100)
    assert shares["q0"] > shares["q1"]


def test_running_hit_rate_prior_and_knee_backoff():
    assert running_hit_rate(0, 0) == 0.5
    assert running_hit_rate(8, 8) > 0.8
    assert effective_k_total(8, primary_batch=2, knee=6) == 4
    assert effective_k_total(8, primary_batch=7, knee=6) == 0
    assert effective_k_total(8, primary_batch=7, knee=None) == 8
    with pytest.raises(ValueError):
        split_budget(d := demands((1, 0.5, 0, 0)), k_total=1, temperature=0)
    assert d


def test_t3_stops_exactly_at_margin_rule():
    es = EarlyStop(alpha=0.5, min_answers=3)
    assert es.add("4", 1.0) is False  # n=1 < t
    assert es.add("5", 1.0) is False  # n=2 < t
    # n=3: masses 4:2, 5:1 -> c1-c2 = 1 < 0.5*3 = 1.5
    assert es.add("4", 1.0) is False
    # n=4: 4:3, 5:1 -> 2 >= 0.5*4 = 2 -> stop
    assert es.add("4", 1.0) is True and es.stopped_answer == "4"


def test_t3_switched_off_never_stops_and_logprob_rewards_weigh():
    off = EarlyStop(alpha=0.5, min_answers=1, enabled=False)
    assert not any(off.add("7", 1.0) for _ in range(10))
    es = EarlyStop(alpha=0.5, min_answers=2)
    es.add("a", 0.9)  # the logprob reward: exp of the mean token log-probability
    assert es.add("b", 0.1) is True  # 0.9 - 0.1 = 0.8 >= 0.5
    assert es.add(None, 1.0) is False and es.n == 2  # no answer: not counted


def test_t3_mass_never_falls_as_the_reward_rises():
    """A score of -0.1 weighed more than one of 0.5 (exp of a negative reward, a positive one as is): T3 stopped on
    the worse answer. A reward weighs its positive part; every built-in reward is >= 0 (the logprob reward is the
    exp of the mean token log-probability), so their masses are the rewards themselves."""
    es = EarlyStop(alpha=0.5, min_answers=2)
    assert [es.weight(r) for r in (-0.1, 0.0, 0.05, 0.5, 1.0, None, float("nan"))] == [0.0, 0.0, 0.05, 0.5, 1.0, 0, 0]
    es.add("bad", -0.1)
    assert es.add("good", 0.5) is True and es.stopped_answer == "good"
