"""T1 for REST-MCTS's partial rollouts: the rollout samples that follow the running expansion, speculated.

The rollout starts from the best new child (UCT of an unvisited child: its value + inf, so the highest reward) and
goes ``roll_forward_steps`` steps from the best of ``roll_branch`` samples each. While an expansion's children
finish, the samples below the best finished node of each step so far are candidates; their expected use is the
share of that step's siblings already finished (the best of them can still change).
"""

from __future__ import annotations

from typing import Callable, Iterable, List, Optional

from sglang_spex.speculation.candidates import Candidate
from sglang_spex.tot.tree import KIND_ROLLOUT, Node, child_path


def rollout_candidates(
    params: object,
    group: List[str],
    scored: Callable[[str], Optional[Node]],
    taken: Callable[[str], bool],
) -> Iterable[Candidate]:
    """Candidates below the expansion whose unvisited children are ``group`` (paths). ``scored(path)``: the finished
    node there if it has a reward; ``taken(path)``: already in the tree or issued."""
    steps, branch = getattr(params, "roll_forward_steps", 0), getattr(params, "roll_branch", 0)
    for step in range(steps if branch else 0):
        done = [n for n in map(scored, group) if n is not None]
        if not done:
            return
        best = max(done, key=lambda n: n.reward)  # the first of equals (step 0: the policy draws among them)
        if best.is_terminal:  # REST's rollout ends there (a node past end_gate is rolled out too)
            return
        start, use = len(best.rollouts), len(done) / len(group)
        for j in range(branch):
            path = child_path(best.path, start + j, KIND_ROLLOUT)
            if not taken(path):
                yield Candidate(best, start + j, step + 1, KIND_ROLLOUT, use)
        group = [child_path(best.path, start + j, KIND_ROLLOUT) for j in range(branch)]
