"""SPEX accounting keys hits and issued nodes by tree depth (Fig 14's BFS axis), in the search result itself."""

from __future__ import annotations

import asyncio
from collections import Counter

from test_spex_fake import POLICIES, JitterPort, make_spec

from sglang_spex.config import SpexConfig
from sglang_spex.speculation.accounting import SpecAccounting
from sglang_spex.speculation.runner import context_factory
from sglang_spex.tot.engine import ROLE_PRIMARY, ROLE_SPEC
from sglang_spex.tot.search import run_search


def test_depth_counter_by_hand():
    a = SpecAccounting()
    a.on_issue(1, depth=2)
    a.on_issue(1, depth=2)
    a.on_issue(2, depth=3)
    a.on_hit(1, depth=2)
    a.on_issue(1)  # depth not given: counted in the totals and by distance only
    b = SpecAccounting()
    b.on_issue(1, depth=3)
    b.on_hit(1, in_flight=True, depth=3)
    a.merge(b)
    d = a.to_dict()
    assert d["hit_depth"] == {"2": {"hits": 1, "issued": 2}, "3": {"hits": 1, "issued": 2}}
    assert d["hit_distance"] == {"1": {"hits": 2, "issued": 4}, "2": {"hits": 0, "issued": 1}}
    assert (d["issued"], d["hits"], d["in_flight_adopted"]) == (5, 2, 1)


def test_resolved_hit_rate_ignores_nodes_whose_fate_is_open():
    """A deep BFS node is adopted only two decisions after it was issued: until then it is neither hit nor miss, so
    a run of fresh issues must not read as a falling hit rate (that throttled lookahead > 1 to one depth)."""
    a = SpecAccounting()
    for _ in range(6):
        a.on_issue(2, depth=3)
    assert a.resolved(2) == (0, 0)
    a.on_miss(2)
    a.on_hit(2, depth=3)
    a.on_hit(2, depth=3)
    assert a.resolved(2) == (2, 3) and a.resolved(1) == (0, 0)
    b = SpecAccounting()
    b.on_miss(2)
    a.merge(b)
    assert a.resolved(2) == (2, 4) and a.to_dict()["missed_distance"] == {"2": 2}


class RoleDepthPort(JitterPort):
    """Counts requests by (role, node depth)."""

    def __init__(self) -> None:
        super().__init__()
        self.by: Counter = Counter()

    async def generate(self, req):
        self.by[(req.role, req.node_path.count("."))] += 1
        return await super().generate(req)


def test_depth_counter_matches_the_engine_requests():
    """rSTAR (no cancels): issued at depth d = speculative requests at depth d, and hits at depth d = the primary
    requests at depth d that SPEX saved over the baseline (T3 off: the same tree)."""
    spec = make_spec(POLICIES["rstar"])
    base_port, spex_port = RoleDepthPort(), RoleDepthPort()
    base = asyncio.run(run_search(spec, "q", base_port))
    cfg = SpexConfig(enabled=True, k_total=8, components=("t1", "t2"))
    res = asyncio.run(run_search(spec, "q", spex_port, context_factory=context_factory(cfg)))
    by_depth = res.speculation["hit_depth"]
    assert sum(v["hits"] for v in by_depth.values()) == res.speculation["hits"] > 0
    depths = {d for (_, d) in base_port.by} | {d for (_, d) in spex_port.by}
    for d in depths:
        got = by_depth.get(str(d), {"hits": 0, "issued": 0})
        assert got["issued"] == spex_port.by[(ROLE_SPEC, d)]
        saved = base_port.by[(ROLE_PRIMARY, d)] - spex_port.by[(ROLE_PRIMARY, d)]
        assert got["hits"] == saved
    assert base.speculation is None
