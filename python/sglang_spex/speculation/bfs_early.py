"""T1 BFS: expand early-finished branches of the current depth, strictly cancel the misses.

When a node of the current depth has been generated and scored while its siblings are still running, the
policy's own width prediction (:meth:`~sglang_spex.tot.policies.rebase.Rebase.predict_widths`: REBASE's
softmax over rewards) over the scores known so far gives that node's predicted width; a policy with a frontier
rule of its own (ETS: ``predict_keep``, its ILP) first drops the scored nodes that rule would drop. Its children
up to that width are generated at once. When the real frontier is decided,
speculative children with index < the real width are kept (hits when the policy asks for them) and every
other one is cancelled immediately, with everything speculated below it.

Deeper levels (``bfs_lookahead`` > 1): a speculative child that finished and was scored is itself a node of the
next depth, so the same prediction runs there (:func:`predicted_levels`): the next depth's known nodes are the
speculative children inside their parents' predicted widths, and the ones not generated yet count as pending.
"""

from __future__ import annotations

from typing import Dict, List, Sequence, Tuple

from sglang_spex.tot.policies.rebase import Rebase
from sglang_spex.tot.tree import CANCELLED, DONE, FAILED, Node


def remaining_width(width: int, finished_before: int) -> int:
    return max(0, width - finished_before)


def child_index(path: str) -> int:
    """A step node's index among its siblings (the last component of its path)."""
    return int(path.rsplit(".", 1)[1])


def predicted_widths(policy: Rebase, level: Sequence[Node], width_left: int, unseen: int = 0) -> Dict[str, int]:
    """Width per scored, unfinished node of the current depth, from the scores known so far.

    Siblings still generating (and ``unseen`` ones not generated yet) are counted with the mean known score (they
    will compete for the same width), so an early finisher is not handed the whole width.
    """
    cands = [n for n in level if n.status == DONE and not n.is_terminal]
    pending = unseen + sum(1 for n in level if n.status not in (DONE, FAILED, CANCELLED))
    if not cands:
        return {}
    scores = [policy.score(n) for n in cands]
    guess = float(sum(scores) / len(scores))
    keep_rule = getattr(policy, "predict_keep", None)
    keep = keep_rule(cands, width_left) if keep_rule is not None else [True] * len(cands)
    kept = [i for i, k in enumerate(keep) if k]
    widths = policy.predict_widths([scores[i] for i in kept] + [guess] * pending, width_left)
    out = {n.path: 0 for n in cands}
    for i, w in zip(kept, widths):
        out[cands[i].path] = w
    return out


def predicted_levels(
    policy: Rebase, level: Sequence[Node], below: Dict[str, List[Node]], width: int, levels: int
) -> Dict[str, int]:
    """Predicted widths over ``levels`` depths, the undecided one (``level``, all its nodes) first.

    ``width``: the search's width left above that depth; each depth's terminal nodes take one unit each.
    ``below``: the speculative children known per parent path. The next depth holds the children inside their
    parent's predicted width; the rest of its ``width`` nodes are not generated yet (pending)."""
    out: Dict[str, int] = {}
    unseen = 0
    for _ in range(levels):
        width -= sum(1 for n in level if n.status == DONE and n.is_terminal)
        if width <= 0 or not level:
            break
        widths = predicted_widths(policy, level, width, unseen)
        out.update({p: w for p, w in widths.items() if w > 0})
        level = [c for n in level for c in below.get(n.path, ()) if child_index(c.path) < widths.get(n.path, 0)]
        unseen = max(0, width - len(level))
    return out


def predict_is_costly(policy: Rebase) -> bool:
    """Whether the prediction runs a solver (ETS's ILP): then it belongs off the event loop."""
    return getattr(policy, "predict_keep", None) is not None


def split_on_frontier(
    spec_children: Sequence[Tuple[str, str, int]], chosen: Dict[str, int]
) -> Tuple[List[str], List[str]]:
    """(keep, cancel) among speculative children given as (path, parent_path, index) once widths are final."""
    keep, cancel = [], []
    for path, parent, index in spec_children:
        (keep if index < chosen.get(parent, 0) else cancel).append(path)
    return keep, cancel
