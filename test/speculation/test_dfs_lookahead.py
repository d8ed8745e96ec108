"""T1 DFS selection on hand-built trees: the simulated UCB sequence matches the hand-computed one, and the
predictions come from the policy object's own methods."""

from __future__ import annotations

import asyncio
import random

from unit.fake_port import FakePort

from sglang_spex.speculation.dfs_lookahead import NodeFacts, predict_expansions
from sglang_spex.tot.context import SearchContext
from sglang_spex.tot.policies.base import Stat, copy_stats
from sglang_spex.tot.policies.rest import Rest, RestParams
from sglang_spex.tot.policies.rstar import RStar, RStarParams
from sglang_spex.tot.search_spec import SearchSpec


def tree(**children):
    """Root 'r' expanded with explored, unexpanded children given as name=(Q, N)."""
    stats = {"r": Stat("r", None, 0, visits=sum(n for _, n in children.values()), expanded=True, explored=True)}
    for name, (q, n) in children.items():
        path = f"r.{name}"
        stats["r"].children.append(path)
        stats[path] = Stat(path, "r", 1, visits=n, value=q, explored=True)
    return stats


def rngs(n):
    return [random.Random(i) for i in range(n)]


def rstar(branch, max_depth):
    return RStar(RStarParams(branch=branch, max_depth=max_depth))


def test_rstar_ucb_sequence_matches_hand_computation():
    # N_root = 4; UCT = Q/N + 2*sqrt(ln N_p / N):
    #   pick 1: a 1+2*sqrt(ln4/2)=2.665, b 1+2*sqrt(ln4)=3.355, c 0+2*sqrt(ln4)=2.355      -> b
    #   pick 2 (b: N=2, root N=5): a 2.794, b 0.5+2*sqrt(ln5/2)=2.294, c 2*sqrt(ln5)=2.537 -> a
    #   pick 3 (a: N=3, root N=6): a 0.667+2*sqrt(ln6/3)=2.210, b 2.393, c 2.677          -> c
    stats = tree(**{"0": (2.0, 2), "1": (1.0, 1), "2": (0.0, 1)})
    before = copy_stats(stats)
    out = predict_expansions(stats, "r", rstar(2, 2), rngs(3), set())
    assert [(e.path, e.distance) for e in out] == [("r.1", 1), ("r.0", 2), ("r.2", 3)]
    assert stats == before  # the real statistics are untouched


def test_rstar_skips_busy_nodes_and_uses_known_terminal_rewards():
    stats = tree(**{"0": (2.0, 2), "1": (1.0, 1), "2": (0.0, 1)})
    out = predict_expansions(stats, "r", rstar(2, 2), rngs(3), {"r.1"})
    assert "r.1" not in [e.path for e in out]
    # a finished speculative terminal under r.1 with a high reward makes rSTAR come back to r.1 next
    facts = {"r.1.0": NodeFacts(terminal=True, reward=5.0), "r.1.1": NodeFacts(terminal=True, reward=5.0)}
    out = predict_expansions(stats, "r", rstar(2, 2), rngs(2), {"r.1"}, lookup=facts.get)
    assert [e.path for e in out] == []  # rollout 1 ends in r.1's finished subtree; rollout 2 returns there


def test_rstar_replays_the_simulation_path_below_unexplored_children():
    stats = {"r": Stat("r", None, 0, visits=0, expanded=False)}
    out = predict_expansions(stats, "r", rstar(3, 3), rngs(1), set())
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
    policy = Rest(RestParams(branch=2, max_depth=5, end_gate=2.0))  # (at the default 0.9 gate, r.0 is a solution)
    assert [e.path for e in predict_expansions(stats, "r", policy, rngs(1), set())] == ["r.0"]


def test_a_subclass_select_changes_the_prediction():
    # the hand-computed UCT pick is r.1 (test above); a policy that always descends into the last child
    class LastChild(RStar):
        def best_child(self, stats, path):
            return stats[path].children[-1]

    stats = tree(**{"0": (2.0, 2), "1": (1.0, 1), "2": (0.0, 1)})
    plain = predict_expansions(stats, "r", rstar(2, 2), rngs(1), set())
    last = predict_expansions(stats, "r", LastChild(RStarParams(branch=2, max_depth=2)), rngs(1), set())
    assert [e.path for e in plain] == ["r.1"] and [e.path for e in last] == ["r.2"]


def test_a_subclass_virtual_backup_changes_the_next_pick():
    # without the virtual visit the copy does not move on: every simulated rollout picks r.1 again
    class NoVirtualVisit(RStar):
        def virtual_backup(self, stats, path, reward):
            pass

    stats = tree(**{"0": (2.0, 2), "1": (1.0, 1), "2": (0.0, 1)})
    out = predict_expansions(stats, "r", NoVirtualVisit(RStarParams(branch=2, max_depth=2)), rngs(3), set())
    assert [(e.path, e.distance) for e in out] == [("r.1", 1)]


def test_rest_prediction_follows_the_policys_uct_knobs():
    stats = tree(**{"0": (0.9, 2), "1": (0.2, 1)})
    # exploration 3.0: a 0.9 + 3*sqrt(2ln3/2) = 4.04, b 0.2 + 3*sqrt(2ln3) = 4.65 -> b
    policy = Rest(RestParams(branch=2, max_depth=5, exploration_constant=3.0))
    assert [e.path for e in predict_expansions(stats, "r", policy, rngs(1), set())] == ["r.1"]


def test_rstar_prediction_equals_the_real_rollout():
    """Rollout 1 predicted from the empty tree with the policy's own stream = what the real search expands."""
    spec = SearchSpec.from_dict(
        {
            "policy": {"name": "rstar", "num_rollouts": 1, "max_depth": 4, "branch": 3},
            "reward": {"type": "verifier", "name": "arith"},
            "seed": 11,
        }
    )
    ctx = SearchContext(spec, "q", FakePort(answer_from_depth=99))  # no answers: terminal only at max depth
    policy = ctx.policy
    before = copy_stats(ctx.stats)
    predicted = predict_expansions(before, "r", policy, [policy.rollout_rng(ctx.rng, 0)], set())
    asyncio.run(ctx.run())
    expanded = [n.path for n in ctx.tree if n.children]
    assert [e.path for e in predicted] == expanded and len(expanded) == 4
    # another stream predicts another path (the prediction is not a fixed walk)
    other = predict_expansions(before, "r", policy, [policy.rollout_rng(lambda label: random.Random(label), 0)], set())
    assert [e.path for e in other] != expanded


def test_rest_predicts_no_expansion_of_an_end_and_nothing_below_it():
    """REST selects an answer step (an end) or one at V >= end_gate: the search only backs it up, so the lookahead
    predicts no expansion there, and later predicted rollouts do not descend into children it never gets (before,
    the end was virtually expanded and its virtual children predicted)."""
    stats = tree(**{"0": (0.95, 2), "1": (0.2, 1)})  # r.0 at V >= end_gate 0.9: selected first, a solution
    policy = Rest(RestParams(branch=2, max_depth=5))
    out = [e.path for e in predict_expansions(stats, "r", policy, rngs(3), set())]
    assert "r.0" not in out and not any(p.startswith("r.0.") for p in out)
    stats["r.0"].terminal, stats["r.0"].value = True, 0.5  # an answer below the gate: an end all the same
    out = [e.path for e in predict_expansions(stats, "r", policy, rngs(3), set())]
    assert "r.0" not in out and not any(p.startswith("r.0.") for p in out)
