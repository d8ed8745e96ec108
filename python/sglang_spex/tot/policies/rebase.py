"""REBASE (reward-balanced search): BFS whose per-node width follows a softmax over rewards.

Per depth: every finished node (answer or token limit) takes one unit of width away; the remaining width is
allocated over the unfinished nodes by :func:`allocate_widths` and all of them expand at once. Stops when the
width is used up, nothing is left to expand, or at ``max_depth``.
"""

from __future__ import annotations

import asyncio
import math
from dataclasses import dataclass
from typing import List, Sequence, Tuple

import numpy as np

from sglang_spex.tot.tree import DONE, Node

EPS = 1e-9  # guards ceil() against float round-up (e.g. 2.0000000001)


@dataclass
class Params:
    width: int = 16
    softmax_temperature: float = 0.2
    max_depth: int = 25

    def validate(self) -> None:
        from sglang_spex.tot.search_spec import SearchSpecError

        if not isinstance(self.width, int) or self.width < 1:
            raise SearchSpecError("policy.width", "must be an integer >= 1")
        if self.softmax_temperature <= 0:
            raise SearchSpecError("policy.softmax_temperature", "must be > 0")
        if not isinstance(self.max_depth, int) or self.max_depth < 1:
            raise SearchSpecError("policy.max_depth", "must be an integer >= 1")


def allocate_widths(scores: Sequence[float], width: int, temperature: float) -> List[int]:
    """REBASE allocation, returned in the input order.

    Walk the candidates by score, highest first: n_i = ceil(W · e_i / Σ_remaining e) with e_i = exp(s_i / T),
    then W -= n_i and Σ_remaining -= e_i. Ties keep the input order.
    """
    n = len(scores)
    out = [0] * n
    if n == 0 or width <= 0:
        return out
    s = np.asarray(scores, dtype=float)
    e = np.exp((s - s.max()) / temperature)  # same ratios as exp(s/T), without overflow
    order = sorted(range(n), key=lambda i: -s[i])
    remaining, w = float(e.sum()), int(width)
    for i in order:
        if w <= 0 or remaining <= 0:
            break
        k = min(w, math.ceil(w * float(e[i]) / remaining - EPS))
        out[i] = k
        w -= k
        remaining -= float(e[i])
    return out


def split_finished(frontier: Sequence[Node]) -> Tuple[List[Node], List[Node]]:
    """(finished, candidates) among the frontier's generated nodes; failed/cancelled nodes are dropped."""
    done = [n for n in frontier if n.status == DONE]
    return [n for n in done if n.is_terminal], [n for n in done if not n.is_terminal]


def node_score(node: Node) -> float:
    return 1.0 if node.is_root else float(node.reward if node.reward is not None else 0.0)


async def bfs(ctx, choose) -> None:
    """The REBASE/ETS loop; ``choose(ctx, candidates, width, depth)`` returns the width per candidate."""
    p = ctx.params
    width, depth, frontier = p.width, 0, [ctx.tree.root]
    while True:
        if depth == 0:
            cands = frontier
        else:
            finished, cands = split_finished(frontier)
            width -= len(finished)
        if width <= 0 or not cands or ctx.should_stop():
            break
        widths = [width] if depth == 0 else await choose(ctx, cands, width, depth)
        chosen = [(n, w) for n, w in zip(cands, widths) if w > 0]
        ctx.on_frontier_decided(depth, chosen)
        batches = await asyncio.gather(*(ctx.expand(n, w) for n, w in chosen))
        frontier = [c for b in batches for c in b]
        depth += 1
        if depth >= p.max_depth:
            break


async def _choose(ctx, cands: List[Node], width: int, depth: int) -> List[int]:
    return allocate_widths([node_score(n) for n in cands], width, ctx.params.softmax_temperature)


async def run(ctx) -> None:
    await bfs(ctx, _choose)
