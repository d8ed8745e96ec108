"""Prefix-aware refill: speculative candidates by expected use, then by the prefix the radix cache holds for them,
then by how recently their parent finished (pure logic on a SpexContext over an in-memory port)."""

from __future__ import annotations

import asyncio

from unit.fake_port import FakePort

from sglang_spex.config import SpexConfig
from sglang_spex.speculation.bfs_early import width_chances
from sglang_spex.speculation.budget import ModelBytes, SpecBudget
from sglang_spex.speculation.candidates import refill_key
from sglang_spex.speculation.runner import context_factory
from sglang_spex.tot.search_spec import SearchSpec
from sglang_spex.tot.tree import DONE

SPEC = SearchSpec.from_dict(
    {"policy": {"name": "rebase", "width": 4, "max_depth": 3}, "step": {"max_tokens": 8}, "reward": {"type": "logprob"}}
)


def make_ctx(budget=None):
    cfg = SpexConfig(enabled=True, k_total=8, components=("t1", "t2"))
    return context_factory(cfg, budget)(SPEC, "What is 2 + 3?", FakePort())


def finished(ctx, index, prompt_tokens=0, num_tokens=5, text="1 + 1 = 2.\n\n"):
    node = ctx.tree.child(ctx.tree.root, index)
    node.status, node.text, node.prompt_tokens, node.num_tokens, node.reward = (
        DONE,
        text,
        prompt_tokens,
        num_tokens,
        0.5,
    )
    return node


def plan(ctx, widths):
    ctx._bfs_targets = {path: width_chances(w) for path, w in widths.items()}
    ctx._version += 1
    return [(c.parent.path, c.index) for c in ctx._candidates(limit=16)]


def test_refill_key_orders_expected_use_then_distance_then_cache_then_recency():
    keys = {
        "likely_cold": refill_key(0.9, 1, 0, 1),
        "likely_cached": refill_key(0.9, 1, 40, 1),
        "likely_cached_recent": refill_key(0.9, 1, 40, 5),
        "likely_far_cached": refill_key(0.9, 3, 400, 9),
        "unlikely_cached": refill_key(0.2, 1, 400, 9),
    }
    assert sorted(keys, key=keys.get) == [
        "likely_cached_recent",
        "likely_cached",
        "likely_cold",
        "likely_far_cached",
        "unlikely_cached",
    ]


def test_cached_prefix_candidate_wins_when_otherwise_equal():
    async def go():
        ctx = make_ctx()
        try:
            cold = finished(ctx, 0)  # listed first by the plan; SGLang reported no tokens for it: not known cached
            warm = finished(ctx, 1, prompt_tokens=30)
            ctx._note_finished(warm)
            assert ctx.child_prefix(warm) == (35, 35) and ctx.child_prefix(cold)[1] == 0
            return plan(ctx, {cold.path: 1, warm.path: 1})
        finally:
            await ctx.close()

    assert asyncio.run(go()) == [("r.1", 0), ("r.0", 0)]


def test_most_recently_finished_parent_first_and_first_children_before_second():
    async def go():
        ctx = make_ctx()
        try:
            a, b = finished(ctx, 0, prompt_tokens=30), finished(ctx, 1, prompt_tokens=30)
            ctx._note_finished(a)
            ctx._note_finished(b)  # b finished last: its KV is the freshest in the radix cache
            return plan(ctx, {a.path: 2, b.path: 2})
        finally:
            await ctx.close()

    # expected use (w - i) / w: both first children (1.0) before both second children (0.5); b before a
    assert asyncio.run(go()) == [("r.1", 0), ("r.0", 0), ("r.1", 1), ("r.0", 1)]


def test_demand_reports_kv_bytes_from_the_model():
    async def go():
        ctx = make_ctx(SpecBudget(8, model=ModelBytes(weight_bytes=1e6, kv_bytes_per_token=100.0)))
        try:
            a = finished(ctx, 0, prompt_tokens=30, num_tokens=10)
            ctx._note_finished(a)
            ctx._bfs_targets = {a.path: width_chances(2)}
            ctx._version += 1
            return ctx.demand()
        finally:
            await ctx.close()

    d = asyncio.run(go())
    assert d.candidates == 2
    assert d.shared_kv == 40 * 100.0  # the parent's prompt + step, cached
    assert d.total_kv == (40 + 8) * 100.0  # plus one step of max_tokens
