"""The pay-off pool is bounded: one entry per (DP rank, policy knobs, step tokens), and a client picks the knobs, so
150 searches with distinct float knobs made 150 entries that were never dropped (``GET /spex/stats`` reported them
all, on the event loop). Past ``PAYOFF_POOL_MAX`` the least recently used entries no live search uses are dropped;
``/spex/stats`` makes the pay-off rows in its worker thread (no server)."""

from __future__ import annotations

import asyncio
import threading
from types import SimpleNamespace

from fastapi import FastAPI
from fastapi.testclient import TestClient
from test_spex_fake import JitterPort, make_spec

from sglang_spex.config import SpexConfig
from sglang_spex.speculation.accounting import SpecAccounting
from sglang_spex.speculation.budget import PAYOFF_POOL_MAX, SpecBudget
from sglang_spex.speculation.payoff import SearchPayoff, policy_key, pool_report
from sglang_spex.speculation.runner import context_factory
from sglang_spex.srt import control, control_routes
from sglang_spex.srt.http_state import attach
from sglang_spex.tot.search import run_search


class _Search:
    """A live search as the budget sees it, with the pay-off view a ``SpexContext`` has (``pay``)."""

    def __init__(self, budget: SpecBudget, sid: str, policy: str, rank=None):
        self.search_id, self.inflight, self.dp_rank, self.rank_watchers = sid, set(), rank, []
        self.pay = SearchPayoff(budget, lambda: self.dp_rank, policy, 8, SpecAccounting(), gate=False, auto_off=True)

    def should_stop(self) -> bool:
        return False


def test_distinct_keys_past_the_cap_keep_the_pool_at_the_cap():
    budget = SpecBudget(8)
    for i in range(PAYOFF_POOL_MAX + 150):
        budget.payoff(None, policy_key("rebase", {"softmax_temperature": 0.2 + i * 1e-6}), 8)
    assert len(budget.payoffs) == PAYOFF_POOL_MAX  # old: 406
    newest = policy_key("rebase", {"softmax_temperature": 0.2 + (PAYOFF_POOL_MAX + 149) * 1e-6})
    assert (None, newest, 8) in budget.payoffs


def test_the_least_recently_used_entry_goes_first():
    budget = SpecBudget(8, max_payoffs=3)
    a = budget.payoff(None, "a", 8)
    budget.payoff(None, "b", 8)
    budget.payoff(None, "c", 8)
    assert budget.payoff(None, "a", 8) is a  # used again: now the most recent
    budget.payoff(None, "d", 8)
    assert [k[1] for k in budget.payoffs] == ["c", "a", "d"]  # b was the least recently used
    budget.payoff(0, "a", 8)  # another rank is another entry
    assert [k[:2] for k in budget.payoffs] == [(None, "a"), (None, "d"), (0, "a")]


def test_an_entry_a_live_search_uses_is_never_dropped():
    budget = SpecBudget(8)
    held = _Search(budget, "held", "rebase{}")
    budget.register(held)
    held.pay.pooled().record_miss(40)  # what it measured so far
    pooled = held.pay.pooled()
    for i in range(3 * PAYOFF_POOL_MAX):
        budget.payoff(None, f"other{i}", 8)
    assert len(budget.payoffs) == PAYOFF_POOL_MAX
    assert held.pay.pooled() is pooled and pooled.misses > 1  # kept, with its measurements
    held.dp_rank = 1  # re-pinned: it uses rank 1's entry now; rank None's may go
    held.pay.pooled().record_miss(40)
    for i in range(PAYOFF_POOL_MAX):
        budget.payoff(None, f"again{i}", 8)
    assert (None, "rebase{}", 8) not in budget.payoffs
    assert held.pay.pool_key() == (1, "rebase{}", 8) and held.pay.pooled().misses > 1
    budget.unregister(held)  # the search ended: its entry may go like any other
    for i in range(PAYOFF_POOL_MAX):
        budget.payoff(None, f"later{i}", 8)
    assert (1, "rebase{}", 8) not in budget.payoffs and len(budget.payoffs) == PAYOFF_POOL_MAX


def test_more_live_keys_than_the_cap_are_all_kept_until_their_searches_end():
    budget = SpecBudget(8, max_payoffs=2)
    searches = [_Search(budget, f"s{i}", f"p{i}") for i in range(4)]
    for s in searches:
        budget.register(s)
        s.pay.pooled()
    assert len(budget.payoffs) == 4
    for s in searches:
        budget.unregister(s)
    budget.payoff(None, "next", 8)
    assert [k[1] for k in budget.payoffs] == ["p3", "next"]


def test_real_searches_with_distinct_knobs_leave_a_bounded_pool():
    budget = SpecBudget(8, max_payoffs=2)
    factory = context_factory(SpexConfig(enabled=True, k_total=8, early_stop=False), budget=budget)
    for t in (0.2, 0.21, 0.22, 0.23):
        spec = make_spec({"name": "rebase", "width": 2, "max_depth": 2, "softmax_temperature": t})
        asyncio.run(run_search(spec, "What is 2 + 3?", JitterPort(), context_factory=factory))
    knobs = [{"max_depth": 2, "softmax_temperature": t, "width": 2} for t in (0.22, 0.23)]
    assert list(budget.payoffs) == [(None, policy_key("rebase", k), 8) for k in knobs]  # old: all four


def test_the_stats_rows_are_made_off_the_event_loop(monkeypatch, tmp_path):
    budget = SpecBudget(8)
    budget.step_cost = lambda rank=None: (0.02, 0.001)
    for i, rank in enumerate((None, 1, None)):
        budget.payoff(rank, f"policy{i}", 8).record_search(3.0, 10.0)
    rows = pool_report(budget.payoff_snapshot())
    assert [(r["rank"], r["policy"], r["steps_saved"], r["tokens_wasted"]) for r in rows] == [
        (1, "policy1", 3.0, 10.0),
        (None, "policy0", 3.0, 10.0),
        (None, "policy2", 3.0, 10.0),
    ]  # sorted by str(key)

    threads = {"loop": set(), "rows": set()}

    async def states(tm):
        threads["loop"].add(threading.get_ident())
        return [{"dp_rank": None}]

    def rows(snap):
        threads["rows"].add(threading.get_ident())
        return pool_report(snap)

    monkeypatch.setattr(control, "scheduler_states", states)
    monkeypatch.setattr(control_routes, "pool_report", rows)
    monkeypatch.setattr(control_routes.batch_stats, "stats_channel", lambda: str(tmp_path / "none"))
    app = FastAPI()
    state = SimpleNamespace(cfg=SpexConfig(enabled=True), tokenizer_manager=None,
                            profile=SimpleNamespace(status=lambda: {"measuring": False}),
                            searches=SimpleNamespace(spex=SimpleNamespace(budget=budget)))  # fmt: skip
    attach(app, state)
    control_routes.install(app)
    with TestClient(app) as c:
        out = c.get("/spex/stats").json()
    assert [row["policy"] for row in out["payoff"]] == ["policy1", "policy0", "policy2"]  # sorted by str(key)
    assert out["payoff"][0]["steps_saved"] == 3.0 and out["payoff"][0]["pays"] is True
    assert threads["loop"] and threads["rows"] and not threads["loop"] & threads["rows"]
