"""A speculative node whose reward fails ends without a result (``failed``): its store entry leaves, its slot is
free, and the search scores the node itself — the tree stays the baseline's (pure logic, fake engine). Before, the
failure raised ``KeyError`` in the speculative task (a speculative node has no MCTS statistic), its entry stayed
``running`` for the rest of the search, and the search adopted the failed node as a hit."""

from __future__ import annotations

import asyncio
from typing import List

import pytest
from speculation.test_spex_fake import POLICIES, JitterPort, make_spec, signature

from sglang_spex.config import SpexConfig
from sglang_spex.speculation.budget import make_budget
from sglang_spex.speculation.runner import SpexContext, context_factory
from sglang_spex.tot.policies.base import Stat
from sglang_spex.tot.rewards import Reward, VerifierReward
from sglang_spex.tot.search import run_search
from sglang_spex.tot.tree import CANCELLED, FAILED, Node, node_seed

QUESTION = "What is 2 + 3?"
CFG = SpexConfig(enabled=True, k_total=6, components=("t1", "t2"))


class FailingOn(Reward):
    """The arithmetic verifier, except that scoring a node whose path ends in ``.1`` raises (the same every time)."""

    def __init__(self) -> None:
        self.inner = VerifierReward("arith")
        self.scored: List[str] = []

    async def score(self, node, question, search_id=""):
        self.scored.append(node.path)
        if node.path.endswith(".1"):
            raise RuntimeError("reward service hiccup")
        return await self.inner.score(node, question, search_id)


def test_a_speculative_reward_failure_frees_the_entry_and_counts_failed():
    async def main():
        ctx = SpexContext(
            make_spec(POLICIES["rstar"]),
            QUESTION,
            JitterPort(),
            reward=FailingOn(),
            settings=CFG,
            budget=make_budget(CFG),
        )
        node = Node(path="r.1", parent=ctx.tree.root, seed=node_seed(3, "r.1"))
        pumped = []
        ctx.pump = lambda: pumped.append(1)  # the freed slot is refilled at once
        entry = ctx.store.issue(node, 1, ctx._generate_spec)
        await entry.task  # raised KeyError before
        await asyncio.sleep(0)
        return ctx, entry, node, pumped

    ctx, entry, node, pumped = asyncio.run(main())
    assert pumped
    assert node.status == CANCELLED and "reward" in node.error  # no result: the search generates it itself
    assert entry not in ctx.store.running() and "r.1" not in ctx.store  # its slot is free
    assert "r.1" in ctx.store.barred  # not speculated again: the search generates it itself
    assert ctx.acc.failed == 1 and ctx.acc.hits == 0


@pytest.mark.parametrize("policy", ["rstar", "rebase"])
def test_the_search_scores_a_node_whose_speculative_reward_failed_and_keeps_the_baseline_tree(policy):
    spec = make_spec(POLICIES[policy])
    base = asyncio.run(run_search(spec, QUESTION, JitterPort(), reward=FailingOn()))
    reward = FailingOn()
    res = asyncio.run(run_search(spec, QUESTION, JitterPort(), reward=reward, context_factory=context_factory(CFG)))
    acc = res.speculation
    assert signature(res) == signature(base)
    assert any(n["status"] == FAILED for n in res.nodes)  # the failure the baseline has is the search's own
    assert acc["failed"] >= 1
    assert acc["hits"] + acc["cancelled"] + acc["never_used"] + acc["failed"] == acc["issued"]
    failed_spec = [p for p in set(reward.scored) if p.endswith(".1") and reward.scored.count(p) == 2]
    assert failed_spec  # scored speculatively (failed), then by the search itself


def test_the_dfs_lookahead_reads_a_finished_primary_terminal_s_reward():
    """A rollout's end that the search generated itself (not yet backed up when the lookahead replays the rollout)
    is known with its reward; before, only speculative entries were, and the replay backed up 0 (a virtual loss
    that sent the next predicted rollout down the wrong branch)."""
    ctx = SpexContext(
        make_spec(POLICIES["rstar"]), QUESTION, JitterPort(), reward=FailingOn(), settings=CFG, budget=make_budget(CFG)
    )
    node = ctx.tree.child(ctx.tree.root, 0, "step")
    node.status, node.is_terminal, node.answer, node.reward = "done", True, "5", 0.8
    facts = ctx._facts(node.path)
    assert facts is not None and facts.terminal and not facts.failed and facts.reward == 0.8
    assert ctx._facts("r.1") is None  # nothing known yet


def test_a_reward_failure_while_the_search_waits_leaves_the_search_s_statistic_alone():
    """The search already waits on the speculative node (its statistic exists) when the node's reward fails: the
    failure is the speculative copy's, so the statistic is not marked failed; the search generates and scores the
    node itself and gets its reward (diff review: the statistic read failed until the node was regenerated)."""

    class FirstFails(Reward):
        def __init__(self) -> None:
            self.inner, self.calls = VerifierReward("arith"), 0

        async def score(self, node, question, search_id=""):
            self.calls += 1
            if self.calls == 1:
                await asyncio.sleep(0.05)
                raise RuntimeError("reward service hiccup")
            return await self.inner.score(node, question, search_id)

    async def main():
        spec = make_spec(POLICIES["rstar"])
        ctx = SpexContext(spec, QUESTION, JitterPort(), reward=FirstFails(), settings=CFG, budget=make_budget(CFG))
        node = Node(path="r.0", parent=ctx.tree.root, seed=node_seed(spec.seed, "r.0"))
        ctx.acc.on_issue(1, depth=1)
        entry = ctx.store.issue(node, 1, ctx._generate_spec)
        ctx.stats.setdefault("r.0", Stat("r.0", "r", 1))  # as the policy's expand makes it
        seen = []

        async def watch():
            await entry.task
            seen.append(ctx.stats["r.0"].failed)

        watcher = asyncio.ensure_future(watch())
        await asyncio.sleep(0.02)  # generated; its reward is being computed
        got = await ctx.generate_node(ctx.tree.root, 0)
        await watcher
        await ctx.finalize()
        return ctx, got, seen

    ctx, got, seen = asyncio.run(main())
    assert seen == [False]
    assert got.status == "done" and got.reward is not None and not ctx.stats["r.0"].failed
    assert ctx.acc.failed == 1 and ctx.acc.hits == 0


def test_an_unexpected_error_in_a_speculative_task_frees_its_slot():
    """Whatever raises inside a speculative task (a bug), its entry leaves the running set: a running entry holds a
    slot of the search's share until the search ends (the reward KeyError above did that)."""
    from sglang_spex.speculation.store import FAILED as ENTRY_FAILED
    from sglang_spex.speculation.store import SpecStore

    async def boom(node):
        raise ValueError("a bug")

    async def main():
        store = SpecStore()
        entry = store.issue(Node(path="r.0", parent=None, seed=1), 1, boom)
        await entry.task  # the error is handled (and logged), not left for "Task exception was never retrieved"
        return store, entry

    store, entry = asyncio.run(main())
    assert entry.state == ENTRY_FAILED and store.running() == []
