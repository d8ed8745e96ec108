"""rSTAR-MCTS (rStar, mutual-reasoning branch): one rollout at a time.

Rollout i: select (unexplored children first, chosen at random; else UCT Q/N + w·sqrt(ln N_p / N)) → expand
the leaf (``branch`` children at once) → simulate to a terminal by picking random children, expanding as
needed → back up the terminal's reward along the whole path (Q += r, N += 1). The rollout's randomness comes
from ``ctx.rng(f"rollout:{i}")``, so the search is a deterministic function of its seed and the node texts.
A terminal's reward is its node reward when it states an answer, else 0.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from sglang_spex.tot.policies import mcts
from sglang_spex.tot.tree import Node


@dataclass
class Params:
    num_rollouts: int = 15
    max_depth: int = 5
    branch: int = 3
    exploration_weight: float = 2.0
    target_answers: Optional[int] = None  # stop once this many answer nodes exist

    def validate(self) -> None:
        from sglang_spex.tot.search_spec import SearchSpecError

        for name in ("num_rollouts", "max_depth", "branch"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1:
                raise SearchSpecError(f"policy.{name}", "must be an integer >= 1")
        if self.exploration_weight < 0:
            raise SearchSpecError("policy.exploration_weight", "must be >= 0")
        if self.target_answers is not None and (not isinstance(self.target_answers, int) or self.target_answers < 1):
            raise SearchSpecError("policy.target_answers", "must be an integer >= 1 or null")


def terminal_reward(node: Node) -> float:
    return float(node.reward or 0.0) if node.ok and node.answer is not None else 0.0


async def expand(ctx, path: str) -> None:
    """rStar ``_expand``: generate the children of an unexpanded, non-terminal node."""
    st = ctx.stats[path]
    if st.expanded or st.terminal:
        return
    await ctx.expand(ctx.tree.get(path), ctx.params.branch)


async def run(ctx) -> None:
    p: Params = ctx.params
    for i in range(p.num_rollouts):
        if ctx.should_stop() or (p.target_answers and len(ctx.tree.terminals()) >= p.target_answers):
            break
        rng = ctx.rng(f"rollout:{i}")
        path = mcts.select_rstar(ctx.stats, ctx.tree.root.path, rng, p.exploration_weight)
        await expand(ctx, path[-1])
        cur, sim = path[-1], []
        while not ctx.should_stop():  # simulate to a terminal
            if ctx.stats[cur].terminal:
                break
            await expand(ctx, cur)
            kids = mcts.selectable(ctx.stats, cur)
            if not kids:
                ctx.stats[cur].terminal = True  # every child failed: a dead end
                break
            cur = rng.choice(kids)
            sim.append(cur)
        if ctx.should_stop():
            break
        mcts.backup_rstar(ctx.stats, path + sim, terminal_reward(ctx.tree.get(cur)))
        ctx.sync_stats()
