"""T1 BFS early expansion asks the BFS policy object for its widths."""

from __future__ import annotations

import pytest

from sglang_spex.speculation.bfs_early import (
    predicted_levels,
    predicted_widths,
    split_on_frontier,
    use_chances,
    width_chances,
)
from sglang_spex.tot.policies.rebase import Rebase, RebaseParams
from sglang_spex.tot.tree import DONE, GENERATING, Node, Tree


def level(*rewards):
    """Children of the root; a reward of None is a sibling still generating."""
    tree = Tree(0)
    out = []
    for i, r in enumerate(rewards):
        node = tree.child(tree.root, i)
        node.status, node.reward = (GENERATING, None) if r is None else (DONE, r)
        out.append(node)
    return out


def test_early_widths_are_the_policys_allocation_with_pending_siblings_imputed():
    # the pending sibling counts with the mean known score 0.7; e = exp(s/0.2): 0.9 -> 90.0, 0.7 -> 33.1,
    # 0.5 -> 12.2 (sum 135.3): ceil(8*90.0/135.3) = 6, then ceil(2*33.1/45.3) = 2 (the pending one), then 0
    nodes = level(0.9, 0.5, None)
    assert predicted_widths(Rebase(RebaseParams(width=8)), nodes, 8) == {"r.0": 6, "r.1": 0}
    # the policy's own temperature: T = 1 spreads it (e = 2.46, 1.65, 2.01 -> 4, then 3 pending, then 1)
    assert predicted_widths(Rebase(RebaseParams(width=8, softmax_temperature=1.0)), nodes, 8) == {"r.0": 4, "r.1": 1}


def test_a_subclass_predict_widths_changes_the_early_expansion():
    class Even(Rebase):
        def predict_widths(self, scores, width):
            return [width // len(scores)] * len(scores)

    nodes = level(0.9, 0.5, None)
    assert predicted_widths(Even(RebaseParams(width=9)), nodes, 9) == {"r.0": 3, "r.1": 3}


def test_frontier_keeps_children_within_the_real_width():
    spec_children = [("r.0.0", "r.0", 0), ("r.0.1", "r.0", 1), ("r.1.0", "r.1", 0)]
    assert split_on_frontier(spec_children, {"r.0": 1}) == (["r.0.0"], ["r.0.1", "r.1.0"])


def test_levels_below_predict_from_the_speculative_children_inside_their_parents_widths():
    policy = Rebase(RebaseParams(width=8, softmax_temperature=1.0))
    r0, r1 = level(0.9, 0.5)  # e = 1, 0.67 -> widths 5 and 3

    def child(parent, index, status, reward=None, terminal=False):
        return Node(path=f"{parent.path}.{index}", parent=parent, status=status, reward=reward, is_terminal=terminal)

    below = {
        "r.0": [child(r0, 0, DONE, 0.8), child(r0, 1, GENERATING), child(r0, 5, DONE, 0.99)],  # r.0.5: outside 5
        "r.1": [child(r1, 0, DONE, 0.7, terminal=True)],
    }
    assert predicted_levels(policy, [r0, r1], below, 8, levels=1) == {"r.0": 5, "r.1": 3}
    # depth 2: r.1.0 is an answer (width 8 - 1 = 7); r.0.0 known, r.0.1 and 8 - 3 = 5 unseen nodes pending:
    # 7 equal scores share 7 -> 1 each
    assert predicted_levels(policy, [r0, r1], below, 8, levels=2) == {"r.0": 5, "r.1": 3, "r.0.0": 1}


def test_one_world_is_the_mean_imputation_and_more_worlds_keep_a_parent_near_the_cut():
    """World 0 imputes the mean (r.1 gets no width there); worlds that draw the unknown scores from the known ones
    sometimes give r.1 a child, so it keeps a chance and what is below it can still be planned."""
    policy = Rebase(RebaseParams(width=4, softmax_temperature=0.3))
    nodes = level(0.9, 0.3, None, None)
    assert predicted_levels(policy, nodes, {}, 4, levels=1) == {"r.0": 3}
    assert use_chances(policy, nodes, {}, 4, levels=1, worlds=1) == {"r.0": width_chances(3)}
    many = use_chances(policy, nodes, {}, 4, levels=1, worlds=8, seed="q")
    assert many == use_chances(policy, nodes, {}, 4, levels=1, worlds=8, seed="q")  # seeded: reproducible
    assert 0 < many["r.1"][0] < 1 and many["r.0"][0] == 1.0
    for chances in many.values():
        assert all(1 >= a >= b >= 0 for a, b in zip(chances, chances[1:] + [0.0]))


def test_a_deeper_chance_is_its_parents_chance_times_its_own():
    policy = Rebase(RebaseParams(width=8, softmax_temperature=1.0))
    r0, r1 = level(0.9, 0.5)  # widths 5 and 3 in every world: nothing is unknown at this depth
    below = {"r.0": [Node(path="r.0.0", parent=r0, status=DONE, reward=0.8)]}
    got = use_chances(policy, [r0, r1], below, 8, levels=2, worlds=1)
    # depth 2 in world 0: r.0.0 and 7 pending nodes at the mean share 8: width 1; r.0.0 is in the tree with 5/5
    assert got == {"r.0": width_chances(5), "r.1": width_chances(3), "r.0.0": [1.0]}


def test_a_grandchilds_chance_is_scaled_by_its_parents_own_chance():
    """Two levels ahead: a speculative child at width index 2 (chance 0.6 of being wanted) scales its own
    children's chances by 0.6 (index 0, where the parent's chance is 1, cannot show it)."""
    policy = Rebase(RebaseParams(width=8, softmax_temperature=1.0))
    r0, r1 = level(0.9, 0.5)
    below = {"r.0": [Node(path="r.0.2", parent=r0, status=DONE, reward=0.8)]}
    got = use_chances(policy, [r0, r1], below, 8, levels=2, worlds=1)
    assert got["r.0"] == width_chances(5)
    parent = width_chances(5)[2]
    assert parent < 1 and got["r.0.2"] == pytest.approx([parent * c for c in width_chances(len(got["r.0.2"]))])
