"""T1 BFS: expand early-finished branches of the current depth, strictly cancel the misses.

When a node of the current depth has been generated and scored while its siblings are still running, the
policy's own width prediction (:meth:`~sglang_spex.tot.policies.rebase.Rebase.predict_widths`: REBASE's
softmax over rewards, which ETS uses as its predictor too) over the scores known so far gives that node's
predicted width; its children up to that width are generated at once. When the real frontier is decided,
speculative children with index < the real width are kept (hits when the policy asks for them) and every
other one is cancelled immediately.
"""

from __future__ import annotations

from typing import Dict, List, Sequence, Tuple

from sglang_spex.tot.policies.rebase import Rebase
from sglang_spex.tot.tree import CANCELLED, DONE, FAILED, Node


def remaining_width(width: int, finished_before: int) -> int:
    return max(0, width - finished_before)


def predicted_widths(policy: Rebase, level: Sequence[Node], width_left: int) -> Dict[str, int]:
    """Width per scored, unfinished node of the current depth, from the scores known so far.

    Siblings still generating are counted with the mean known score (they will compete for the same width),
    so an early finisher is not handed the whole width.
    """
    cands = [n for n in level if n.status == DONE and not n.is_terminal]
    pending = sum(1 for n in level if n.status not in (DONE, FAILED, CANCELLED))
    if not cands:
        return {}
    scores = [policy.score(n) for n in cands]
    guess = float(sum(scores) / len(scores))
    widths = policy.predict_widths(scores + [guess] * pending, width_left)
    return {n.path: w for n, w in zip(cands, widths)}


def split_on_frontier(
    spec_children: Sequence[Tuple[str, str, int]], chosen: Dict[str, int]
) -> Tuple[List[str], List[str]]:
    """(keep, cancel) among speculative children given as (path, parent_path, index) once widths are final."""
    keep, cancel = [], []
    for path, parent, index in spec_children:
        (keep if index < chosen.get(parent, 0) else cancel).append(path)
    return keep, cancel
