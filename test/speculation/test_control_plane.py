"""The cheap control plane: DFS planning on a copy-on-read overlay, and the scheduler's live knee.

Pure logic (no engine): the overlay must give exactly the predictions of a planning run on a deep copy, leave
the search's statistics untouched, and copy only the nodes the simulated rollouts read.
"""

from __future__ import annotations

import asyncio
import random
import sys
from pathlib import Path

import pytest

from sglang_spex.speculation.budget import QueryDemand, SpecBudget
from sglang_spex.speculation.dfs_lookahead import NodeFacts, VirtualStats, predict_expansions
from sglang_spex.srt.live_curve import LiveCurve
from sglang_spex.tot.policies.base import Stats, copy_stats
from sglang_spex.tot.policies.rest import Rest, RestParams
from sglang_spex.tot.policies.rstar import RStar, RStarParams

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmark"))
from bench_control_plane import grown_tree  # noqa: E402


def random_tree(seed: int, nodes: int, branch: int, max_depth: int) -> Stats:
    """A searched-looking tree with some failed and terminal nodes (the benchmark's tree grower)."""
    return grown_tree(nodes, branch, max_depth, seed=seed, p_failed=0.05, p_terminal=0.1)


POLICIES = [
    RStar(RStarParams(branch=3, max_depth=6)),
    Rest(RestParams(branch=3, max_depth=6)),
]


def _deep_copy_reference(stats, root, policy, rngs, busy, lookup):
    """The planning run on a deep copy of the statistics (what the overlay replaces)."""
    return predict_expansions(copy_stats(stats), root, policy, rngs, busy, lookup=lookup)


@pytest.mark.parametrize("policy", POLICIES, ids=lambda p: p.name)
def test_overlay_plans_exactly_as_a_deep_copy_and_never_writes(policy):
    planned = 0
    for seed in range(8):
        stats = random_tree(seed, nodes=150, branch=3, max_depth=6)
        rng = random.Random(seed)
        leaves = [p for p, st in stats.items() if not st.expanded]
        busy = set(rng.sample(leaves, 3))
        facts = {f"{p}.0": NodeFacts(terminal=True, reward=0.7) for p in rng.sample(leaves, 4)}
        before = copy_stats(stats)
        got = predict_expansions(stats, "r", policy, [random.Random(i) for i in range(4)], busy, lookup=facts.get)
        ref = _deep_copy_reference(stats, "r", policy, [random.Random(i) for i in range(4)], busy, facts.get)
        assert got == ref, seed  # same expansions at the same distances
        assert stats == before, seed  # the search's statistics are never written
        planned += len(got)
    assert planned > 0  # not vacuous


def test_overlay_copies_only_what_the_rollouts_read():
    stats = random_tree(1, nodes=3000, branch=3, max_depth=9)
    policy = RStar(RStarParams(branch=3, max_depth=9))
    cp = VirtualStats(stats, lambda p: None, policy.branch, policy.max_depth)
    walk = policy.predict_rollout(cp, "r", random.Random(0))
    try:
        node = next(walk)
        while True:
            cp.virtual_expand(node)
            node = next(walk)
    except StopIteration:
        pass
    assert 0 < len(cp) < len(stats) // 10
    cp["r"].visits += 100  # a write lands in the overlay only
    assert stats["r"].visits != cp["r"].visits
    cp["r"].children.append("r.99")
    assert "r.99" not in stats["r"].children


def test_live_curve_flat_steps_show_no_knee():
    curve = LiveCurve(refit_every=1)
    for _ in range(8):
        for b in (1, 2, 4, 8, 16):
            curve.add(b, 0.010)
    assert curve.knee() is None


def test_live_curve_linear_steps_show_the_half_time_knee():
    curve = LiveCurve(refit_every=1)
    for _ in range(8):  # t = 10 ms + 2 ms per sequence: half the time scales with the batch at B = 5
        for b in (1, 2, 4, 8, 16):
            curve.add(b, 0.010 + 0.002 * b)
    assert curve.knee() == 5


