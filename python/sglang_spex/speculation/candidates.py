"""A speculative candidate (the node to generate ahead of the search) and the order refills issue them in."""

from __future__ import annotations

from typing import NamedTuple, Optional, Tuple

from sglang_spex.tot.tree import KIND_STEP, Node, child_path


class Candidate(NamedTuple):
    """A node to generate speculatively: the ``index``-th child (or rollout sample) of ``parent``."""

    parent: Node
    index: int
    distance: int  # prediction distance (DFS: rollouts ahead; BFS and partial rollouts: steps ahead)
    kind: str = KIND_STEP
    use: Optional[float] = None  # its expected use when known at planning time (partial rollouts)

    @property
    def path(self) -> str:
        return child_path(self.parent.path, self.index, self.kind)


def refill_key(expected_use: float, distance: int, cached_tokens: int, recency: int) -> Tuple[float, int, int, int]:
    """Sort key of a speculative candidate (ascending = issued first): expected use, then the nearer (needed
    sooner), then the prefix tokens the radix cache holds for it, then how recently its parent finished."""
    return (-round(expected_use, 9), int(distance), -int(cached_tokens), -int(recency))
