"""T1 DFS selection: simulate the next k rollouts' UCB selections on a temporary copy of the MCTS statistics.

Each simulated rollout uses the random stream the real one will use (``ctx.rng("rollout:i")`` for rSTAR,
``"iteration:i"`` for REST), descends with the policy's own UCT rule, skips nodes already being generated, and
yields the expansions that rollout will need, in order. rSTAR's simulation phase (random child per level down
to a terminal) is replayed exactly: the choice depends only on the random stream and on how many live children
a node has, so the whole rollout path is predictable before any of its text exists — only unknown rewards
(UCT once every child is explored) and unknown terminal flags can make it wrong. After each simulated rollout
the copy is updated as the real backup will be: with the reward of the rollout's terminal when a speculative
node already produced it, else 0 (a virtual loss), so the next simulated rollout moves on. Not-yet-generated nodes enter the copy as virtual children.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Set

from sglang_spex.tot.policies import mcts


@dataclass(frozen=True)
class Expansion:
    """A node the search will expand (generate its children), ``distance`` rollouts ahead (1 = current)."""

    path: str
    distance: int


@dataclass
class NodeFacts:
    """What is known about a node outside the primary statistics (a speculative node's result)."""

    terminal: bool = False
    failed: bool = False
    reward: Optional[float] = None  # the reward a rollout ending here backs up (rSTAR), once known


Lookup = Callable[[str], Optional[NodeFacts]]


def _depth(path: str) -> int:
    return path.count(".")


class _Copy:
    """A copy of the statistics that grows virtual children for nodes the search has not expanded yet."""

    def __init__(self, stats: mcts.Stats, lookup: Lookup, branch: int, max_depth: Optional[int]):
        self.s = mcts.copy_stats(stats)
        self.lookup = lookup
        self.branch = branch
        self.max_depth = max_depth

    def stat(self, path: str) -> mcts.Stat:
        st = self.s.get(path)
        if st is None:
            parent = path.rsplit(".", 1)[0]
            st = self.s[path] = mcts.Stat(path, parent, _depth(path))
            facts = self.lookup(path)
            if facts is not None:
                st.terminal, st.failed = facts.terminal, facts.failed
        if self.max_depth is not None and st.depth >= self.max_depth:
            st.terminal = True
        return st

    def virtual_expand(self, path: str) -> None:
        st = self.stat(path)
        if not st.expanded:
            st.children = st.children or [f"{path}.{i}" for i in range(self.branch)]
            st.expanded = True
        for c in st.children:
            self.stat(c)

    def kids(self, path: str) -> List[str]:
        return [c for c in self.s[path].children if not self.stat(c).failed]


def _rstar_rollout(cp: _Copy, root: str, rng: random.Random, w: float, busy: Set[str]) -> Optional[List[str]]:
    """Replay one rSTAR rollout (select, then simulate to a terminal); the expansions it needs, in order."""
    node, path = root, [root]
    while True:  # select (mcts.select_rstar on the copy)
        st = cp.stat(node)
        if not st.expanded or st.terminal:
            break
        kids = cp.kids(node)
        if not kids:
            break
        unexplored = [k for k in kids if not cp.stat(k).explored]
        if unexplored:
            node = rng.choice(unexplored)
            path.append(node)
            break
        n_p = st.visits
        node = max(kids, key=lambda c: mcts.uct_rstar(cp.s[c].value, cp.s[c].visits, n_p, w))
        path.append(node)
    needs: List[str] = []
    cur = node
    while not cp.stat(cur).terminal:  # simulate: expand, then a random live child
        if not cp.s[cur].expanded:
            if cur in busy:
                break
            needs.append(cur)
            cp.virtual_expand(cur)
        kids = cp.kids(cur)
        if not kids:
            break
        cur = rng.choice(kids)
        path.append(cur)
    facts = cp.lookup(cur) if cp.stat(cur).terminal else None
    reward = facts.reward if facts is not None and facts.reward is not None else 0.0
    for p in path:  # the backup this rollout will do: a finished speculative terminal's reward, else 0
        st = cp.stat(p)
        st.visits += 1
        st.value += reward
        st.explored = True
    return needs


def _rest_iteration(cp: _Copy, root: str, rng: random.Random, c: float, inf: float, busy: Set[str]) -> List[str]:
    node = root
    while cp.stat(node).expanded and cp.kids(node):
        n_p = cp.s[node].visits
        scored = [(mcts.uct_rest(cp.s[k].value, cp.s[k].visits, n_p, c, inf), k) for k in cp.kids(node)]
        top = max(s for s, _ in scored)
        node = rng.choice([k for s, k in scored if s == top])
    st = cp.stat(node)
    needs = [] if st.terminal or node in busy else [node]
    cp.virtual_expand(node)
    cur: Optional[str] = node
    while cur is not None:  # virtual backup: N += 1 up the path
        cp.stat(cur).visits += 1
        cur = cp.s[cur].parent
    return needs


def predict_expansions(
    stats: mcts.Stats,
    root: str,
    policy: str,
    rngs: List[random.Random],
    busy: Set[str],
    *,
    branch: int,
    max_depth: Optional[int] = None,
    lookup: Lookup = lambda path: None,
    knobs: Optional[Dict[str, float]] = None,
    limit: int = 64,
) -> List[Expansion]:
    """The expansions the next ``len(rngs)`` rollouts of ``policy`` will need, nearest first.

    ``stats`` is not modified. ``busy`` holds nodes already being expanded (primary or speculative); the walk
    treats them as expanded-in-progress and does not return them.
    """
    knobs = knobs or {}
    cp = _Copy(stats, lookup, branch, max_depth)
    for b in busy:
        cp.virtual_expand(b)
    out: List[Expansion] = []
    seen: Set[str] = set()
    for distance, rng in enumerate(rngs, start=1):
        if policy == "rstar":
            needs = _rstar_rollout(cp, root, rng, knobs.get("w", 2.0), busy) or []
        elif policy == "rest":
            needs = _rest_iteration(cp, root, rng, knobs.get("c", 0.7), knobs.get("inf", 1.0), busy)
        else:
            raise ValueError(f"DFS lookahead needs an MCTS policy, got {policy!r}")
        for p in needs:
            if p not in seen:
                seen.add(p)
                out.append(Expansion(p, distance))
        if len(out) >= limit:
            break
    return out[:limit]


def rollout_rngs(make_rng: Callable[[str], random.Random], label: str, start: int, count: int) -> List[random.Random]:
    """The random streams of rollouts ``start .. start+count-1`` (as the policy will create them)."""
    return [make_rng(f"{label}:{i}") for i in range(start, start + count)]
