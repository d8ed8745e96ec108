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
How many depths (:func:`planned_levels`): each next one while its resolved hit rate (with a 0.5 prior while
unmeasured) is at least ``MIN_DEEP_HIT_RATE``, up to ``bfs_lookahead`` (a search asks for at most
``settings.MAX_LOOKAHEAD``, 64).

One prediction imputes every unknown score with its depth's mean, so a parent near the cut flips in and out of
the predicted tree as its siblings finish, and while it is out nothing below it is planned. :func:`use_chances`
therefore runs the prediction in several *worlds*: world 0 imputes the mean, the others draw each unknown score
(a node being generated: its parent's score plus a parent-to-child step drawn from its depth's known nodes; one
not generated yet: a score known at its depth). A child's chance of being in the baseline's tree is its average
over the worlds of ``(w - i) / w`` (index i of a parent given width w) times its parent's chance in that world. The
runner divides the worlds among the searches sharing an engine (the extra worlds add unlikely children, which only
a large share reaches; eight worlds cost ~0.6 ms per prediction at width 16, one ~0.06 ms).
A frontier rule that runs a solver (ETS's ILP) is planned the same way, over the same worlds and depths: within
one prediction it is solved once per depth's candidate set and width (:func:`shared_keep`), and the runner runs
such a prediction in a thread, one at a time per search.
"""

from __future__ import annotations

import random
from typing import Callable, Dict, List, Optional, Sequence, Tuple

from sglang_spex.speculation.accounting import MIN_DEEP_HIT_RATE
from sglang_spex.speculation.settings import MAX_LOOKAHEAD
from sglang_spex.tot.policies.rebase import Rebase
from sglang_spex.tot.tree import CANCELLED, DONE, FAILED, Node, child_path


def remaining_width(width: int, finished_before: int) -> int:
    return max(0, width - finished_before)


def child_index(path: str) -> int:
    """A step node's index among its siblings (the last component of its path)."""
    return int(path.rsplit(".", 1)[1])


WORLDS = 8  # worlds per prediction

Chances = Dict[str, List[float]]  # parent path -> chance that its child i is in the baseline's tree
KeepRule = Callable[[Sequence[Node], int], List[bool]]  # a policy's frontier rule (ETS: its ILP): keep each node?


def shared_keep(policy: Rebase) -> Optional[KeepRule]:
    """The policy's frontier rule (``predict_keep``), memoised on (candidate paths, width): it reads only the
    candidates' scores and texts, so the worlds of one prediction that agree on a depth share one solve."""
    rule = getattr(policy, "predict_keep", None)
    if rule is None:
        return None
    memo: Dict[Tuple[Tuple[str, ...], int], List[bool]] = {}

    def keep(cands: Sequence[Node], width: int) -> List[bool]:
        key = (tuple(n.path for n in cands), int(width))
        if key not in memo:
            memo[key] = list(rule(cands, width))
        return memo[key]

    return keep


def predicted_widths(
    policy: Rebase,
    level: Sequence[Node],
    width_left: int,
    unseen: int = 0,
    draw: Optional[random.Random] = None,
    keep: Optional[KeepRule] = None,
) -> Dict[str, int]:
    """Width per scored, unfinished node of the current depth, from the scores known so far.

    Siblings still generating (and ``unseen`` ones not generated yet) are counted with the mean known score (they
    will compete for the same width), so an early finisher is not handed the whole width; with ``draw``, an unseen
    one with a known score drawn at random, a generating one with :func:`drawn_from_parents`. ``keep``: the
    frontier rule to apply first (default: the policy's ``predict_keep``, if it has one).
    """
    cands = [n for n in level if n.status == DONE and not n.is_terminal]
    pending = [n for n in level if n.status not in (DONE, FAILED, CANCELLED)]
    if not cands:
        return {}
    scores = [policy.score(n) for n in cands]
    if draw is None:
        guesses = [float(sum(scores) / len(scores))] * (unseen + len(pending))
    else:
        guesses = [draw.choice(scores) for _ in range(unseen)] + drawn_from_parents(policy, level, pending, draw)
    keep_rule = keep or getattr(policy, "predict_keep", None)
    kept = [i for i, k in enumerate(keep_rule(cands, width_left) if keep_rule else [True] * len(cands)) if k]
    widths = policy.predict_widths([scores[i] for i in kept] + guesses, width_left)
    out = {n.path: 0 for n in cands}
    for i, w in zip(kept, widths):
        out[cands[i].path] = w
    return out


def drawn_from_parents(
    policy: Rebase, level: Sequence[Node], pending: Sequence[Node], draw: random.Random
) -> List[float]:
    """A drawn score for each pending node: its parent's score plus a step (child minus parent score) drawn from
    the known nodes of its depth, within [0, 1] (a child's reward follows its parent's)."""
    steps = [policy.score(n) - policy.score(n.parent) for n in level if n.status == DONE and n.parent is not None]
    # rounded: a step drawn back onto its own parent gives the known score exactly (the allocation ranks by score)
    return [min(1.0, max(0.0, round(policy.score(n.parent) + draw.choice(steps), 12))) for n in pending]


def predicted_levels(
    policy: Rebase, level: Sequence[Node], below: Dict[str, List[Node]], width: int, levels: int
) -> Dict[str, int]:
    """Predicted widths over ``levels`` depths, the undecided one (``level``, all its nodes) first.

    ``width``: the search's width left above that depth; each depth's terminal nodes take one unit each.
    ``below``: the speculative children known per parent path. The next depth holds the children inside their
    parent's predicted width; the rest of its ``width`` nodes are not generated yet (pending)."""
    out: Dict[str, int] = {}
    for widths in _levels(policy, level, _indexed(below), width, levels, None, shared_keep(policy)):
        out.update({p: w for p, w in widths.items() if w > 0})
    return out


def _indexed(below: Dict[str, List[Node]]) -> Dict[str, List[Tuple[int, Node]]]:
    return {p: [(child_index(c.path), c) for c in cs] for p, cs in below.items()}


def _levels(
    policy: Rebase,
    level: Sequence[Node],
    below: Dict[str, List[Tuple[int, Node]]],
    width: int,
    levels: int,
    draw: Optional[random.Random],
    keep: Optional[KeepRule],
):
    """The predicted widths of each depth in turn (one world: ``draw`` None imputes the mean)."""
    unseen = 0
    for _ in range(levels):
        width -= sum(1 for n in level if n.status == DONE and n.is_terminal)
        if width <= 0 or not level:
            return
        widths = predicted_widths(policy, level, width, unseen, draw, keep)
        yield widths
        level = [c for n in level for i, c in below.get(n.path, ()) if i < widths.get(n.path, 0)]
        unseen = max(0, width - len(level))


def planned_levels(lookahead: int, resolved_rate: Callable[[int], float], max_levels: Optional[int] = None) -> int:
    """Depths to predict: the undecided one, plus each next one while its hit rate at that distance (2, 3, ...)
    says speculating there pays, up to ``lookahead``. ``resolved_rate`` should count resolved nodes only (adopted,
    or cancelled when their depth was decided): a node two depths ahead waits two decisions for its fate.

    A distance never measured has the rate's prior (0.5, above the floor), so the plan runs to ``lookahead``: it is
    capped at :data:`~sglang_spex.speculation.settings.MAX_LOOKAHEAD` (what a search may ask for; this runs on the
    event loop once per finished node) and at ``max_levels``, the depths the search has left, when the caller
    knows them."""
    limit = min(int(lookahead), MAX_LOOKAHEAD)
    if max_levels is not None:
        limit = min(limit, max(1, int(max_levels)))
    levels = 1
    while levels < limit and resolved_rate(levels + 1) >= MIN_DEEP_HIT_RATE:
        levels += 1
    return levels


def width_chances(width: int) -> List[float]:
    """One world's chance of child i of a parent given ``width``: ``(width - i) / width``."""
    return [(width - i) / width for i in range(width)]


def use_chances(
    policy: Rebase,
    level: Sequence[Node],
    below: Dict[str, List[Node]],
    width: int,
    levels: int,
    worlds: int = WORLDS,
    seed: str = "",
) -> Chances:
    """Chance that child i of each planned parent is in the baseline's tree, over ``worlds`` worlds (world 0: the
    mean imputation of :func:`predicted_levels`; the rest draw unknown scores, seeded by ``seed``)."""
    draw, keep = random.Random(seed), shared_keep(policy)
    indexed = _indexed(below)
    sums: Dict[str, List[float]] = {}
    for world in range(max(1, worlds)):
        chance: Dict[str, float] = {}  # this world's chance of each node of the depth being predicted
        for widths in _levels(policy, level, indexed, width, levels, None if world == 0 else draw, keep):
            for path, w in widths.items():
                if w <= 0:
                    continue
                parent_chance = chance.get(path, 1.0)  # a node of the undecided depth is in the tree
                acc = sums.setdefault(path, [])
                if len(acc) < w:
                    acc.extend([0.0] * (w - len(acc)))
                for i, c in enumerate(width_chances(w)):
                    chance[child_path(path, i)] = joint = parent_chance * c
                    acc[i] += joint
    return {p: [c / max(1, worlds) for c in acc] for p, acc in sums.items()}


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
