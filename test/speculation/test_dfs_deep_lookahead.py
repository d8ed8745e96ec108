"""T1 DFS past ``--tot-lookahead``: distances planned by their resolved hit rate, pooled per engine and policy."""

from __future__ import annotations

import asyncio

from test_spex_fake import JitterPort, make_spec, signature

from sglang_spex.config import SpexConfig
from sglang_spex.speculation.accounting import MIN_DEEP_HIT_RATE, DistanceRates
from sglang_spex.speculation.dfs_lookahead import DuePredictions, planned_distance
from sglang_spex.speculation.runner import context_factory
from sglang_spex.tot.search import run_search


def rates_of(table):
    return lambda d: table.get(d, (0.0, 0.0))


def test_planned_distance_grows_while_the_deepest_rate_holds():
    assert planned_distance(4, 16, rates_of({})) == 4  # nothing measured: the configured k
    assert planned_distance(4, 16, rates_of({4: (3, 4)})) == 8
    assert planned_distance(4, 16, rates_of({4: (3, 4), 8: (2, 2)})) == 16
    assert planned_distance(4, 12, rates_of({4: (3, 4), 8: (2, 2)})) == 12  # the cap
    assert planned_distance(4, 16, rates_of({4: (0, 4)})) == 4  # a poor rate at k: no deeper
    assert planned_distance(4, 16, rates_of({4: (1.2, 4)})) == 5  # borderline (0.3): one rollout at a time
    assert planned_distance(4, 16, rates_of({4: (3, 4)}), min_rate=0.8) == 4  # the live curve's floor
    assert planned_distance(4, 16, rates_of({4: (1, 1)})) == 4  # too few resolved to count


def test_planned_distance_stops_before_a_measured_poor_distance():
    table = {4: (4, 4), 8: (4, 4), 6: (0, 5)}
    assert planned_distance(4, 16, rates_of(table)) == 5
    assert MIN_DEEP_HIT_RATE > 0
    # a rate at k itself never cuts below k; a max below k keeps k
    assert planned_distance(4, 16, rates_of({3: (0, 9)})) == 4
    assert planned_distance(4, 2, rates_of({4: (4, 4)})) == 4


def test_a_late_adoption_turns_its_miss_into_a_hit():
    rates = DistanceRates(decay=1.0)
    dues = DuePredictions(lambda: rates)
    dues.issued("0.1.0", rollout=2, distance=3)
    dues.issued("0.1.1", rollout=2, distance=3)
    pending = {"0.1.0", "0.1.1"}
    dues.passed(2, pending.__contains__)  # rollout 2 is starting: not passed yet
    assert rates.resolved(3) == (0.0, 0.0)
    dues.passed(3, pending.__contains__)  # rollout 2 is over, neither was used
    assert rates.resolved(3) == (0.0, 2.0)
    dues.passed(4, pending.__contains__)  # counted once
    assert rates.resolved(3) == (0.0, 2.0)
    pending.discard("0.1.0")
    dues.adopted("0.1.0")  # a later rollout used it after all
    assert rates.resolved(3) == (1.0, 2.0)
    dues.adopted("0.1.0")  # not tracked any more: no second hit
    assert rates.resolved(3) == (1.0, 2.0)


def test_what_a_search_never_used_is_a_miss_when_it_ends():
    rates = DistanceRates(decay=1.0)
    dues = DuePredictions(lambda: rates)
    dues.issued("0.0", rollout=0, distance=1)
    dues.issued("0.1", rollout=0, distance=1)
    dues.issued("0.0.0", rollout=5, distance=4)  # its rollout never comes
    dues.passed(1, lambda path: path != "0.0")  # 0.1 missed its rollout; 0.0 was adopted meanwhile
    dues.ended()
    assert rates.resolved(1) == (0.0, 1.0) and rates.resolved(4) == (0.0, 1.0)
    dues.ended()  # once
    assert rates.resolved(1) == (0.0, 1.0) and rates.resolved(4) == (0.0, 1.0)


def test_an_adoption_in_time_is_a_hit():
    rates = DistanceRates(decay=1.0)
    dues = DuePredictions(lambda: rates)
    dues.issued("0.0", rollout=0, distance=1)
    dues.adopted("0.0")
    dues.passed(5, lambda path: True)
    assert rates.resolved(1) == (1.0, 1.0)


