"""The pay-off gate (speculation/payoff.py): its estimate by hand, the wave measurement, and the runner issuing only
candidates whose expected use pays on the step curve (the same tree either way)."""

from __future__ import annotations

import asyncio

import pytest
from speculation.test_spex_fake import JitterPort, make_spec, signature

from sglang_spex.config import SpexConfig
from sglang_spex.speculation.budget import make_budget
from sglang_spex.speculation.payoff import (
    Payoff,
    SearchPayoff,
    WaveMeter,
    policy_key,
    remaining_tokens,
    truncate_at,
    wasted_tokens,
)
from sglang_spex.speculation.runner import context_factory
from sglang_spex.srt.live_curve import LiveCurve
from sglang_spex.tot.search import run_search

REBASE = {"name": "rebase", "width": 8, "max_depth": 3}
REBASE_KEY = policy_key("rebase", {"width": 8, "max_depth": 3})  # its pay-off pool's key


def test_min_use_hand_computed():
    p = Payoff(prior_tokens=10.0, decay=1.0)  # the prior: one hit that saved 10 steps, one miss that wasted 10
    p.record_wave(saved_steps=4.0, hits=2)
    p.record_miss(30)
    assert p.saved_per_hit() == pytest.approx((10 + 4) / (1 + 2))  # 4.67
    assert p.wasted_per_miss() == pytest.approx((10 + 30) / (1 + 1))  # 20
    r = 0.01 * 20 / (0.1 * 14 / 3)  # b · wasted per miss / (a · saved per hit)
    assert p.min_use(a=0.1, b=0.01) == pytest.approx(r / (1 + r))  # 0.3
    assert p.min_use(a=0.1, b=0.0) == 0.0  # a flat curve: speculation rides steps that cost the same


def test_the_prior_ages_like_the_measurements():
    p = Payoff(prior_tokens=48.0)
    assert p.min_use(0.1, 0.01) == pytest.approx(0.1 / 1.1)  # no data: one saved step is worth ten wasted tokens
    for _ in range(1000):
        p.record_wave(saved_steps=0.0, hits=1)
    assert p.saved_per_hit() < 0.1  # the prior is forgotten: hits that saved nothing are worth nothing
    assert p.min_use(0.1, 0.01) > 0.99


def test_measured_saved_per_hit_leaves_the_prior_out():
    p = Payoff(prior_tokens=48.0, decay=0.9)
    assert p.measured_saved_per_hit() == 0.0  # nothing measured: a speculative request claims no worth yet
    p.record_miss(10)
    assert p.measured_saved_per_hit() == 0.0
    p.record_wave(saved_steps=6.0, hits=2)
    p.record_wave(saved_steps=0.0, hits=1)
    assert p.measured_saved_per_hit() == pytest.approx(6.0 * 0.9 / (2 * 0.9 + 1))  # aged like every measurement
    assert p.saved_per_hit() > p.measured_saved_per_hit()  # the prior (48 steps a hit) is in the other one


def test_min_use_rises_as_hits_stop_saving_steps_and_falls_when_they_save_again():
    p = Payoff(prior_tokens=48.0)
    start = p.min_use(0.09, 0.013)
    for _ in range(300):
        p.record_wave(saved_steps=0.0, hits=4)  # hits that take nothing off the critical path
        p.record_miss(40)
    stalled = p.min_use(0.09, 0.013)
    assert stalled > 0.75 and start < 0.15  # b/a = 0.14: one wasted token costs 0.14 of a step
    for _ in range(300):
        p.record_wave(saved_steps=48.0, hits=1)
    assert p.min_use(0.09, 0.013) < stalled / 2


def test_remaining_tokens_of_a_node():
    assert remaining_tokens(40, requested_at=5.0, span=None) == 40  # generated on request
    assert remaining_tokens(40, requested_at=5.0, span=(1.0, 4.0)) == 0  # a hit done before the request
    assert remaining_tokens(40, requested_at=2.0, span=(1.0, 4.0)) == pytest.approx(40 * 2 / 3)  # in flight


