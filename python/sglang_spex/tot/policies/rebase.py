"""REBASE (reward-balanced search): BFS whose per-node width follows a softmax over rewards.

Per depth: every finished node (answer or token limit) takes one unit of width away; the remaining width is
allocated over the unfinished nodes by :func:`allocate_widths` and all of them expand at once. Stops when the
width is used up, nothing is left to expand, or at ``max_depth``. :class:`Rebase` is also the BFS loop ETS
runs with its own frontier choice.
"""

from __future__ import annotations

import asyncio
import math
from dataclasses import dataclass
from typing import List, Sequence, Tuple

from sglang_spex.tot.policies.base import Policy, SearchHost
from sglang_spex.tot.tree import DONE, Node
from sglang_spex.tot.validation import check_finite, check_int

EPS = 1e-9  # guards ceil() against float round-up (e.g. 2.0000000001)


@dataclass
class RebaseParams:
    width: int = 16
    softmax_temperature: float = 0.2
    max_depth: int = 25

    def validate(self) -> None:
        check_int(self.width, "policy.width", 1)
        check_finite(self.softmax_temperature, "policy.softmax_temperature", 0, above=True)
        check_int(self.max_depth, "policy.max_depth", 1)


def allocate_widths(scores: Sequence[float], width: int, temperature: float) -> List[int]:
    """REBASE allocation, returned in the input order.

    Walk the candidates by score, highest first: n_i = ceil(W · e_i / Σ_remaining e) with e_i = exp(s_i / T),
    then W -= n_i and Σ_remaining -= e_i. Ties keep the input order.
    """
    n = len(scores)
    out = [0] * n
    if n == 0 or width <= 0:
        return out
    s = [float(x) for x in scores]  # plain floats: at a few dozen candidates numpy's per-call cost dominates
    top = max(s)
    e = [math.exp((x - top) / temperature) for x in s]  # same ratios as exp(s/T), without overflow
    order = sorted(range(n), key=lambda i: -s[i])
    remaining, w = math.fsum(e), int(width)
    for i in order:
        if w <= 0 or remaining <= 0:
            break
        k = min(w, math.ceil(w * e[i] / remaining - EPS))
        out[i] = k
        w -= k
        remaining -= e[i]
    return out


class Rebase(Policy):
    """The BFS family: ``select`` gives each frontier candidate its width, ``run`` expands them depth by depth."""

    name = "rebase"
    params_type = RebaseParams

    @property
    def width(self) -> int:
        """The search's total width (answers it may finish with)."""
        return int(self.params.width)

    @staticmethod
    def score(node: Node) -> float:
        """A candidate's score: its reward (the root counts 1, an unscored node 0)."""
        return 1.0 if node.is_root else float(node.reward if node.reward is not None else 0.0)

    def predict_widths(self, scores: Sequence[float], width: int) -> List[int]:
        """The width each score would get from scores alone: REBASE's softmax allocation."""
        return allocate_widths(scores, width, self.params.softmax_temperature)

    async def select(self, ctx: SearchHost, cands: List[Node], width: int, depth: int) -> List[int]:
        """The width of each candidate of ``depth`` (same order)."""
        return self.predict_widths([self.score(n) for n in cands], width)

    async def expand(self, ctx: SearchHost, chosen: List[Tuple[Node, int]]) -> List[Node]:
        """Generate every chosen candidate's children at once; the next frontier, in order."""
        batches = await asyncio.gather(*(ctx.expand(n, w) for n, w in chosen))
        return [c for b in batches for c in b]

    @staticmethod
    def split_finished(frontier: Sequence[Node]) -> Tuple[List[Node], List[Node]]:
        """(finished, candidates) among the frontier's generated nodes; failed/cancelled nodes are dropped."""
        done = [n for n in frontier if n.status == DONE]
        return [n for n in done if n.is_terminal], [n for n in done if not n.is_terminal]

    async def run(self, ctx: SearchHost) -> None:
        width, depth, frontier = self.width, 0, [ctx.tree.root]
        while True:
            if depth == 0:
                cands = frontier
            else:
                finished, cands = self.split_finished(frontier)
                width -= len(finished)
            if width <= 0 or not cands or ctx.should_stop():
                break
            widths = [width] if depth == 0 else await self.select(ctx, cands, width, depth)
            chosen = [(n, w) for n, w in zip(cands, widths) if w > 0]
            ctx.on_frontier_decided(depth, chosen)
            frontier = await self.expand(ctx, chosen)
            depth += 1
            if depth >= self.max_depth:
                break
