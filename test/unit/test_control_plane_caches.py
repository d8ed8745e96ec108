"""The control plane's caches give the results of a computation from scratch, and follow every change of their
inputs: the live curve's medians, the prefill price's fit, the batch-stats writer's packed rows, the budget's
grouping of searches by rank (pure logic, no engine)."""

from __future__ import annotations

import asyncio
import math
import random
import statistics
from collections import deque
from typing import Optional

import numpy as np
import pytest

from sglang_spex.speculation.budget import QueryDemand, SpecBudget
from sglang_spex.srt import batch_stats as bs
from sglang_spex.srt.live_curve import LiveCurve, fit_line, median_se
from sglang_spex.srt.metrics import RankGauges
from sglang_spex.srt.prefill_allowance import PrefillPrice, fit_price, solve_price


# ---------------------------------------------------------------- live curve: medians kept per batch size
def _line_from_scratch(curve: LiveCurve):
    """The line as it was computed before the medians were kept: every median afresh, in sample order."""
    pts = [(b, statistics.median(q)) for b, q in curve.samples.items() if len(q) >= curve.min_samples]
    if len(pts) < 2:
        return None
    n = len(pts)
    mx, my = sum(b for b, _ in pts) / n, sum(t for _, t in pts) / n
    sxx = sum((b - mx) ** 2 for b, _ in pts)
    slope = sum((b - mx) * (t - my) for b, t in pts) / sxx if sxx > 0 else 0.0
    intercept = my - slope * mx
    return (intercept, max(slope, 0.0)) if intercept > 0 else None


def _fit_from_scratch(curve: LiveCurve):
    """The whole fit (line, knee, its quality) from every median and its error afresh."""
    pts = [(b, statistics.median(q), median_se(q)) for b, q in curve.samples.items() if len(q) >= curve.min_samples]
    return fit_line(pts)


def test_live_curve_fit_equals_a_fit_from_scratch_after_every_refit():
    rng = random.Random(3)
    curve = LiveCurve(window=8, min_samples=3, refit_every=5)
    knees = set()
    for i in range(600):
        batch = rng.choice([1, 2, 4, 8, 16, 32, 48, 64]) if i < 400 else rng.choice([2, 64])
        curve.add(batch, 0.004 + 0.0002 * batch + rng.random() * 0.001)
        if curve._adds % curve.refit_every == 0:
            fit = _fit_from_scratch(curve)
            assert curve._fit == fit and curve.line() == _line_from_scratch(curve)  # exactly, not approximately
            assert curve.knee() == (fit.knee if fit else None)
            knees.add(curve.knee())
    assert knees - {None}  # the clean, wide curve shows its knee


def test_live_curve_recomputes_the_median_of_a_batch_size_sampled_again():
    curve = LiveCurve(window=4, min_samples=2, refit_every=1)
    for t in (0.01, 0.01, 0.02, 0.02):
        curve.add(1, t)
        curve.add(10, 2 * t)
    before = curve.line()
    for _ in range(4):
        curve.add(10, 1.0)  # batch 10's window now holds only slow steps
    assert curve.line() != before and curve.line() == _line_from_scratch(curve)
    assert curve._fit == _fit_from_scratch(curve)


# ---------------------------------------------------------------- prefill price: fitted when asked, once per change
def _fit_by_generators(samples):
    se, se2 = sum(e for e, _ in samples), sum(e * e for e, _ in samples)
    return solve_price(len(samples), se, se2, sum(x for _, x in samples), sum(e * x for e, x in samples))


def test_fit_price_equals_the_sums_it_replaced_exactly():
    rng = random.Random(5)
    for _ in range(200):
        samples = deque((rng.randint(1, 500), rng.random() * 0.05) for _ in range(rng.randint(2, 32)))
        assert fit_price(samples) == _fit_by_generators(samples)


def test_prefill_price_follows_every_added_sample():
    price = PrefillPrice()
    line = (0.01, 0.001)
    assert price.price(line) == (0.0, 0.001)  # no fit yet: a prompt token priced like a decode row
    price.add(line, 4, 10, 0.01 + 0.004 + 0.02)
    price.add(line, 4, 100, 0.01 + 0.004 + 0.11)
    first = price.price(line)
    assert first == fit_price(price.samples) and first == pytest.approx((0.01, 0.001))
    assert price.price(None) == first  # asked again without a change: the same fit
    price.add(line, 4, 50, 0.01 + 0.004 + 0.5)
    assert price.price(line) == fit_price(price.samples) != first
    price.add(None, 4, 50, 1.0)  # not a sample: no decode line to measure the excess against
    assert len(price.samples) == 3


# ---------------------------------------------------------------- batch-stats writer: packed rows
@pytest.fixture
def writer(tmp_path):
    w = bs.StatsWriter(str(tmp_path / "ring"))
    yield w
    w.close()


def _counters(v: float):
    return {k: v for k in bs.COUNTERS if k not in ("last_step_s", "ema_step_s")}


def test_rows_and_counters_read_back_as_written(writer):
    rows = [{k: float(10 * i + j) for j, k in enumerate(bs.FIELDS) if k != "step_s"} for i in range(3)]
    rows[1]["decode_rows"] = None  # unknown: stored as NaN
    dones = [writer.write(r, _counters(float(i))) for i, r in enumerate(rows)]
    reader = bs.StatsReader(writer.path)
    hist = reader.history(0)["rows"]
    assert reader.seq == 3 and len(hist) == 3
    for i, (row, got) in enumerate(zip(rows, hist)):
        for k in bs.FIELDS:
            if k == "step_s":
                assert (got[k] is None) == (i == 2)  # the last row's step time is written with the next row
            else:
                assert got[k] == row[k]
    assert dones[0] is None
    assert {k: v for k, v in dones[2].items() if k != "step_s"} == {
        k: (float(rows[1][k]) if rows[1][k] is not None else dones[2][k]) for k in bs.DONE_FIELDS
    }
    assert math.isnan(dones[2]["decode_rows"]) and dones[2]["step_s"] == hist[1]["step_s"]
    counters = reader.counters()
    assert counters["preempt_for_primary"] == 2.0 and counters["last_step_s"] == hist[1]["step_s"]
    assert counters["ema_step_s"] == pytest.approx(0.9 * hist[0]["step_s"] + 0.1 * hist[1]["step_s"])


