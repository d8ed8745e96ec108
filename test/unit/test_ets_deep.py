"""ETS (a frontier rule that runs a solver) is predicted like REBASE: several worlds and depths, one solve per
distinct depth's candidates within one prediction."""

from __future__ import annotations

import random
from typing import List

import pytest

from sglang_spex.speculation.bfs_early import drawn_from_parents, planned_levels, shared_keep, use_chances
from sglang_spex.tot.policies.ets import ilp_select, ilp_select_exact, outcome_scores
from sglang_spex.tot.policies.rebase import Rebase, RebaseParams
from sglang_spex.tot.tree import DONE, GENERATING, Node, Tree


class DropLow(Rebase):
    """A REBASE whose frontier rule drops every candidate scored below 0.5, counting its solves."""

    def __init__(self, params: RebaseParams):
        super().__init__(params)
        self.solves = 0

    def predict_keep(self, cands, width) -> List[bool]:
        self.solves += 1
        return [self.score(n) >= 0.5 for n in cands]


def _children(parent: Node, *rewards) -> List[Node]:
    out = []
    for i, r in enumerate(rewards):
        node = Node(path=f"{parent.path}.{i}", parent=parent)
        node.status, node.reward = (GENERATING, None) if r is None else (DONE, r)
        out.append(node)
    return out


def test_shared_keep_solves_once_per_candidate_set_and_width():
    policy = DropLow(RebaseParams(width=4))
    nodes = _children(Tree(0).root, 0.9, 0.3)
    keep = shared_keep(policy)
    assert keep(nodes, 4) == [True, False] and keep(list(nodes), 4) == [True, False]
    assert policy.solves == 1
    keep(nodes, 3)  # another width: another solve
    keep(nodes[:1], 4)  # another candidate set
    assert policy.solves == 3
    assert shared_keep(Rebase(RebaseParams(width=4))) is None  # no rule of its own: nothing to memoise


def test_a_keep_rule_policy_is_planned_below_the_undecided_depth():
    policy = DropLow(RebaseParams(width=8, softmax_temperature=1.0))
    r0, r1, r2 = _children(Tree(0).root, 0.9, 0.3, None)  # r.1 is dropped by the rule in every world
    below = {"r.0": _children(r0, 0.8), "r.1": _children(r1, 0.99)}
    got = use_chances(policy, [r0, r1, r2], below, 8, levels=2, worlds=8, seed="q")
    assert "r.1" not in got and "r.1.0" not in got  # nothing under a node the rule drops
    assert got["r.0"][0] == 1.0 and got["r.0.0"][0] > 0  # the child of a speculative child is planned
    # depth 1 is the same candidate set in every world; depth 2 too (r.0.0 alone): 2 solves for 8 worlds
    assert policy.solves == 2


def test_planned_levels_stop_at_the_first_distance_whose_hit_rate_is_below_the_floor():
    rates = {2: 0.5, 3: 0.1, 4: 0.9}
    assert planned_levels(4, rates.get) == 2  # distance 3 fails, so 4 is not planned either
    assert planned_levels(1, rates.get) == 1
    assert planned_levels(2, {2: 0.2}.get) == 1


def test_exact_ilp_finds_cbcs_optimum_and_breaks_ties_by_preference():
    def objective(keep, outcome, ancestors, clusters):
        chosen = {i for i, k in enumerate(keep) if k}
        branches = {a for i in chosen for a in ancestors[i]}
        cost = 1.0 / (len({a for anc in ancestors for a in anc}) + len(outcome))
        value = sum(outcome[i] - cost for i in chosen) - cost * len(branches)
        return value + 1.5 / len(set(clusters)) * len({clusters[i] for i in chosen})

    rng = random.Random(7)
    for _ in range(12):
        n = rng.randint(2, 8)
        outcome = outcome_scores([rng.random() for _ in range(n)], 8, 0.2)
        ancestors = [["r", f"r.{rng.randint(0, 2)}"] for _ in range(n)]
        clusters = [rng.randint(0, 2) for _ in range(n)]
        best = objective(ilp_select(outcome, ancestors, clusters), outcome, ancestors, clusters)
        assert (
            abs(objective(ilp_select_exact(outcome, ancestors, clusters), outcome, ancestors, clusters) - best) < 1e-9
        )
    # two leaves under one parent, in one cluster, no outcome: keeping either covers the cluster equally well
    tie = ([0.0, 0.0], [["r", "r.0"], ["r", "r.0"]], [0, 0])
    assert ilp_select_exact(*tie, prefer=[0.2, 0.9]) == [False, True]
    assert ilp_select_exact(*tie, prefer=[0.9, 0.2]) == [True, False]


def test_a_generating_node_is_drawn_from_its_parents_score_plus_a_known_step():
    policy = Rebase(RebaseParams(width=4))
    tree = Tree(0)
    a, b = _children(tree.root, 0.9, 0.3)
    known = _children(a, 0.7)[0]  # a step of 0.7 - 0.9 = -0.2 below its parent
    pending = _children(b, None)[0]
    level = [known, pending]
    assert drawn_from_parents(policy, level, [pending], random.Random(0)) == [pytest.approx(0.1)]
    up = _children(a, 0.95)[0]  # a step of +0.05; under a parent scored 0.99 the draw is clipped to 1
    late = _children(_children(Tree(0).root, 0.99)[0], None)
    assert drawn_from_parents(policy, [up, *late], late, random.Random(0)) == [1.0]
