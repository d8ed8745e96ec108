"""REST-MCTS*'s end gate as the reference's (ReST-MCTS ``isTerminal``: V >= end_gate): only a node at the gate is a
solution that ends the search; an end below it (an answer the value model scores low) is backed up and the search
goes on; a child that reached the gate still gets its partial rollout, which can pull it back below (pure logic)."""

from __future__ import annotations

import asyncio
import random
from typing import Dict, Optional, Tuple

from sglang_spex.tot.policies.base import Stat
from sglang_spex.tot.policies.rest import Rest, RestParams
from sglang_spex.tot.tree import DONE, KIND_STEP, Tree

ROLLOUT_VALUE = 0.5


class Host:
    """A search host whose depth-1 steps have the given (reward, answer); every other node is worth 0.5."""

    def __init__(self, policy: Rest, steps: Dict[str, Tuple[float, Optional[str]]]):
        self.policy, self.steps, self.tree = policy, steps, Tree(0)
        self.stats = {"r": Stat("r", None, 0)}
        self.iterations = 0

    async def generate_node(self, parent, index, kind=KIND_STEP):
        n = self.tree.child(parent, index, kind)
        n.reward, n.answer = self.steps.get(n.path, (ROLLOUT_VALUE, None))
        n.status, n.is_terminal = DONE, n.answer is not None
        if kind == KIND_STEP:
            self.policy.update_stat(self.stats[n.path], n)
        return n

    async def expand(self, parent, n, kind=KIND_STEP):
        start = len(parent.children)
        for i in range(n):
            c = self.tree.child(parent, start + i, kind)
            self.stats.setdefault(c.path, Stat(c.path, parent.path, c.depth))
            self.stats[parent.path].children.append(c.path)
        out = [await self.generate_node(parent, start + i, kind) for i in range(n)]
        self.stats[parent.path].expanded = True
        return out

    def should_stop(self) -> bool:
        return False

    def rng(self, label):
        return random.Random(label)

    def on_rollout(self, i: int) -> None:
        self.iterations = i + 1

    def sync_stats(self) -> None:
        pass


def _run(steps, iterations: int = 20) -> Host:
    policy = Rest(RestParams(iterations=iterations, max_depth=4))
    host = Host(policy, steps)
    asyncio.run(policy.run(host))
    return host


def test_an_answer_below_the_end_gate_is_backed_up_and_the_search_goes_on():
    host = _run({"r.0": (0.30, None), "r.1": (0.35, None), "r.2": (0.40, "42")})
    assert host.iterations == 20  # before: the search ended once UCT selected r.2 (its 4th iteration)
    assert host.stats["r.2"].terminal and host.stats["r.2"].visits > 1  # never expanded, backed up each time
    assert not host.tree.get("r.2").children


def test_an_answer_at_the_end_gate_ends_the_search():
    host = _run({"r.0": (0.30, None), "r.1": (0.35, None), "r.2": (0.95, "42")})
    assert host.iterations < 20 and host.stats["r.2"].terminal


def test_a_child_at_the_end_gate_still_gets_its_partial_rollout():
    host = _run({"r.0": (0.95, None), "r.1": (0.35, None), "r.2": (0.40, None)}, iterations=1)
    assert host.tree.get("r.0").rollouts  # before: skipped, so V stayed 0.95 and the next selection ended the search
    assert host.stats["r.0"].value == 0.95 * 0.5 + ROLLOUT_VALUE * 0.5


def test_spex_speculates_the_rollout_below_a_child_at_the_end_gate():
    """SPEX's REST rollout candidates follow the same rule: the best child past end_gate gets its rollout."""
    from sglang_spex.speculation.rest_rollouts import rollout_candidates

    tree = Tree(0)
    kids = [tree.child(tree.root, i, KIND_STEP) for i in range(2)]
    for n, reward in zip(kids, (0.95, 0.3)):
        n.status, n.reward = DONE, reward
    by_path = {n.path: n for n in kids}
    params = RestParams(roll_forward_steps=1, roll_branch=1)
    found = list(rollout_candidates(params, list(by_path), by_path.get, lambda path: False))
    assert [(c.parent.path, c.kind) for c in found] == [("r.0", "rollout")]


def test_a_tree_of_ends_below_the_gate_stops_the_search_instead_of_spinning():
    """Every reachable node an end below the gate (here: each depth-1 step answers): the search stops once
    selection can reach nothing to expand, instead of backing the ends up for every remaining iteration."""
    host = _run({"r.0": (0.30, "1"), "r.1": (0.35, "2"), "r.2": (0.40, "3")}, iterations=1000)
    assert host.iterations < 10 and all(host.stats[f"r.{i}"].terminal for i in range(3))


def test_a_search_whose_root_children_all_failed_stops():
    class Failing(Host):
        async def generate_node(self, parent, index, kind=KIND_STEP):
            n = self.tree.child(parent, index, kind)
            n.status, n.reward = "failed", None
            self.policy.update_stat(self.stats[n.path], n)
            return n

    policy = Rest(RestParams(iterations=1000))
    host = Failing(policy, {})
    asyncio.run(policy.run(host))
    assert host.iterations < 5