def test_write_values_is_write_of_the_same_row(writer, tmp_path):
    other = bs.StatsWriter(str(tmp_path / "ring2"))
    try:
        row = {k: float(j) for j, k in enumerate(bs.FIELDS)}
        row["step_s"] = math.nan
        for i in range(3):
            writer.write(row, _counters(float(i)))
            other.write_values([row[k] for k in bs.FIELDS], _counters(float(i)))
        timed = [bs.FIELDS.index("step_s")]  # step times differ between the two writers
        np.testing.assert_array_equal(np.delete(writer.ring[:3], timed, 1), np.delete(other.ring[:3], timed, 1))
        untimed = [i for i, k in enumerate(bs.COUNTERS) if k not in ("last_step_s", "ema_step_s")]
        np.testing.assert_array_equal(writer.counters[untimed], other.counters[untimed])
    finally:
        other.close()


def test_some_counters_leave_the_others_as_they_were(writer):
    writer.write({"batch_size": 1}, _counters(5.0))
    writer.write({"batch_size": 2}, {"protect_locks": 7})
    counters = bs.StatsReader(writer.path).counters()
    assert counters["protect_locks"] == 7.0 and counters["preempt_for_primary"] == 5.0


def test_rank_gauges_are_never_due_without_metrics(monkeypatch):
    monkeypatch.delenv("PROMETHEUS_MULTIPROC_DIR", raising=False)
    assert not RankGauges(None).due()


# ---------------------------------------------------------------- budget: searches grouped by rank across rounds
class Tracked:
    """A search that reports its rank changes (as ``SearchContext`` does)."""

    def __init__(self, qid: str, rank: Optional[int], inflight: int = 0):
        self.search_id, self.inflight, self.rank_watchers = qid, {f"{qid}-{i}" for i in range(inflight)}, []
        self.dp_rank = rank

    def move(self, rank: Optional[int]) -> None:
        self.dp_rank = rank
        for fn in list(self.rank_watchers):
            fn(self)

    def should_stop(self) -> bool:
        return False

    def demand(self) -> QueryDemand:
        return QueryDemand(self.search_id, 4)


class Plain(Tracked):
    """A search with a plain ``dp_rank`` attribute and no watchers (e.g. a test double)."""

    def __init__(self, qid: str, rank: Optional[int], inflight: int = 0):
        super().__init__(qid, rank, inflight)
        del self.rank_watchers


def _names(budget: SpecBudget, rank: Optional[int]):
    return sorted(c.search_id for c in budget.on_rank(rank))


def test_grouping_follows_register_unregister_and_rank_changes_outside_a_loop():
    budget = SpecBudget(8)
    a, b = Tracked("a", 0), Tracked("b", 1)
    budget.register(a)
    budget.register(b)
    assert _names(budget, 0) == ["a"] and _names(budget, 1) == ["b"]
    assert budget._groups is not None  # kept across calls
    b.move(0)
    assert _names(budget, 0) == ["a", "b"] and _names(budget, 1) == []
    c = Tracked("c", 1)
    budget.register(c)
    assert _names(budget, 1) == ["c"]
    budget.unregister(a)
    assert _names(budget, 0) == ["b"] and budget._rank_changed not in a.rank_watchers
    a.move(1)  # no longer registered: no regrouping asked for
    assert _names(budget, 1) == ["c"]


def test_a_search_without_watchers_is_grouped_afresh_every_time():
    budget = SpecBudget(8)
    p, t = Plain("p", 0), Tracked("t", 0)
    budget.register(p)
    budget.register(t)
    p.dp_rank = 1  # a plain attribute change, seen by the next grouping
    assert _names(budget, 0) == ["t"] and _names(budget, 1) == ["p"] and budget._groups is None
    budget.unregister(p)
    assert _names(budget, 0) == ["t"] and budget._groups is not None


def test_a_rank_change_within_a_round_is_seen_from_the_next_round():
    async def run():
        budget = SpecBudget(8)
        a, b = Tracked("a", 0, inflight=1), Tracked("b", 0, inflight=2)
        budget.register(a)
        budget.register(b)
        assert budget.available(0) == 8 - 3
        b.move(1)
        assert _names(budget, 0) == ["a", "b"] and budget.available(0) == 5  # the round keeps what it read
        await asyncio.sleep(0)
        assert _names(budget, 0) == ["a"] and _names(budget, 1) == ["b"]
        assert budget.available(0) == 7 and budget.available(1) == 6

    asyncio.run(run())


class Afresh(SpecBudget):
    """Groups the searches on every call (what the budget did outside an event loop before groups were kept)."""

    def on_rank(self, rank):
        self._groups = self._by_rank = None
        return super().on_rank(rank)


def test_shares_with_kept_groups_equal_shares_grouped_afresh():
    queries = [Tracked(f"q{i}", i % 2, inflight=i % 3) for i in range(6)]
    kept, afresh = SpecBudget(8, min_share=0), Afresh(8, min_share=0)
    for q in queries:
        kept.register(q)
        afresh.register(q)
    for rnd in range(4):
        assert [kept.share(q) for q in queries] == [afresh.share(q) for q in queries]
        queries[rnd].move(1 - queries[rnd].dp_rank)
