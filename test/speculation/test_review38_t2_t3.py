"""Review 38 (algorithm review, findings 4, 5 and 10's T2 underflow), pure logic, no engine:

- T3 tallies answer mass under the final vote's key (``tot.answers.normalize``): "1,000", "1000", "1000.0" are one
  answer, as in the vote, and ``stopped_answer`` is that answer as first spelled (what the vote reports).
- T2's minimum share is a floor (``max(min_share, softmax share)``, capped at C_q, water-filled), not an addition on
  top of a softmax split of the rest.
- T2's softmax is taken relative to the best score of the queries with work: an idle query with a higher score does
  not push every working query's weight to 0 at a small τ.
"""

from __future__ import annotations

import math
import random

import pytest

from sglang_spex.speculation import budget as bm
from sglang_spex.speculation.budget import QueryDemand, split_budget
from sglang_spex.speculation.early_stop import EarlyStop
from sglang_spex.tot.answers import Candidate, aggregate, normalize


# ------------------------------------------------------------------------------------------------ T3 (finding 4)
def test_t3_counts_the_spellings_of_one_answer_as_one():
    answers = ["1,000", "1000", "1000.0", "1000"]
    es = EarlyStop(alpha=0.5, min_answers=4)
    fired = [es.add(a, 1.0) for a in answers]
    assert fired == [False, False, False, True]  # as with one spelling: n = 4, c1 - c2 = 4 >= 0.5 * 4
    assert dict(es.mass) == {"1000": 4.0}  # keyed like the vote
    # the first spelling, which is what the vote over the same answers reports
    assert es.stopped_answer == "1,000" == aggregate([Candidate(a, "", 1.0) for a in answers], "weighted")


def test_t3_stops_on_the_answer_the_vote_picks_not_on_a_spelling_fragment():
    """Raw strings: "12" (mass 1.6) beat each of "7"/"7.0"/"07" (1.0 each), the margin rule fired (n = 5: 1.6 - 1.0
    >= 0.1 * 4.6) and T3 stopped on "12"; the vote, which counts the three 7s as one answer (3.0), says "7"."""
    seq = [("12", 0.8), ("7", 1.0), ("7.0", 1.0), ("07", 1.0), ("12", 0.8)]
    es = EarlyStop(alpha=0.1, min_answers=5)
    fired = [es.add(a, r) for a, r in seq]
    assert fired[-1] is True
    assert normalize(es.stopped_answer) == "7" and es.stopped_answer == "7"
    assert es.stopped_answer == aggregate([Candidate(a, "", r) for a, r in seq], "weighted")


# ------------------------------------------------------------------------------------------------ T2 (finding 5)
def test_min_share_is_a_floor_not_an_addition():
    d = [QueryDemand("A", 16, 0.9), QueryDemand("B", 16, 0.1)]
    # softmax(0.9, 0.1) * 8 = 5.52 / 2.48: both above the minimum 1, so the minimum changes nothing
    assert split_budget(d, 8, 1.0, min_share=1) == {"A": 6, "B": 2}  # was 1 + 4.52 / 1 + 2.48 -> 5 / 3
    assert split_budget(d, 8, 1.0, min_share=1) == split_budget(d, 8, 1.0, min_share=0)
    # a floor that binds takes only what the query lacks: 0.9/0.1 at τ = 0.2 -> softmax 7.85 / 0.15; B is raised to 2
    assert split_budget(d, 8, 0.2, min_share=2) == {"A": 6, "B": 2}
    d4 = [QueryDemand(q, 16, p) for q, p in zip("ABCD", (0.9, 0.2, 0.2, 0.2))]
    assert split_budget(d4, 8, 0.1, min_share=1) == {"A": 5, "B": 1, "C": 1, "D": 1}  # three floors bind


def test_min_share_floor_with_caps_water_fills():
    # C's cap (1) is below its softmax share: its excess is re-spread over A and B by weight; B's floor (3) binds
    d = [QueryDemand("A", 20, 0.9), QueryDemand("B", 20, 0.1), QueryDemand("C", 1, 0.9)]
    assert split_budget(d, 12, 0.2, min_share=3) == {"A": 8, "B": 3, "C": 1}


def test_short_budget_keeps_the_longest_waiting_then_best_scores_first():
    d = [QueryDemand(f"q{i}", 5, p) for i, p in enumerate((0.9, 0.5, 0.1, 0.3))]
    assert split_budget(d, 2, 1.0, min_share=1) == {"q0": 1, "q1": 1, "q2": 0, "q3": 0}
    waited = [0.0, 0.0, 3.0, 1.0]
    assert split_budget(d, 2, 1.0, min_share=1, waited=waited) == {"q0": 0, "q1": 0, "q2": 1, "q3": 1}


