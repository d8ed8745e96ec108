"""What every policy shares: the per-node statistics a search keeps, and the :class:`Policy` interface.

The statistics live in a plain ``{path: Stat}`` dict (``SearchContext.stats``), apart from the node objects,
so SPEX's DFS lookahead can run a policy's own selection on a copy of them without touching the real search.
"""

from __future__ import annotations

import abc
import copy
import random
from dataclasses import dataclass, field
from typing import Any, ClassVar, Dict, List, Optional, Protocol

from sglang_spex.tot.tree import FAILED, KIND_STEP, Node, Tree


@dataclass
class Stat:
    path: str
    parent: Optional[str]
    depth: int = 0
    children: List[str] = field(default_factory=list)
    visits: int = 0  # N
    value: float = 0.0  # rSTAR: Q (sum of backed-up rewards); REST: V
    expanded: bool = False  # children generated (rStar "in parent2children"; REST "isFullyExpanded")
    explored: bool = False  # rStar: backed up at least once (or found terminal)
    terminal: bool = False
    failed: bool = False
    generating: bool = False  # a simulator skips nodes already being generated


Stats = Dict[str, Stat]


def copy_stats(stats: Stats) -> Stats:
    """A deep copy: changing it leaves ``stats`` as it was."""
    return copy.deepcopy(stats)


class SearchHost(Protocol):
    """What a policy uses of its search context (``tot.context.SearchContext``, which imports the policies)."""

    tree: Tree
    stats: Stats

    async def expand(self, parent: Node, n: int, kind: str = KIND_STEP) -> List[Node]: ...

    async def generate_node(self, parent: Node, index: int, kind: str = KIND_STEP) -> Node: ...

    def should_stop(self) -> bool: ...

    def rng(self, label: str) -> random.Random: ...

    def on_rollout(self, index: int) -> None: ...

    def on_frontier_decided(self, depth: int, chosen: List[Any]) -> None: ...

    def sync_stats(self) -> None: ...


class Policy(abc.ABC):
    """A search policy: its knobs (``params``, a dataclass of type ``params_type``) and its search loop."""

    name: ClassVar[str]
    params_type: ClassVar[type]

    def __init__(self, params: Any = None):
        self.params = self.params_type() if params is None else params

    @property
    def max_depth(self) -> int:
        """Depth at which a node is finished whatever its text."""
        return int(self.params.max_depth)

    @abc.abstractmethod
    async def run(self, ctx: SearchHost) -> None:
        """Search on ``ctx`` until the policy is done or ``ctx.should_stop()``."""

    def update_stat(self, st: Stat, node: Node) -> None:
        """Fold a generated (or failed) step node into its statistics."""
        st.terminal, st.failed = node.is_terminal, node.status == FAILED
