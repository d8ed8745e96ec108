"""ReST-MCTS*: value-guided MCTS with partial rollouts, one iteration at a time.

Iteration: select (follow UCT V + c·sqrt(2 ln N_p / n), unvisited → V + inf, ties at random, while the node is
expanded) → if the node is terminal (V ≥ end_gate, an answer, EOS, a limit) it is a solution: without
``target_answers`` the search stops; otherwise it is only backed up → expand ``branch`` children (V = their
reward) → greedy partial rollout from the best child: ``roll_forward_steps`` steps of ``roll_branch``
samples each, keep the highest value, V = (1−α)V + α·maxV, N += 1 → weighted backup V_p = Σ V_c N_c / Σ N_c.
Rollout steps are nodes of kind "rollout" (``<path>.g<i>``), not tree children.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Optional

from sglang_spex.tot.policies import mcts
from sglang_spex.tot.tree import KIND_ROLLOUT, Node


@dataclass
class Params:
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
        from sglang_spex.tot.search_spec import SearchSpecError

        for name in ("iterations", "max_depth", "branch", "roll_branch"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1:
                raise SearchSpecError(f"policy.{name}", "must be an integer >= 1")
        if not isinstance(self.roll_forward_steps, int) or self.roll_forward_steps < 0:
            raise SearchSpecError("policy.roll_forward_steps", "must be an integer >= 0")
        if not 0 <= self.alpha <= 1:
            raise SearchSpecError("policy.alpha", "must be in [0, 1]")
        if self.exploration_constant < 0:
            raise SearchSpecError("policy.exploration_constant", "must be >= 0")
        if self.target_answers is not None and (not isinstance(self.target_answers, int) or self.target_answers < 1):
            raise SearchSpecError("policy.target_answers", "must be an integer >= 1 or null")


def is_terminal(ctx, path: str) -> bool:
    st = ctx.stats[path]
    return st.terminal or (path != ctx.tree.root.path and st.value >= ctx.params.end_gate)


async def greedy_rollout(ctx, node: Node) -> float:
    """Partial rollout: the best value seen over ``roll_forward_steps`` greedy steps (``low`` if none)."""
    p: Params = ctx.params
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


async def run(ctx) -> None:
    p: Params = ctx.params
    root = ctx.tree.root.path
    for it in range(p.iterations):
        if ctx.should_stop() or (p.target_answers and len(ctx.tree.terminals()) >= p.target_answers):
            break
        rng = ctx.rng(f"iteration:{it}")
        leaf = mcts.select_rest(ctx.stats, root, rng, p.exploration_constant, p.inf)
        if is_terminal(ctx, leaf):
            ctx.stats[leaf].terminal = True
            if not p.target_answers:
                break  # solution found
            mcts.backup_rest(ctx.stats, leaf)
            ctx.sync_stats()
            continue
        await ctx.expand(ctx.tree.get(leaf), p.branch)
        if ctx.should_stop():
            break
        if not mcts.selectable(ctx.stats, leaf):
            ctx.stats[leaf].terminal = True  # nothing could be generated: treat as an end
        else:
            roll = mcts.best_child_rest(ctx.stats, leaf, rng, p.exploration_constant, p.inf)
            st = ctx.stats[roll]
            if not is_terminal(ctx, roll):
                st.value = mcts.rest_rollout_update(st.value, await greedy_rollout(ctx, ctx.tree.get(roll)), p.alpha)
            st.visits += 1
        mcts.backup_rest(ctx.stats, leaf)
        ctx.sync_stats()
