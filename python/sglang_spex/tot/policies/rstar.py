"""rSTAR-MCTS (rStar, mutual-reasoning branch): one rollout at a time.

Rollout i: select (unexplored children first, chosen at random; else UCT Q/N + w·sqrt(ln N_p / N)) → expand
the leaf (``branch`` children at once) → simulate to a terminal by picking random children, expanding as
needed → back up the terminal's reward along the whole path (Q += r, N += 1). The rollout's randomness comes
from the stream ``"rollout:<i>"``, so the search is a deterministic function of its seed and the node texts.
A terminal's reward is its node reward when it states an answer, else 0.

The rollout is a generator over the statistics (:meth:`RStar.rollout`) that yields each node it needs
expanded: the search loop generates those children for real; SPEX's DFS lookahead gives them virtual
children on a copy. Both run this same code, so the whole select-and-simulate path is predictable before
any of its text exists.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from typing import List, Optional

from sglang_spex.tot.policies.base import SearchHost, Stats
from sglang_spex.tot.policies.mcts import MCTSPolicy, RolloutWalk, check_target_answers, selectable
from sglang_spex.tot.tree import Node
from sglang_spex.tot.validation import check_finite, check_int

UNVISITED = 999.0  # rStar: an unvisited child (or the root) gets this UCT value


@dataclass
class RStarParams:
    num_rollouts: int = 15
    max_depth: int = 5
    branch: int = 3
    exploration_weight: float = 2.0
    target_answers: Optional[int] = None  # stop once this many answer nodes exist

    def validate(self) -> None:
        for name in ("num_rollouts", "max_depth", "branch"):
            check_int(getattr(self, name), f"policy.{name}", 1)
        check_finite(self.exploration_weight, "policy.exploration_weight", 0)
        check_target_answers(self.target_answers)


def uct(q: float, n: int, n_parent: int, w: float = 2.0) -> float:
    """rStar: Q/N + w·sqrt(ln N_parent / N); unvisited → 999."""
    if n == 0:
        return UNVISITED
    return q / n + w * math.sqrt(math.log(max(n_parent, 1)) / n)


class RStar(MCTSPolicy):
    name = "rstar"
    params_type = RStarParams
    rng_label = "rollout"

    def best_child(self, stats: Stats, path: str) -> str:
        """argmax UCT over the live children; the first of equal values wins (Python ``max``)."""
        n_p, w = stats[path].visits, self.params.exploration_weight
        return max(selectable(stats, path), key=lambda c: uct(stats[c].value, stats[c].visits, n_p, w))

    def select(self, stats: Stats, root: str, rng: random.Random) -> List[str]:
        """Descend from ``root``; stop at an unexpanded node, or step into a random unexplored child, else
        follow the best UCT child."""
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
            node = self.best_child(stats, node)

    def simulate(self, stats: Stats, leaf: str, rng: random.Random) -> RolloutWalk:
        """From ``leaf`` down to a terminal through random live children; a node whose children all failed
        becomes a terminal (a dead end). Returns the nodes below ``leaf``."""
        cur, sim = leaf, []
        while not stats[cur].terminal:
            if not stats[cur].expanded:
                yield cur
            kids = selectable(stats, cur)
            if not kids:
                stats[cur].terminal = True
                break
            cur = rng.choice(kids)
            sim.append(cur)
        return sim

    def rollout(self, stats: Stats, root: str, rng: random.Random) -> RolloutWalk:
        """Select, then simulate: the whole rollout path."""
        path = self.select(stats, root, rng)
        sim = yield from self.simulate(stats, path[-1], rng)
        return path + sim

    def predict_rollout(self, stats: Stats, root: str, rng: random.Random) -> RolloutWalk:
        return self.rollout(stats, root, rng)

    def backup(self, stats: Stats, path: List[str], reward: float) -> None:
        """Every node on the rollout path gets Q += reward, N += 1 and becomes explored."""
        for p in reversed(path):
            st = stats[p]
            st.value += reward
            st.visits += 1
            st.explored = True

    def virtual_backup(self, stats: Stats, path: List[str], reward: float) -> None:
        self.backup(stats, path, reward)

    def terminal_reward(self, node: Node) -> float:
        """Its reward if it states an answer, else 0."""
        return float(node.reward or 0.0) if node.ok and node.answer is not None else 0.0

    async def expand(self, ctx: SearchHost, path: str) -> None:
        """rStar ``_expand``: generate the children of an unexpanded, non-terminal node."""
        st = ctx.stats[path]
        if st.expanded or st.terminal:
            return
        await ctx.expand(ctx.tree.get(path), self.branch)

    async def run(self, ctx: SearchHost) -> None:
        root = ctx.tree.root.path
        for i in range(self.params.num_rollouts):
            if ctx.should_stop() or self.enough_answers(len(ctx.tree.terminals())):
                break
            ctx.on_rollout(i)
            path = await self._drive(ctx, self.rollout(ctx.stats, root, self.rollout_rng(ctx.rng, i)))
            if path is None or ctx.should_stop():
                break
            self.backup(ctx.stats, path, self.terminal_reward(ctx.tree.get(path[-1])))
            ctx.sync_stats()

    async def _drive(self, ctx: SearchHost, walk: RolloutWalk) -> Optional[List[str]]:
        """Run a rollout against the real search: generate what it asks for; None once the search stops."""
        try:
            need = next(walk)
            while True:
                await self.expand(ctx, need)
                if ctx.should_stop():
                    return None
                need = walk.send(None)
        except StopIteration as done:
            return done.value
