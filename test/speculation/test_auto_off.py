"""Auto-off: a policy's speculation stops on an engine where, measured, it did not pay; probes keep measuring."""

from __future__ import annotations

import asyncio

import pytest
from speculation.test_payoff import REBASE, REBASE_KEY, _run
from speculation.test_spex_fake import JitterPort, make_spec, signature

from sglang_spex.config import SpexConfig
from sglang_spex.speculation.budget import make_budget
from sglang_spex.speculation.payoff import PROBE_EVERY, SEARCH_DECAY, Payoff, policy_key
from sglang_spex.speculation.settings import resolve
from sglang_spex.tot.search import run_search
from sglang_spex.tot.search_spec import SearchSpecError

LINE = (0.1, 0.01)  # a = 100 ms per step, b = 10 ms per sequence


def test_unknown_until_a_search_reported_and_the_curve_is_known():
    p = Payoff(prior_tokens=48.0)
    for _ in range(50):  # hits and misses measured mid-search do not decide: a miss is priced before a hit's saving
        p.record_miss(100)
    assert p.pays(LINE) is None
    p.record_search(saved_steps=0.0, wasted_tokens=500)
    assert p.pays(None) is None  # no step curve
    assert p.pays(LINE) is False


def test_pays_compares_steps_saved_with_tokens_wasted_on_the_curve():
    p = Payoff(prior_tokens=48.0)
    p.record_search(saved_steps=5.0, wasted_tokens=40)  # a·5 = 0.5 s vs b·40 = 0.4 s
    assert p.pays(LINE) is True
    assert p.pays(LINE, searches=2) is False  # a wasted token slows every search sharing the engine
    assert p.pays((0.1, 0.0)) is True  # a flat curve: waste is free


def test_recent_searches_weigh_more():
    p = Payoff(prior_tokens=48.0)
    p.record_search(saved_steps=0.0, wasted_tokens=400)
    assert p.pays(LINE) is False
    p.record_search(saved_steps=60.0, wasted_tokens=0)  # a probe that saved a lot: 0.1·60 >= 0.01·400·0.8
    assert p.pays(LINE) is True
    assert p.searches == pytest.approx(1 + SEARCH_DECAY)


def test_every_probe_every_th_draw_probes():
    p = Payoff(prior_tokens=8.0)
    draws = [p.draw_probe() for _ in range(3 * PROBE_EVERY)]
    assert [i for i, d in enumerate(draws) if d] == [PROBE_EVERY - 1, 2 * PROBE_EVERY - 1, 3 * PROBE_EVERY - 1]


def test_not_paying_switches_a_search_off_and_a_probe_measures_again():
    """With finished searches saying hits saved nothing, REBASE searches issue nothing (the baseline's tree), except
    every PROBE_EVERY-th, which speculates and reports."""
    cfg = SpexConfig(enabled=True, k_total=16, components=("t1", "t2"))
    base = asyncio.run(run_search(make_spec(REBASE), "What is 2 + 3?", JitterPort()))
    budget = make_budget(cfg)
    budget.payoff(None, REBASE_KEY, 8).record_search(saved_steps=0.0, wasted_tokens=200)
    runs = [_run(cfg, stalled=False, payoff_gate=False, auto_off=True, budget=budget)[0] for i in range(PROBE_EVERY)]
    for res in runs:
        assert signature(res) == signature(base)
    off, probe = runs[: PROBE_EVERY - 1], runs[-1]
    assert all(r.speculation["issued"] == 0 and r.speculation["switched_off"] == 1 for r in off)
    assert probe.speculation["probes"] == 1 and probe.speculation["switched_off"] == 0
    assert probe.speculation["issued"] > 0
    assert budget.payoff(None, REBASE_KEY, 8).searches == pytest.approx(1 + SEARCH_DECAY)  # the probe reported


def test_a_search_that_speculated_reports_what_it_saved_and_wasted():
    cfg = SpexConfig(enabled=True, k_total=16, components=("t1", "t2"))
    budget = make_budget(cfg)
    res = _run(cfg, stalled=False, payoff_gate=False, auto_off=True, budget=budget)[0]
    p = budget.payoff(None, REBASE_KEY, 8)
    assert res.speculation["issued"] > 0 and p.searches == 1.0
    assert p.search_saved == pytest.approx(res.speculation["saved_steps"])
    assert p.search_wasted >= res.speculation["wasted_tokens"] >= 0


def test_paying_or_disabled_keeps_speculating():
    cfg = SpexConfig(enabled=True, k_total=16, components=("t1", "t2"))
    budget = make_budget(cfg)
    budget.payoff(None, REBASE_KEY, 8).record_search(saved_steps=50.0, wasted_tokens=8)  # a·50 >> b·8
    paying = _run(cfg, stalled=False, payoff_gate=False, auto_off=True, budget=budget)[0]
    assert paying.speculation["issued"] > 0 and paying.speculation["switched_off"] == 0
    disabled = _run(cfg, stalled=True, payoff_gate=False, auto_off=False)[0]
    assert disabled.speculation["issued"] > 0 and disabled.speculation["switched_off"] == 0


def test_auto_off_override_is_checked():
    cfg = SpexConfig(enabled=True)
    assert resolve(cfg, {"auto_off": False}).auto_off is False
    with pytest.raises(SearchSpecError, match="speculation.auto_off"):
        resolve(cfg, {"auto_off": "no"})


def test_pools_are_per_policy_configuration():
    """REBASE at width 16 is not switched off by what REBASE at width 8 reported."""
    cfg = SpexConfig(enabled=True, k_total=16, components=("t1", "t2"))
    budget = make_budget(cfg)
    budget.payoff(None, REBASE_KEY, 8).record_search(saved_steps=0.0, wasted_tokens=200)
    wide = _run(cfg, stalled=False, payoff_gate=False, auto_off=True, budget=budget, policy={**REBASE, "width": 16})[0]
    assert wide.speculation["issued"] > 0 and wide.speculation["switched_off"] == 0
    assert policy_key("rebase", {"width": 16, "max_depth": 3}) != REBASE_KEY
