"""T1 DFS selection: simulate the next k UCB selections on a temporary copy of the MCTS statistics.

Each simulated rollout uses the random stream the real rollout will use (``ctx.rng("rollout:i")`` for rSTAR,
``"iteration:i"`` for REST), descends with the policy's own UCT formula, skips nodes already being generated
(primary or speculative), and stops at the node that rollout would expand. The pick is then folded into the
copy (N += 1 along the path, Q/V unchanged — a pending reward acts as a virtual loss), so the next simulated
selection moves on. Rewards of finished speculative nodes enter the statistics when the search adopts them;
below a finished speculative node the runner keeps expanding (the rollout will descend into it).
Returned targets carry their prediction distance (1 = the next expansion).
"""

from __future__ import annotations

import random
from typing import Callable, Iterable, List, Optional, Set, Tuple

from sglang_spex.tot.policies import mcts

Target = Tuple[str, int]  # (path of the node to expand, distance)


def _kids(stats: mcts.Stats, path: str, busy: Set[str]) -> List[str]:
    return [k for k in mcts.selectable(stats, path) if k not in busy and not stats[k].terminal]


def _walk_rstar(stats: mcts.Stats, root: str, rng: random.Random, w: float, busy: Set[str]) -> Optional[List[str]]:
    """rStar's select + simulate on the copy, down to the first unexpanded node (None: nothing to do)."""
    path, node = [root], root
    while True:
        st = stats[node]
        if node in busy or st.terminal:
            return None
        if not st.expanded:
            return path
        kids = _kids(stats, node, busy)
        if not kids:
            return None
        unexplored = [k for k in kids if not stats[k].explored]
        if unexplored:
            node = rng.choice(unexplored)
        else:
            n_p = st.visits
            node = max(kids, key=lambda c: mcts.uct_rstar(stats[c].value, stats[c].visits, n_p, w))
        path.append(node)


def _walk_rest(stats: mcts.Stats, root: str, rng: random.Random, c: float, inf: float, busy: Set[str]) -> Optional[List[str]]:
    path, node = [root], root
    while stats[node].expanded:
        kids = _kids(stats, node, busy)
        if not kids:
            return None
        n_p = stats[node].visits
        scored = [(mcts.uct_rest(stats[k].value, stats[k].visits, n_p, c, inf), k) for k in kids]
        top = max(s for s, _ in scored)
        node = rng.choice([k for s, k in scored if s == top])
        path.append(node)
    if node in busy or stats[node].terminal:
        return None
    return path


def predict_expansions(
    stats: mcts.Stats,
    root: str,
    policy: str,
    rngs: Iterable[random.Random],
    k: int,
    busy: Set[str],
    knobs: Optional[dict] = None,
) -> List[Target]:
    """The next ``k`` nodes the MCTS ``policy`` will expand, predicted on ``stats`` (mutated: pass a copy)."""
    knobs = knobs or {}
    busy = set(busy)
    out: List[Target] = []
    for distance, rng in enumerate(rngs, start=1):
        if len(out) >= k:
            break
        if policy == "rstar":
            path = _walk_rstar(stats, root, rng, knobs.get("w", 2.0), busy)
        elif policy == "rest":
            path = _walk_rest(stats, root, rng, knobs.get("c", 0.7), knobs.get("inf", 1.0), busy)
        else:
            raise ValueError(f"DFS lookahead needs an MCTS policy, got {policy!r}")
        if path is None:
            continue
        target = path[-1]
        out.append((target, distance))
        busy.add(target)
        for p in path:  # virtual visit: the pending reward counts as 0 (a virtual loss)
            stats[p].visits += 1
            stats[p].explored = True
    return out


def rollout_rngs(make_rng: Callable[[str], random.Random], label: str, start: int, count: int) -> List[random.Random]:
    """The random streams of rollouts ``start .. start+count-1`` (as the policy will create them)."""
    return [make_rng(f"{label}:{i}") for i in range(start, start + count)]