def test_live_curve_knee_never_extrapolated_and_follows_the_window():
    curve = LiveCurve(refit_every=1)
    for _ in range(8):  # t = 10 ms + 0.1 ms per sequence: the knee (B = 100) lies far past the measured 1..8
        for b in (1, 2, 4, 8):
            curve.add(b, 0.010 + 0.0001 * b)
    assert curve.knee() is None
    for _ in range(curve.window):  # the engine slows down with the batch (say, another tenant): knee appears
        for b in (1, 2, 4, 8):
            curve.add(b, 0.010 + 0.005 * b)
    assert curve.knee() == 2
    for _ in range(curve.window):  # and goes again when the steps flatten out
        for b in (1, 2, 4, 8):
            curve.add(b, 0.010)
    assert curve.knee() is None


# ---------------------------------------------------------------- T2 refill cost: demands asked once per round
class CountingQuery:
    """A live search as the budget sees it, counting how often T2 asks for its demand."""

    def __init__(self, qid: str, hit_rate: float = 0.5, cands: int = 4):
        self.search_id, self.inflight = qid, set()
        self.hit_rate, self.cands, self.version, self.asked = hit_rate, cands, 0, 0

    def should_stop(self) -> bool:
        return False

    def demand_key(self):
        return (self.version,)

    def demand(self) -> QueryDemand:
        self.asked += 1
        return QueryDemand(self.search_id, self.cands, self.hit_rate, 0.0, 1.0)


def test_no_room_below_the_knee_asks_no_demand():
    budget = SpecBudget(4, engine_primary=lambda: 9)  # primary load above the knee: nothing to split
    queries = [CountingQuery(f"q{i}") for i in range(8)]
    for q in queries:
        budget.register(q)
    assert all(budget.share(q) == 0 for q in queries)
    assert sum(q.asked for q in queries) == 0


def test_one_split_per_event_loop_round_and_a_changed_demand_held_by_its_cap_splits_again():
    budget = SpecBudget(16, min_share=1, max_wait_s=1e9)
    queries = [CountingQuery(f"q{i}", hit_rate=0.1 + 0.1 * i, cands=1 if i == 0 else 8) for i in range(8)]
    for q in queries:
        budget.register(q)

    async def rounds():
        first = {q.search_id: [budget.share(q) for _ in range(3)] for q in queries}  # 24 refills in one round
        asked = [[q.asked for q in queries]]
        queries[1].version += 1  # q1's state changed, but its share was below its C_q: the round's split holds
        budget.share(queries[1])
        asked.append([q.asked for q in queries])
        queries[0].version += 1  # q0's share was its C_q (1): it may take more now, so the round splits again
        budget.share(queries[0])
        asked.append([q.asked for q in queries])
        await asyncio.sleep(0)  # next round
        await asyncio.sleep(0)
        budget.share(queries[1])
        asked.append([q.asked for q in queries])
        return first, asked

    first, asked = asyncio.run(rounds())
    assert all(len(set(v)) == 1 for v in first.values())  # one split answers every refill of the round
    shares = {k: v[0] for k, v in first.items()}
    assert sum(shares.values()) == 16 and shares["q0"] == 1 and all(s >= 1 for s in shares.values())
    assert asked[0] == [1] * 8  # each demand asked once in the round, not once per refill
    assert asked[1] == [1] * 8
    assert asked[2] == [2] * 8  # re-split (a SpexContext answers an unchanged demand from its cache)
    assert asked[3] == [3] * 8  # a new round splits again


class InflightCounting(CountingQuery):
    """... counting how often the budget reads its in-flight primaries (the room below the knee)."""

    def __init__(self, qid: str):
        super().__init__(qid)
        self.reads, self._inflight = 0, set()

    @property
    def inflight(self):
        self.reads += 1
        return self._inflight

    @inflight.setter
    def inflight(self, value):
        self._inflight = value


def test_the_room_below_the_knee_is_read_once_per_event_loop_round():
    budget = SpecBudget(4, engine_primary=lambda: 9)  # no room: every refill is refused
    queries = [InflightCounting(f"q{i}") for i in range(16)]
    for q in queries:
        budget.register(q)

    async def rounds():
        for _ in range(3):  # 3 refills per search per round
            for q in queries:
                assert budget.share(q) == 0
        reads = sum(q.reads for q in queries)
        await asyncio.sleep(0)
        await asyncio.sleep(0)
        budget.share(queries[0])  # a new round reads the room again
        return reads, sum(q.reads for q in queries)

    first, second = asyncio.run(rounds())
    assert first == 16  # once per search, not once per search per refill (48 refills)
    assert second == 32
