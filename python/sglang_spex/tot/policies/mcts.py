"""Pure MCTS helpers shared by rSTAR and REST-MCTS: UCT formulas, selection and backup on statistics.

The statistics live in a plain ``{path: Stat}`` dict (``SearchContext.stats``), separate from the node
objects, so a simulator (SPEX's DFS lookahead) can run the next k selections on ``copy_stats(stats)``:
each pick bumps the visit count and recomputes UCT, without touching the real search.
"""

from __future__ import annotations

import copy
import math
import random
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional

RSTAR_UNVISITED = 999.0  # rStar: an unvisited child (or the root) gets this UCT value


@dataclass
class Stat:
    path: str
    parent: Optional[str]
    depth: int = 0
    children: List[str] = field(default_factory=list)
    visits: int = 0  # N
    value: float = 0.0  # rSTAR: Q (sum of backed-up rewards); REST: V
    expanded: bool = False  # children generated (rStar "in parent2children"; REST "isFullyExpanded")
    explored: bool = False  # rStar: backed up at least once (or found terminal)
    terminal: bool = False
    failed: bool = False
    generating: bool = False  # a simulator skips nodes already being generated


Stats = Dict[str, Stat]


def copy_stats(stats: Stats) -> Stats:
    return copy.deepcopy(stats)


def uct_rstar(q: float, n: int, n_parent: int, w: float = 2.0) -> float:
    """rStar: Q/N + w·sqrt(ln N_parent / N); unvisited → 999."""
    if n == 0:
        return RSTAR_UNVISITED
    return q / n + w * math.sqrt(math.log(max(n_parent, 1)) / n)


def uct_rest(v: float, n: int, n_parent: int, c: float = 0.7, inf: float = 1.0) -> float:
    """ReST-MCTS*: V + c·sqrt(2 ln N_parent / n); unvisited → V + inf."""
    if n == 0:
        return v + inf
    return v + c * math.sqrt(2.0 * math.log(max(n_parent, 1)) / n)


def selectable(stats: Stats, path: str) -> List[str]:
    return [c for c in stats[path].children if not stats[c].failed]


def best_child_rstar(stats: Stats, path: str, w: float = 2.0) -> str:
    """argmax UCT over the live children; the first of equal values wins (Python ``max``)."""
    n_p = stats[path].visits
    return max(selectable(stats, path), key=lambda c: uct_rstar(stats[c].value, stats[c].visits, n_p, w))


def best_child_rest(stats: Stats, path: str, rng: random.Random, c: float = 0.7, inf: float = 1.0) -> str:
    """argmax UCT over the live children; ties are broken by ``rng.choice`` (as the reference does)."""
    n_p = stats[path].visits
    scored = [(uct_rest(stats[k].value, stats[k].visits, n_p, c, inf), k) for k in selectable(stats, path)]
    top = max(s for s, _ in scored)
    return rng.choice([k for s, k in scored if s == top])


def select_rstar(stats: Stats, root: str, rng: random.Random, w: float = 2.0) -> List[str]:
    """rStar selection: descend from ``root``; stop at an unexpanded node, or step into a random unexplored
    child, else follow the best UCT child. Returns the path (root first)."""
    path, node = [], root
    while True:
        path.append(node)
        if not stats[node].expanded or stats[node].terminal:
            return path
        kids = selectable(stats, node)
        unexplored = [k for k in kids if not stats[k].explored]
        if unexplored:
            path.append(rng.choice(unexplored))
            return path
        if not kids:
            return path
        node = best_child_rstar(stats, node, w)


def select_rest(stats: Stats, root: str, rng: random.Random, c: float = 0.7, inf: float = 1.0) -> str:
    """ReST-MCTS* selection: follow the best UCT child while the node is fully expanded."""
    node = root
    while stats[node].expanded and selectable(stats, node):
        node = best_child_rest(stats, node, rng, c, inf)
    return node


def select_leaf(stats: Stats, root: str, policy: str, rng: random.Random, **knobs: float) -> str:
    """The node the next rollout of ``policy`` ("rstar" | "rest") would start from."""
    if policy == "rstar":
        return select_rstar(stats, root, rng, knobs.get("w", 2.0))[-1]
    if policy == "rest":
        return select_rest(stats, root, rng, knobs.get("c", 0.7), knobs.get("inf", 1.0))
    raise ValueError(f"unknown MCTS policy {policy!r}")


def backup_rstar(stats: Stats, path: List[str], reward: float) -> None:
    """rStar: every node on the rollout path gets Q += reward, N += 1 and becomes explored."""
    for p in reversed(path):
        st = stats[p]
        st.value += reward
        st.visits += 1
        st.explored = True


def rest_rollout_update(v: float, best_v: float, alpha: float = 0.5) -> float:
    """ReST-MCTS*: V ← (1 − α)·V + α·maxV after a partial rollout."""
    return v * (1.0 - alpha) + best_v * alpha


def backup_rest(stats: Stats, path: str) -> None:
    """ReST-MCTS*: from ``path`` up, N += 1 and (if expanded) V = Σ V_c·N_c / Σ N_c over the children."""
    cur: Optional[str] = path
    while cur is not None:
        st = stats[cur]
        st.visits += 1
        if st.expanded:
            kids = [stats[k] for k in selectable(stats, cur)]
            total = sum(k.visits for k in kids)
            if total > 0:
                st.value = sum(k.value * k.visits for k in kids) / total
        cur = st.parent


ScoreFn = Callable[[Stat, Stat], float]