def _fill_by_bisection(w, f, c, total):
    """x_j = clamp(λ w_j, f_j, c_j) with Σ x = min(total, Σ c), λ by bisection (weights > 0)."""

    def filled(lam):
        return sum(min(cj, max(fj, lam * wj)) for wj, fj, cj in zip(w, f, c))

    target = min(total, sum(c))
    lo, hi = 0.0, 1.0
    while filled(hi) < target - 1e-12 and hi < 1e300:
        hi *= 2
    for _ in range(400):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if filled(mid) < target else (lo, mid)
    return [min(cj, max(fj, hi * wj)) for wj, fj, cj in zip(w, f, c)]


@pytest.mark.parametrize("seed", range(4))
def test_fill_is_the_clamped_softmax_water_fill(seed):
    rng = random.Random(seed)
    for _ in range(300):
        n = rng.randint(1, 12)
        w = [rng.choice([1.0, rng.random(), 10 ** -rng.uniform(0, 40)]) for _ in range(n)]
        c = [float(rng.randint(1, 9)) for _ in range(n)]
        f = [min(cj, float(rng.choice([0, 0, 1, 2]))) for cj in c]
        total = float(rng.randint(int(sum(f)), 40))
        got = bm._fill(w, f, c, total)
        assert math.isclose(sum(got), min(total, sum(c)), rel_tol=1e-9, abs_tol=1e-9)
        assert all(fj - 1e-9 <= x <= cj + 1e-9 for x, fj, cj in zip(got, f, c))
        want = _fill_by_bisection(w, f, c, total)
        assert all(math.isclose(x, y, rel_tol=1e-6, abs_tol=1e-6) for x, y in zip(got, want)), (w, f, c, total)


@pytest.mark.parametrize("seed", range(4))
def test_split_invariants_hold(seed):
    rng = random.Random(100 + seed)
    for _ in range(300):
        n = rng.randint(1, 20)
        d = [QueryDemand(f"q{i}", rng.randint(0, 6), rng.random()) for i in range(n)]
        k, m = rng.randint(1, 24), rng.choice([0, 1, 2])
        got = split_budget(d, k, rng.choice([0.05, 0.3, 1.0]), min_share=m)
        assert sum(got.values()) == min(k, sum(q.candidates for q in d))
        assert all(0 <= got[q.query_id] <= q.candidates for q in d)
        if sum(min(m, q.candidates) for q in d) <= k:  # every minimum fits: each query with work gets its own
            assert all(got[q.query_id] >= min(m, q.candidates) for q in d)


# ----------------------------------------------------------------------------------- T2 underflow (finding 10)
def test_an_idle_high_score_query_does_not_flatten_the_split():
    d = [QueryDemand("idle", 0, 0.9), QueryDemand("B", 8, 0.1), QueryDemand("C", 8, 0.2)]
    got = split_budget(d, 8, 1e-4, min_share=0)
    assert got == {"idle": 0, "B": 0, "C": 8}  # was 4 / 4: both weights exp(-8000), exp(-7000) underflowed to 0
    assert {q: got[q] for q in "BC"} == split_budget(d[1:], 8, 1e-4, min_share=0)


def test_fill_survives_a_weight_far_below_the_others():
    # a running slope of 1 + 1e-35 - 1 is 0 in floats: the tiny-weight query would be given its cap (50 of 10)
    assert bm._fill([1.0, 1e-35], [0.0, 0.0], [2.0, 50.0], 10.0) == pytest.approx([2.0, 8.0])
    assert bm._fill([1.0, 1e-35, 0.0], [0.0, 0.0, 1.0], [2.0, 3.0, 9.0], 10.0) == pytest.approx([2.0, 3.0, 5.0])


@pytest.mark.parametrize("tau", [1e-3, 1e-4])
def test_a_denormal_weight_never_breaks_the_budget(tau):
    """At a tiny τ a weight can be a denormal whose cap / weight overflows: the split still sums to
    min(k_total, Σ C_q) and keeps every cap (diff review: {'a': 1, 'b': 5} out of a budget of 3)."""
    d = [QueryDemand("a", 1, hit_rate=0.9), QueryDemand("b", 5, hit_rate=0.17)]
    assert split_budget(d, 3, temperature=0.001, min_share=1) == {"a": 1, "b": 2}
    assert sum(bm._fill([1.0, 1e-317], [0.0, 1.0], [2.0, 5.0], 4.0)) == pytest.approx(4.0)
    rng = random.Random(7)
    for _ in range(500):
        demands = [QueryDemand(str(i), rng.randint(1, 6), hit_rate=rng.random()) for i in range(rng.randint(2, 12))]
        k = rng.randint(1, 32)
        got = split_budget(demands, k, temperature=tau, min_share=rng.choice([0, 1]))
        assert sum(got.values()) == min(k, sum(q.candidates for q in demands))
        assert all(0 <= got[q.query_id] <= q.candidates for q in demands)
