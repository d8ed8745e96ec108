"""T1 DFS selection: run the policy's next k rollouts on a copy-on-read overlay of the MCTS statistics.

Each simulated rollout is the policy's own :meth:`~sglang_spex.tot.policies.mcts.MCTSPolicy.predict_rollout`
(its select, and for rSTAR its simulate) with the random stream the real rollout will use, on a copy whose
unexpanded nodes grow virtual children when the rollout asks for them. What this module adds is only the T1
bookkeeping: nodes already being generated count as expanded and are not returned; a not-yet-generated node
enters the copy with what is known of it (a finished speculative node's terminal/failed flags); after each
simulated rollout the copy gets the policy's ``virtual_backup``, with the reward of the rollout's terminal when
a speculative node already produced it, else 0 (a virtual loss), so the next simulated rollout moves on; and
the expansions are ranked by how many rollouts ahead they are needed.

How many rollouts ahead (:func:`planned_distance`): always the configured ``lookahead`` (the paper's k); beyond
it, growing up to ``max_lookahead`` while the deepest planned distance's hit rate, resolved over the engine's
searches (:class:`~sglang_spex.speculation.accounting.DistanceRates`), holds (doubling while it is high, one
rollout at a time while it is near the floor); the first measured distance whose rate falls below the floor
(:data:`MIN_DEEP_HIT_RATE`, or what pays on the live step curve) ends the plan before it.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Sequence, Set, Tuple

from sglang_spex.speculation.accounting import MIN_DEEP_HIT_RATE, DistanceRates
from sglang_spex.tot.policies.base import Stat, Stats
from sglang_spex.tot.policies.mcts import MCTSPolicy
from sglang_spex.tot.tree import child_path

MIN_RESOLVED = 2.0  # resolved predictions a distance needs before its rate counts


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


class VirtualStats(Dict[str, Stat]):
    """A copy-on-read overlay over the statistics: a node is copied from ``base`` the first time the walk reads
    it (so policies may change what they read), a node ``base`` lacks appears as a virtual child. ``base`` is
    never written; a plan costs the nodes its rollouts touch, not a copy of the whole tree."""

    def __init__(self, stats: Stats, lookup: Lookup, branch: int, max_depth: int):
        super().__init__()
        self.base = stats
        self.lookup = lookup
        self.branch = branch
        self.max_depth = max_depth

    def __missing__(self, path: str) -> Stat:
        orig = self.base.get(path)
        if orig is not None:
            st = object.__new__(Stat)  # a shallow copy without copy.copy's reduce protocol (the planning hot spot)
            st.__dict__.update(orig.__dict__)
            st.children = list(orig.children)
        else:
            st = Stat(path, path.rsplit(".", 1)[0], path.count("."))
            facts = self.lookup(path)
            if facts is not None:
                st.terminal, st.failed = facts.terminal, facts.failed
        st.terminal = st.terminal or st.depth >= self.max_depth
        self[path] = st
        return st

    def virtual_expand(self, path: str) -> None:
        """Mark ``path`` expanded, with ``branch`` virtual children unless it has real ones."""
        st = self[path]
        if not st.expanded:
            st.children = st.children or [child_path(path, i) for i in range(self.branch)]
            st.expanded = True
        for c in st.children:
            _ = self[c]  # enter every child into the copy, with its known facts


def _simulate(policy: MCTSPolicy, cp: VirtualStats, root: str, rng: random.Random, busy: Set[str]) -> List[str]:
    """One predicted rollout on ``cp``: the expansions it needs, in order; then its virtual backup."""
    walk = policy.predict_rollout(cp, root, rng)
    needs: List[str] = []
    try:
        node = next(walk)
        while True:
            if node not in busy and not cp[node].terminal:
                needs.append(node)
            cp.virtual_expand(node)
            node = next(walk)
    except StopIteration as done:
        path: List[str] = done.value
    end = path[-1]
    facts = cp.lookup(end) if cp[end].terminal else None
    policy.virtual_backup(cp, path, facts.reward if facts is not None and facts.reward is not None else 0.0)
    return needs


def predict_expansions(
    stats: Stats,
    root: str,
    policy: MCTSPolicy,
    rngs: Sequence[random.Random],
    busy: Set[str],
    *,
    lookup: Lookup = lambda path: None,
    limit: int = 64,
) -> List[Expansion]:
    """The expansions the next ``len(rngs)`` rollouts of ``policy`` will need, nearest first.

    ``stats`` is not modified. ``busy`` holds nodes already being expanded (primary or speculative); the walk
    treats them as expanded-in-progress and does not return them.
    """
    cp = VirtualStats(stats, lookup, policy.branch, policy.max_depth)
    for b in busy:
        cp.virtual_expand(b)
    out: List[Expansion] = []
    seen: Set[str] = set()
    for distance, rng in enumerate(rngs, start=1):
        for p in _simulate(policy, cp, root, rng, busy):
            if p not in seen:
                seen.add(p)
                out.append(Expansion(p, distance))
        if len(out) >= limit:
            break
    return out[:limit]


def planned_distance(
    lookahead: int,
    max_lookahead: int,
    resolved: Callable[[int], Tuple[float, float]],
    min_rate: float = MIN_DEEP_HIT_RATE,
) -> int:
    """Rollouts to plan ahead: ``lookahead``, grown (up to ``max_lookahead``) while the deepest planned distance
    has ``MIN_RESOLVED`` resolved predictions at a rate of at least ``min_rate`` — doubled at twice that rate, else by
    one; then cut before the first distance past ``lookahead`` whose measured rate is below it. ``resolved(d)`` is
    (hits, resolved) at ``d``."""
    min_rate = max(min_rate, MIN_DEEP_HIT_RATE)

    def rate(d: int) -> Optional[float]:
        hits, total = resolved(d)
        return hits / total if total >= MIN_RESOLVED else None

    n = lookahead
    while n < max_lookahead:
        r = rate(n)
        if r is None or r < min_rate:
            break
        n = min(max_lookahead, 2 * n if r >= 2 * min_rate else n + 1)  # a borderline rate: one step at a time
    for d in range(lookahead + 1, n + 1):
        r = rate(d)
        if r is not None and r < min_rate:
            return d - 1
    return n


class DuePredictions:
    """A search's issued DFS predictions and the rollout each was made for, resolved into
    :class:`~sglang_spex.speculation.accounting.DistanceRates`: a miss once that rollout has passed unused or the
    search ended without it, a hit when adopted (a late adoption undoes its miss)."""

    def __init__(self, rates: Callable[[], DistanceRates]):
        self.rates = rates  # the pooled rates of the search's engine (known once the search has its DP rank)
        self._due: Dict[str, Tuple[int, int]] = {}  # path -> (rollout it was predicted for, distance)
        self._missed: Set[str] = set()

    def issued(self, path: str, rollout: int, distance: int) -> None:
        self._due[path] = (rollout, distance)

    def passed(self, rollout: int, pending: Callable[[str], bool]) -> None:
        """Rollouts before ``rollout`` are over: a prediction for one of them still ``pending`` (not adopted) is a
        miss; one no longer pending (adopted, or cancelled) stops being tracked."""
        for path, (due, distance) in list(self._due.items()):
            if due >= rollout or path in self._missed:
                continue
            if pending(path):
                self._missed.add(path)
                self.rates().record_miss(distance)
            else:
                del self._due[path]

    def ended(self) -> None:
        """The search ended: a prediction never adopted is a miss, also one whose rollout never came (the search
        finished first: its work was wasted all the same)."""
        for path, (_, distance) in self._due.items():
            if path not in self._missed:
                self.rates().record_miss(distance)
        self._due.clear()
        self._missed.clear()

    def dropped(self, path: str) -> None:
        """The prediction's request ended without a result (refused, failed): neither a hit nor a miss."""
        self._due.pop(path, None)
        self._missed.discard(path)

    def adopted(self, path: str) -> None:
        got = self._due.pop(path, None)
        if got is not None:
            was_miss = path in self._missed
            self._missed.discard(path)
            self.rates().record_hit(got[1], was_miss=was_miss)