RSTAR = {"name": "rstar", "num_rollouts": 14, "max_depth": 4, "branch": 2}


def _distances(res):
    return {int(d) for d, v in res.speculation["hit_distance"].items() if v["issued"]}


def test_searches_on_one_engine_plan_deeper_once_their_hits_hold():
    """Searches share one budget (one engine): once predictions at k=2 are resolved as hits, later plans go past
    k; with the cap at k they never do; the tree is the baseline's either way (T3 off)."""
    spec = make_spec(RSTAR)
    port = lambda: JitterPort(answer_from_depth=9)  # noqa: E731 (no answers: every rollout runs)
    base = asyncio.run(run_search(spec, "q", port()))
    for cap, deeper in ((16, True), (2, False)):
        factory = context_factory(SpexConfig(enabled=True, k_total=8, lookahead=2, max_lookahead=cap, early_stop=False))
        runs = [asyncio.run(run_search(spec, "q", port(), context_factory=factory)) for _ in range(3)]
        assert all(signature(r) == signature(base) for r in runs)
        assert (max(_distances(runs[-1])) > 2) is deeper
        assert max(_distances(runs[-1])) > 4 or not deeper  # the pool carried over: the doubling went on
        pooled = next(iter(factory.keywords["budget"].payoffs.values())).distances
        assert pooled.resolved(1)[1] > 0  # predictions were resolved into the engine's pool


def test_plans_stop_at_the_last_rollout():
    spec = make_spec({"name": "rstar", "num_rollouts": 2, "max_depth": 4, "branch": 2})
    cfg = SpexConfig(enabled=True, k_total=8, lookahead=6, early_stop=False)
    res = asyncio.run(run_search(spec, "q", JitterPort(), context_factory=context_factory(cfg)))
    assert res.speculation["issued"] > 0
    assert max(_distances(res)) <= 2


def test_a_far_prediction_is_never_expected_above_a_near_one():
    """Pooled rates that read better far than near (noise, or a far distance with few samples) do not move a far
    candidate ahead of a near one: a prediction further ahead rests on the nearer ones."""
    from unit.fake_port import FakePort

    from sglang_spex.speculation.candidates import Candidate

    factory = context_factory(SpexConfig(enabled=True, k_total=8, components=("t1", "t2")))
    ctx = factory(make_spec(RSTAR), "q", FakePort())
    rates = ctx.payoff().distances
    for _ in range(40):
        rates.record_hit(3)
        rates.record_hit(1)
    for _ in range(20):
        rates.record_miss(1)
    uses = [ctx._expected_use(Candidate(ctx.tree.root, 0, d)) for d in (1, 2, 3)]
    assert uses[0] < 0.75 and uses == sorted(uses, reverse=True)
    assert rates.resolved(3)[0] / rates.resolved(3)[1] > uses[0]  # distance 3 alone would have read better


def test_sure_marks_predictions_measured_likely():
    """DFS: the pooled rate decides; the request says so to the scheduler (``custom_params["spex_sure"]``)."""
    from unit.fake_port import FakePort

    from sglang_spex.speculation.candidates import Candidate
    from sglang_spex.tot.engine import GenRequest

    ctx = context_factory(SpexConfig(enabled=True, k_total=8))(make_spec(RSTAR), "q", FakePort())
    rates = ctx.payoff().distances
    for _ in range(30):
        rates.record_hit(1)
        rates.record_hit(2)
        rates.record_miss(2)
    near, far = (Candidate(ctx.tree.root, 0, d) for d in (1, 2))
    sure = ctx.settings.sure_use
    assert ctx._measured_use(near, ctx._expected_use(near)) >= sure > ctx._measured_use(far, ctx._expected_use(far))
    req = GenRequest(prompt="p", rid="r", max_new_tokens=4, sure=True)
    assert req.sampling_params()["custom_params"]["spex_sure"] is True
    assert "spex_sure" not in GenRequest(prompt="p", rid="r", max_new_tokens=4).sampling_params()["custom_params"]
