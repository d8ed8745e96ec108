"""Baseline and SPEX on the simulator share every line of policy logic: same trees, same answers (T3 off)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from sglang_spex.config import SpexConfig
from sglang_spex.sim.run import compare, simulate
from sglang_spex.sim.workload import MixedWorkload, workload_for
from sglang_spex.tot.search_spec import PolicyConfig, SearchSpec


def _done_nodes(run):
    return [[(n["path"], n["text"], n["reward"]) for n in r.nodes if n["status"] == "done"] for r in run.results]


@pytest.mark.parametrize("policy,bs", [("rstar-5", 1), ("rebase-8", 2), ("rest-5", 1)])
def test_spex_equals_baseline_with_t3_off(policy, bs):
    spec = SearchSpec(policy=PolicyConfig(policy), seed=5)
    cfg = SpexConfig(enabled=True, k_total=None, early_stop=False)  # k_total from the simulated knee
    base, spex = compare(spec, cfg, cost=("A100-80G", "Llemma-7B"), questions=4, concurrency=bs)
    assert spex.answers == base.answers
    assert _done_nodes(spex) == _done_nodes(base)
    assert spex.engine["mean_batch"] > base.engine["mean_batch"]  # speculation filled the batch
    assert spex.virtual_time < base.virtual_time  # and, memory-bound at batch 1-2, that paid off


def _distance_counts(run):
    """{prediction distance: (hits, issued)} summed over the run's searches (JSON keys may be strings)."""
    out = {}
    for r in run.results:
        for d, c in (r.speculation or {}).get("hit_distance", {}).items():
            hits, issued = out.get(int(d), (0, 0))
            out[int(d)] = (hits + c["hits"], issued + c["issued"])
    return out


def test_bfs_speculates_below_the_undecided_depth_and_keeps_the_baseline_tree():
    spec = SearchSpec(policy=PolicyConfig("rebase-8"), seed=5)
    one_level = SpexConfig(enabled=True, k_total=None, early_stop=False, bfs_lookahead=1)
    base, shallow = compare(spec, one_level, cost=("A100-80G", "Llemma-7B"), questions=4, concurrency=1)
    _, deep = compare(spec, replace(one_level, bfs_lookahead=2), cost=("A100-80G", "Llemma-7B"), questions=4)
    assert set(_distance_counts(shallow)) == {1}
    hits, issued = _distance_counts(deep)[2]  # children of speculative nodes, before their depth was decided
    assert issued > 0 and hits > 0
    assert _done_nodes(deep) == _done_nodes(base) and deep.answers == base.answers


def test_bfs_keeps_speculating_three_depths_ahead_while_deep_nodes_hit():
    """Depth 3 ahead is planned while that distance's *resolved* hit rate holds: nodes still waiting for their
    depth's decision do not count as misses, so deep speculation is not switched off by its own lag."""
    spec = SearchSpec(policy=PolicyConfig("rebase-16"), seed=0)
    cfg = SpexConfig(enabled=True, k_total=None, early_stop=False, bfs_lookahead=3)
    base, deep = compare(spec, cfg, cost=("A100-80G", "Llemma-7B"), questions=4, concurrency=1)
    counts = _distance_counts(deep)
    assert counts[3][0] >= 10 and counts[2][0] >= 20, counts
    assert _done_nodes(deep) == _done_nodes(base) and deep.answers == base.answers


@pytest.mark.parametrize("components", [("t1",), ("t1", "t2")])
def test_spex_on_the_simulator_is_deterministic_and_runs_on_virtual_time(components):
    """The same SPEX run twice gives the same run: the budget splits over searches in registration order (T1's
    remainder once went by object address), and the runner's clocks (wave meter, hit spans, T2's wait, the
    share log) are the simulated one, not the host's."""
    spec = SearchSpec(policy=PolicyConfig("rstar-10"), seed=0)
    cfg = SpexConfig(enabled=True, k_total=16, components=components, early_stop=False)
    runs = [compare(spec, cfg, cost=("A100-80G", "Llemma-7B"), questions=8, concurrency=4)[1] for _ in range(3)]
    first = runs[0]
    for other in runs[1:]:
        assert other.virtual_time == first.virtual_time and other.engine == first.engine
        assert [r.speculation["issued"] for r in other.results] == [r.speculation["issued"] for r in first.results]
    shares = [t for r in first.results for t, _ in r.speculation["budget_shares"]]
    assert shares and max(shares) <= first.virtual_time and max(shares) > first.wall_time  # virtual seconds


def test_simulated_budget_reads_the_simulated_models_bytes():
    """T2's S_w and KV bytes come from the cost model's model, as a server's come from its model config (a 7B
    model's weights dwarf a branch's KV, so scores are close to P_q), not the unknown-model default of 1 byte."""
    from sglang_spex.sim.cost import RooflineCost
    from sglang_spex.sim.run import model_bytes_of, spex_factory
    from sglang_spex.speculation.budget import UNKNOWN_MODEL

    cost = RooflineCost("A100-80G", "Llemma-7B")
    got = model_bytes_of(cost)
    assert got.weight_bytes == pytest.approx(2 * 6.74e9, rel=0.05)
    assert got.kv_bytes_per_token == 2 * 32 * 32 * 128 * 2  # K and V, 32 layers x 32 heads x 128 dims, 2 bytes
    budget = spex_factory(SpexConfig(enabled=True, k_total=8), cost).keywords["budget"]
    assert budget.model == got and model_bytes_of(None) == UNKNOWN_MODEL


def test_a_mix_of_programs_shares_one_engine_and_one_budget():
    """Searches of two programs on one engine (``simulate`` with a spec per part): question i runs part i % 2 on
    that part's workload, SPEX's budget spans both, and pure scheduling still returns each baseline search."""
    specs = [SearchSpec(policy=PolicyConfig("rstar-5"), seed=3), SearchSpec(policy=PolicyConfig("rebase-8"), seed=3)]
    cfg = SpexConfig(enabled=True, k_total=16, components=("t1", "t2"), early_stop=False)
    base, spex = compare(specs, cfg, cost=("A100-80G", "Llemma-7B"), questions=6, concurrency=4)
    assert [r.policy for r in base.results] == [r.policy for r in spex.results] == ["rstar-5", "rebase-8"] * 3
    assert base.config["workload"]["mixed"][1]["lengths"] == "bfs" and len(base.config["spec"]) == 2
    alone = simulate(
        specs[1],
        cost=("A100-80G", "Llemma-7B"),
        questions=[(r.question, r.reference) for r in base.results[1::2]],
        workload=workload_for(["rstar-5", "rebase-8"], seed=3),
    )
    assert _done_nodes(alone) == _done_nodes(base)[1::2]  # a part's trees do not depend on what shares the engine
    assert _done_nodes(spex) == _done_nodes(base) and spex.answers == base.answers
    issued = {p: sum(r.speculation["issued"] for r in spex.results if r.policy == p) for p in ("rstar-5", "rebase-8")}
    assert min(issued.values()) > 0, issued  # both programs speculated from the one budget
    with pytest.raises(ValueError, match="MixedWorkload"):
        simulate(specs, cost=("A100-80G", "Llemma-7B"), questions=2, workload=workload_for("rstar-5"))
    mixed = workload_for(["rstar-5", "rebase-8"], seed=[3, 4])
    assert isinstance(mixed, MixedWorkload) and [p.seed for p in mixed.parts] == [3, 4]
    assert [p.params.lengths for p in mixed.parts] == ["dfs", "bfs"]
    with pytest.raises(ValueError, match="seed"):
        workload_for(["rstar-5", "rebase-8"], seed=[3])
