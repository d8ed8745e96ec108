"""ReST-MCTS*: value-guided MCTS with partial rollouts, one iteration at a time.

Iteration: select (follow UCT V + c·sqrt(2 ln N_p / n), unvisited → V + inf, ties at random, while the node is
expanded) → if the node is terminal (V ≥ end_gate, an answer, EOS, a limit) it is not expanded: at V ≥ end_gate
it is a solution and, without ``target_answers``, the search stops; otherwise (an end below the gate, or collecting
``target_answers``) it is only backed up, as in the reference → expand ``branch`` children (V = their reward) →
greedy partial rollout from the best child unless it is an end (answer, EOS, a limit; a child that reached
end_gate is rolled out too, as the reference does): ``roll_forward_steps`` steps of ``roll_branch`` samples each,
keep the highest value, V = (1−α)V + α·maxV, N += 1 → weighted backup V_p = Σ V_c N_c / Σ N_c.
Rollout steps are nodes of kind "rollout" (``<path>.g<i>``), not tree children. Iteration i draws from the
stream ``"iteration:<i>"``.
"""

from __future__ import annotations

import asyncio
import math
import random
from dataclasses import dataclass
from typing import List, Optional

from sglang_spex.tot.policies.base import SearchHost, Stat, Stats
from sglang_spex.tot.policies.mcts import MCTSPolicy, RolloutWalk, check_target_answers, selectable
from sglang_spex.tot.tree import KIND_ROLLOUT, Node
from sglang_spex.tot.validation import check, check_finite, check_int


@dataclass
class RestParams:
    iterations: int = 100
    max_depth: int = 10
    branch: int = 3
    roll_branch: int = 1
    roll_forward_steps: int = 2
    exploration_constant: float = 0.7
    alpha: float = 0.5
    end_gate: float = 0.9
    inf: float = 1.0
    low: float = 0.0
    target_answers: Optional[int] = None  # collect this many answer nodes instead of stopping at the first solution

    def validate(self) -> None:
        for name in ("iterations", "max_depth", "branch", "roll_branch"):
            check_int(getattr(self, name), f"policy.{name}", 1)
        check_int(self.roll_forward_steps, "policy.roll_forward_steps", 0)
        check(0 <= self.alpha <= 1, "policy.alpha", "must be in [0, 1]")
        check_finite(self.exploration_constant, "policy.exploration_constant", 0)
        check_finite(self.inf, "policy.inf", 0)
        for name in ("low", "end_gate"):
            check_finite(getattr(self, name), f"policy.{name}")
        check_target_answers(self.target_answers)


def uct(v: float, n: int, n_parent: int, c: float = 0.7, inf: float = 1.0) -> float:
    """ReST-MCTS*: V + c·sqrt(2 ln N_parent / n); unvisited → V + inf."""
    if n == 0:
        return v + inf
    return v + c * math.sqrt(2.0 * math.log(max(n_parent, 1)) / n)


def rollout_update(v: float, best_v: float, alpha: float = 0.5) -> float:
    """ReST-MCTS*: V ← (1 − α)·V + α·maxV after a partial rollout."""
    return v * (1.0 - alpha) + best_v * alpha


