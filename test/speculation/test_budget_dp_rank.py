"""T2 per DP rank: searches pinned to rank r split rank r's budget against rank r's primary load (pure logic)."""

from __future__ import annotations

from typing import Dict, List, Optional

from sglang_spex.speculation.budget import QueryDemand, SpecBudget


class Query:
    def __init__(self, qid: str, rank: Optional[int], cands: int = 8, inflight: int = 0, hit_rate: float = 0.5):
        self.search_id, self.dp_rank, self.cands, self.hit_rate = qid, rank, cands, hit_rate
        self.inflight = {f"{qid}-p{i}" for i in range(inflight)}

    def should_stop(self) -> bool:
        return False

    def demand(self) -> QueryDemand:
        return QueryDemand(self.search_id, self.cands, self.hit_rate, 0.0, 1.0)


def _budget(queries: List[Query], load: Dict[Optional[int], int], k: int = 6) -> SpecBudget:
    calls: List[Optional[int]] = []

    def engine_primary(*rank: int) -> int:
        calls.append(rank[0] if rank else None)
        return load[rank[0] if rank else None]

    budget = SpecBudget(k, min_share=0, engine_primary=engine_primary)
    budget.calls = calls  # type: ignore[attr-defined]
    for q in queries:
        budget.register(q)
    return budget


def test_each_rank_splits_its_own_room_below_the_knee():
    a1, a2, b = Query("a1", 0, inflight=1), Query("a2", 0, inflight=1), Query("b", 1, inflight=1)
    budget = _budget([a1, a2, b], load={0: 6, 1: 2})  # rank 0 at the knee (6), rank 1 has 4 free
    assert budget.available(0) == 0 and budget.available(1) == 4
    assert budget.share(a1) == 0 and budget.share(a2) == 0  # rank 0 is compute-bound: nothing speculative
    assert budget.share(b) == 4  # rank 1's room is b's alone, not split with rank 0's searches
    assert set(budget.calls) == {0, 1}  # each rank's own engine load was read


def test_shares_of_a_rank_sum_to_its_budget_and_follow_its_load():
    qs = [Query("a1", 0, hit_rate=0.9), Query("a2", 0, hit_rate=0.2), Query("b1", 1), Query("b2", 1)]
    budget = _budget(qs, load={0: 1, 1: 3})
    shares = {q.search_id: budget.share(q) for q in qs}
    assert shares["a1"] + shares["a2"] == 5 and shares["a1"] > shares["a2"]
    assert shares["b1"] + shares["b2"] == 3


def test_one_rank_is_the_single_budget_of_before():
    qs = [Query("q1", None, inflight=2), Query("q2", None, inflight=1)]
    budget = _budget(qs, load={None: 2})  # the engine sees fewer primaries than the searches have in flight
    assert budget.available() == 6 - 3  # the searches' own in-flight primaries count
    assert sum(budget.share(q) for q in qs) == 3
    assert budget.calls and all(c is None for c in budget.calls)  # engine_primary() called without a rank
