"""Auto-off: a policy's speculation stops on an engine where, measured, it did not pay; probes keep measuring."""

from __future__ import annotations

import asyncio

import pytest
from speculation.test_payoff import REBASE, _run
from speculation.test_spex_fake import JitterPort, make_spec, signature

from sglang_spex.config import SpexConfig
from sglang_spex.speculation.budget import make_budget
from sglang_spex.speculation.payoff import MIN_EVIDENCE, PROBE_EVERY, Payoff
from sglang_spex.speculation.settings import resolve
from sglang_spex.tot.search import run_search
from sglang_spex.tot.search_spec import SearchSpecError

LINE = (0.1, 0.01)  # a = 100 ms per step, b = 10 ms per sequence


def _measure(p: Payoff, events: int, saved_per_hit: float, wasted_per_miss: int) -> None:
    for _ in range(events // 2):
        p.record_wave(saved_per_hit, 1)
        p.record_miss(wasted_per_miss)


def test_unknown_until_evidence_and_curve():
    p = Payoff(prior_tokens=48.0)
    assert p.pays(LINE) is None  # only the prior: nothing measured
    _measure(p, int(MIN_EVIDENCE) - 2, 0.0, 100)
    assert p.pays(LINE) is None  # below the evidence bar
    _measure(p, 4, 0.0, 100)
    assert p.pays(None) is None  # no step curve
    assert p.pays(LINE) is False


def test_pays_compares_steps_saved_with_tokens_wasted_on_the_curve():
    p = Payoff(prior_tokens=48.0)
    _measure(p, 20, saved_per_hit=5.0, wasted_per_miss=40)  # a·5 = 0.5 s vs b·40 = 0.4 s per pair
    saved, wasted, events = p.measured()
    assert saved / wasted == pytest.approx(5.0 / 40, rel=0.02) and events == pytest.approx(20, rel=0.1)
    assert p.pays(LINE) is True
    assert p.pays(LINE, searches=2) is False  # a wasted token slows every search sharing the engine
    assert p.pays((0.1, 0.0)) is True  # a flat curve: waste is free


def test_every_probe_every_th_draw_probes():
    p = Payoff(prior_tokens=8.0)
    draws = [p.draw_probe() for _ in range(3 * PROBE_EVERY)]
    assert [i for i, d in enumerate(draws) if d] == [PROBE_EVERY - 1, 2 * PROBE_EVERY - 1, 3 * PROBE_EVERY - 1]


def test_not_paying_switches_a_search_off_and_a_probe_measures_again():
    """With the pooled estimate saying hits save nothing, REBASE searches issue nothing (the baseline's tree), except
    every PROBE_EVERY-th, which speculates; its measurements move the pooled sums."""
    cfg = SpexConfig(enabled=True, k_total=16, components=("t1", "t2"))
    base = asyncio.run(run_search(make_spec(REBASE), "What is 2 + 3?", JitterPort()))
    budget = make_budget(cfg)
    runs = [_run(cfg, stalled=i == 0, payoff_gate=False, auto_off=True, budget=budget)[0] for i in range(PROBE_EVERY)]
    for res in runs:
        assert signature(res) == signature(base)
    off, probe = runs[: PROBE_EVERY - 1], runs[-1]
    assert all(r.speculation["issued"] == 0 and r.speculation["switched_off"] == 1 for r in off)
    assert probe.speculation["probes"] == 1 and probe.speculation["switched_off"] == 0
    assert probe.speculation["issued"] > 0


def test_paying_or_disabled_keeps_speculating():
    cfg = SpexConfig(enabled=True, k_total=16, components=("t1", "t2"))
    budget = make_budget(cfg)
    p = budget.payoff(None, "rebase", 8)
    _measure(p, 40, saved_per_hit=8.0, wasted_per_miss=8)  # a·8 >> b·8
    paying = _run(cfg, stalled=False, payoff_gate=False, auto_off=True, budget=budget)[0]
    assert paying.speculation["issued"] > 0 and paying.speculation["switched_off"] == 0
    disabled = _run(cfg, stalled=True, payoff_gate=False, auto_off=False)[0]
    assert disabled.speculation["issued"] > 0 and disabled.speculation["switched_off"] == 0


def test_auto_off_override_is_checked():
    cfg = SpexConfig(enabled=True)
    assert resolve(cfg, {"auto_off": False}).auto_off is False
    with pytest.raises(SearchSpecError, match="speculation.auto_off"):
        resolve(cfg, {"auto_off": "no"})
