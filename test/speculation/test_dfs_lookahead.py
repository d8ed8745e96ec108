"""T1 DFS selection on hand-built trees: the simulated UCB sequence matches the hand-computed one."""

from __future__ import annotations

import random

from sglang_spex.speculation.dfs_lookahead import NodeFacts, predict_expansions
from sglang_spex.tot.policies import mcts


def tree(**children):
    """Root 'r' expanded with explored, unexpanded children given as name=(Q, N)."""
    stats = {"r": mcts.Stat("r", None, 0, visits=sum(n for _, n in children.values()), expanded=True, explored=True)}
    for name, (q, n) in children.items():
        path = f"r.{name}"
        stats["r"].children.append(path)
        stats[path] = mcts.Stat(path, "r", 1, visits=n, value=q, explored=True)
    return stats


def rngs(n):
    return [random.Random(i) for i in range(n)]


def test_rstar_ucb_sequence_matches_hand_computation():
    # N_root = 4; UCT = Q/N + 2*sqrt(ln N_p / N):
    #   pick 1: a 1+2*sqrt(ln4/2)=2.665, b 1+2*sqrt(ln4)=3.355, c 0+2*sqrt(ln4)=2.355      -> b
    #   pick 2 (b: N=2, root N=5): a 2.794, b 0.5+2*sqrt(ln5/2)=2.294, c 2*sqrt(ln5)=2.537 -> a
    #   pick 3 (a: N=3, root N=6): a 0.667+2*sqrt(ln6/3)=2.210, b 2.393, c 2.677          -> c
    stats = tree(**{"0": (2.0, 2), "1": (1.0, 1), "2": (0.0, 1)})
    before = mcts.copy_stats(stats)
    out = predict_expansions(stats, "r", "rstar", rngs(3), set(), branch=2, max_depth=2)
    assert [(e.path, e.distance) for e in out] == [("r.1", 1), ("r.0", 2), ("r.2", 3)]
    assert stats == before  # the real statistics are untouched


def test_rstar_skips_busy_nodes_and_uses_known_terminal_rewards():
    stats = tree(**{"0": (2.0, 2), "1": (1.0, 1), "2": (0.0, 1)})
    out = predict_expansions(stats, "r", "rstar", rngs(3), {"r.1"}, branch=2, max_depth=2)
    assert "r.1" not in [e.path for e in out]
    # a finished speculative terminal under r.1 with a high reward makes rSTAR come back to r.1 next
    facts = {"r.1.0": NodeFacts(terminal=True, reward=5.0), "r.1.1": NodeFacts(terminal=True, reward=5.0)}
    out = predict_expansions(stats, "r", "rstar", rngs(2), {"r.1"}, branch=2, max_depth=2, lookup=facts.get)
    assert [e.path for e in out] == []  # rollout 1 ends in r.1's finished subtree; rollout 2 returns there


def test_rstar_replays_the_simulation_path_below_unexplored_children():
    stats = {"r": mcts.Stat("r", None, 0, visits=0, expanded=False)}
    out = predict_expansions(stats, "r", "rstar", rngs(1), set(), branch=3, max_depth=3)
    # rollout 1 expands the root, then descends by its random stream: one expansion per level until max depth
    paths = [e.path for e in out]
    assert paths[0] == "r" and len(paths) == 3
    rng = random.Random(0)
    c1 = f"r.{rng.choice([0, 1, 2])}"
    c2 = f"{c1}.{rng.choice([0, 1, 2])}"
    assert paths == ["r", c1, c2]


def test_rest_picks_by_value_ucb():
    # REST UCT = V + 0.7*sqrt(2 ln N_p / n): N_p=3; a: 0.9 + 0.7*sqrt(2ln3/2)=1.634, b: 0.2 + 0.7*sqrt(2ln3)=1.238
    stats = tree(**{"0": (0.9, 2), "1": (0.2, 1)})
    out = predict_expansions(stats, "r", "rest", rngs(1), set(), branch=2, max_depth=5)
    assert [e.path for e in out] == ["r.0"]