def test_truncate_at():
    assert truncate_at([1.0, 0.75, 0.5, 0.25], 0.5) == 3
    assert truncate_at([1.0, 0.75], 0.0) == 2
    assert truncate_at([0.4], 0.5) == 0


def test_wave_saved_steps_are_the_critical_path_difference():
    waves = []

    async def node(meter, length, span):
        wave = meter.ask()
        await asyncio.sleep(0)
        meter.resolved(wave, length, span, ok=True)

    async def main():
        meter = WaveMeter(lambda saved, hits: waves.append((saved, hits)), clock=lambda: 10.0)
        # one expansion: a hit of 10 tokens done before the request, nodes of 6 and 8 generated on request
        await asyncio.gather(node(meter, 10, (1.0, 2.0)), node(meter, 6, None), node(meter, 8, None))
        # every node a finished hit: the whole wave is saved
        await asyncio.gather(node(meter, 5, (1.0, 2.0)), node(meter, 9, (1.0, 3.0)))
        # no hit: nothing to report
        await asyncio.gather(node(meter, 7, None), node(meter, 3, None))
        return meter

    meter = asyncio.run(main())
    assert waves == [(2.0, 1), (9.0, 2)]
    assert meter.saved == 11.0 and meter.waves == 2


def test_live_curve_reports_its_line():
    curve = LiveCurve(refit_every=1)
    assert curve.line() is None
    for _ in range(8):
        for b in (1, 2, 4, 8):
            curve.add(b, 0.010 + 0.002 * b)
    a, b = curve.line()
    assert a == pytest.approx(0.010) and b == pytest.approx(0.002)


def _run(cfg: SpexConfig, stalled: bool, payoff_gate: bool = True, auto_off: bool = False, budget=None, policy=None):
    """A REBASE search under SPEX with a steep step curve; ``stalled``: the pooled estimate says hits saved no
    steps (so only near-certain candidates pay)."""
    budget = budget or make_budget(cfg)
    budget.step_cost = lambda *rank: (0.09, 0.013)
    spec = make_spec(policy or REBASE, speculation={"payoff_gate": payoff_gate, "auto_off": auto_off})
    if stalled:
        p = budget.payoff(None, REBASE_KEY, spec.step.max_tokens)
        for _ in range(40):
            p.record_wave(0.0, 4)
            p.record_miss(8)
    floors = []
    orig = SearchPayoff.min_use

    def spy(self):
        floors.append(orig(self))
        return floors[-1]

    SearchPayoff.min_use = spy
    try:
        res = asyncio.run(
            run_search(spec, "What is 2 + 3?", JitterPort(), context_factory=context_factory(cfg, budget))
        )
    finally:
        SearchPayoff.min_use = orig
    return res, floors


def test_gate_issues_only_what_pays_and_keeps_the_baseline_tree():
    cfg = SpexConfig(enabled=True, k_total=16, components=("t1", "t2"))
    base = asyncio.run(run_search(make_spec(REBASE), "What is 2 + 3?", JitterPort()))
    open_res, open_floors = _run(cfg, stalled=False, payoff_gate=False)
    gated, floors = _run(cfg, stalled=True)
    assert signature(open_res) == signature(base) == signature(gated)
    assert max(open_floors) == 0.0
    assert min(floors) > 0.75 and gated.speculation["min_use"] > 0.75
    assert 0 < gated.speculation["issued"] < open_res.speculation["issued"]
    assert gated.speculation["cancelled"] + gated.speculation["never_used"] <= 1  # near-certain work only


def test_the_bar_rises_with_the_searches_sharing_the_engine():
    p = Payoff(prior_tokens=48.0)
    one, four = p.min_use(0.1, 0.01), p.min_use(0.1, 0.01, searches=4)
    assert one == pytest.approx(0.1 / 1.1) and four == pytest.approx(0.4 / 1.4)


def test_a_miss_wastes_its_uncached_prefill_too():
    assert wasted_tokens(decoded=5, prompt_tokens=120, cached_tokens=70) == 55
    assert wasted_tokens(decoded=0, prompt_tokens=120, cached_tokens=0) == 0  # aborted before its prefill ran
