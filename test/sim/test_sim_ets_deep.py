"""ETS on the simulator: SPEX speculates below the undecided depth (its ILP runs per depth and world, in a
thread) and still returns the baseline's tree."""

from __future__ import annotations

from sglang_spex.config import SpexConfig
from sglang_spex.sim.run import compare
from sglang_spex.tot.search_spec import PolicyConfig, SearchSpec


def test_ets_speculates_two_depths_ahead_and_keeps_the_baseline_tree():
    spec = SearchSpec(policy=PolicyConfig("ets-8", {"embedder": "tfidf"}), seed=5)
    cfg = SpexConfig(enabled=True, k_total=None, early_stop=False, bfs_lookahead=2)
    base, spex = compare(spec, cfg, cost=("A100-80G", "Llemma-7B"), questions=2, concurrency=1)
    done = lambda run: [
        [(n["path"], n["text"]) for n in r.nodes if n["status"] == "done"] for r in run.results
    ]  # noqa: E731
    assert done(spex) == done(base) and spex.answers == base.answers
    deep = [r.speculation["hit_distance"].get("2") or r.speculation["hit_distance"].get(2) for r in spex.results]
    assert sum(d["hits"] for d in deep if d) > 0  # children of speculative children were adopted