class Rest(MCTSPolicy):
    name = "rest"
    params_type = RestParams
    rng_label = "iteration"

    @property
    def num_rollouts(self) -> int:
        return int(self.params.iterations)

    def best_child(self, stats: Stats, path: str, rng: random.Random) -> str:
        """argmax UCT over the live children; ties are broken by ``rng.choice`` (as the reference does)."""
        n_p, p = stats[path].visits, self.params
        scored = [
            (uct(stats[k].value, stats[k].visits, n_p, p.exploration_constant, p.inf), k)
            for k in selectable(stats, path)
        ]
        top = max(s for s, _ in scored)
        return rng.choice([k for s, k in scored if s == top])

    def select(self, stats: Stats, root: str, rng: random.Random) -> List[str]:
        """Follow the best UCT child while the node is expanded and has live children."""
        path = [root]
        while stats[path[-1]].expanded and selectable(stats, path[-1]):
            path.append(self.best_child(stats, path[-1], rng))
        return path

    def is_terminal(self, stats: Stats, path: str, root: str) -> bool:
        """A finished node, or (below the root) one whose value reached ``end_gate``."""
        st = stats[path]
        return st.terminal or (path != root and st.value >= self.params.end_gate)

    async def simulate(self, ctx: SearchHost, node: Node) -> float:
        """Greedy partial rollout: the best value seen over ``roll_forward_steps`` steps (``low`` if none)."""
        p = self.params
        best_v, cur = p.low, node
        for _ in range(p.roll_forward_steps):
            if cur.is_terminal or ctx.should_stop():
                break
            start = len(cur.rollouts)
            samples = await asyncio.gather(
                *(ctx.generate_node(cur, start + j, kind=KIND_ROLLOUT) for j in range(p.roll_branch))
            )
            live = [s for s in samples if s.ok and s.reward is not None]
            if not live:
                break
            cur = max(live, key=lambda s: s.reward)
            best_v = max(best_v, float(cur.reward))
        return best_v

    async def expand(self, ctx: SearchHost, path: str) -> None:
        """Generate ``branch`` more children of ``path`` (V of each = its reward)."""
        await ctx.expand(ctx.tree.get(path), self.branch)

    def backup(self, stats: Stats, path: str) -> None:
        """From ``path`` up: N += 1 and (if expanded) V = Σ V_c·N_c / Σ N_c over the live children."""
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

    def predict_rollout(self, stats: Stats, root: str, rng: random.Random) -> RolloutWalk:
        """Selection, then the leaf it expands (none when the leaf is an end: the search only backs it up); the
        values its partial rollout will bring are unknown."""
        path = self.select(stats, root, rng)
        if not self.is_terminal(stats, path[-1], root):
            yield path[-1]
        return path

    def virtual_backup(self, stats: Stats, path: List[str], reward: float) -> None:
        """N += 1 along the path; V waits for the rollout's text (``reward`` is not a REST value)."""
        for p in path:
            stats[p].visits += 1

    def update_stat(self, st: Stat, node: Node) -> None:
        """A new node's V is its step value (rSTAR's Q starts at 0)."""
        super().update_stat(st, node)
        if node.reward is not None:
            st.value = node.reward

    @staticmethod
    def open_below(stats: Stats, root: str) -> bool:
        """Some node the selection can reach from ``root`` is no end: it is unexpanded, or has no live child left
        (the search expands it again)."""
        todo = [root]
        while todo:
            path = todo.pop()
            if stats[path].terminal:
                continue
            kids = selectable(stats, path)
            if not stats[path].expanded or not kids:
                return True
            todo.extend(kids)
        return False

    async def run(self, ctx: SearchHost) -> None:
        p, stats = self.params, ctx.stats
        root = ctx.tree.root.path
        for it in range(p.iterations):
            if ctx.should_stop() or self.enough_answers(len(ctx.tree.terminals())):
                break
            ctx.on_rollout(it)
            rng = self.rollout_rng(ctx.rng, it)
            leaf = self.select(stats, root, rng)[-1]
            if self.is_terminal(stats, leaf, root):
                solved = leaf != root and stats[leaf].value >= p.end_gate
                stats[leaf].terminal = True
                if solved and not p.target_answers:
                    break  # a solution: V >= end_gate (an end below the gate is only backed up, as the reference's)
                self.backup(stats, leaf)
                ctx.sync_stats()
                if not self.open_below(stats, root):
                    break  # every node selection can reach is an end: later iterations would only back them up
                continue
            await self.expand(ctx, leaf)
            if ctx.should_stop():
                break
            if not selectable(stats, leaf):
                stats[leaf].terminal = True  # nothing could be generated: treat as an end
            else:
                roll = self.best_child(stats, leaf, rng)
                st = stats[roll]
                if not st.terminal:  # a child at V >= end_gate is rolled out too (the rollout may pull it below)
                    st.value = rollout_update(st.value, await self.simulate(ctx, ctx.tree.get(roll)), p.alpha)
                st.visits += 1
            self.backup(stats, leaf)
            ctx.sync_stats()
