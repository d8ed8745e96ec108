"""T1 BFS early expansion asks the BFS policy object for its widths."""

from __future__ import annotations

from sglang_spex.speculation.bfs_early import predicted_levels, predicted_widths, split_on_frontier
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
