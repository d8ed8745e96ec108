"""The MCTS policy interface shared by rSTAR and REST-MCTS: seeded rollout streams, selection, and the
prediction hooks SPEX's DFS lookahead drives.

Rollout ``i`` draws all its randomness from ``rollout_rng(make_rng, i)``, so anyone holding the search's
``make_rng`` (the real loop, or the lookahead on a copy of the statistics) gets the same stream. The
lookahead calls :meth:`MCTSPolicy.predict_rollout` (built from the policy's own ``select``/``simulate``)
and :meth:`MCTSPolicy.virtual_backup` on a copy; it never reimplements a policy.
"""

from __future__ import annotations

import abc
import random
from typing import Callable, ClassVar, Generator, List, Optional

from sglang_spex.tot.policies.base import Policy, SearchHost, Stats
from sglang_spex.tot.tree import Node
from sglang_spex.tot.validation import check

RolloutWalk = Generator[str, None, List[str]]
"""A rollout on statistics: yields each node it needs expanded (resume once it is), returns the rollout path
(root first)."""


def selectable(stats: Stats, path: str) -> List[str]:
    """The children of ``path`` that did not fail, in creation order."""
    return [c for c in stats[path].children if not stats[c].failed]


def check_target_answers(value: Optional[int]) -> None:
    """``target_answers`` is None or an integer >= 1."""
    ok = value is None or (isinstance(value, int) and not isinstance(value, bool) and value >= 1)
    check(ok, "policy.target_answers", "must be an integer >= 1 or null")


class MCTSPolicy(Policy):
    """An MCTS policy: one rollout at a time, each with its own seeded random stream."""

    rng_label: ClassVar[str]  # rollout i draws from the search's stream "<rng_label>:<i>"

    @property
    def branch(self) -> int:
        """Children generated per expansion."""
        return int(self.params.branch)

    def rollout_rng(self, make_rng: Callable[[str], random.Random], index: int) -> random.Random:
        """The random stream of rollout ``index``, from the search's ``make_rng(label)``."""
        return make_rng(f"{self.rng_label}:{index}")

    @property
    def num_rollouts(self) -> int:
        """Rollouts the search runs at most."""
        return int(self.params.num_rollouts)

    def enough_answers(self, num_answers: int) -> bool:
        """``target_answers`` answer nodes exist (never, without a target)."""
        target = self.params.target_answers
        return bool(target) and num_answers >= target

    def terminal_reward(self, node: Node) -> float:
        """The reward a rollout ending at the finished ``node`` backs up (0 where the policy backs up values)."""
        return 0.0

    @abc.abstractmethod
    def select(self, stats: Stats, root: str, rng: random.Random) -> List[str]:
        """The path (root first) the next rollout descends before it expands or simulates."""

    @abc.abstractmethod
    async def expand(self, ctx: SearchHost, path: str) -> None:
        """Generate the children a rollout at ``path`` needs."""

    @abc.abstractmethod
    def predict_rollout(self, stats: Stats, root: str, rng: random.Random) -> RolloutWalk:
        """The next rollout as far as it is known before any new text exists (for SPEX's DFS lookahead)."""

    @abc.abstractmethod
    def virtual_backup(self, stats: Stats, path: List[str], reward: float) -> None:
        """The backup a predicted rollout along ``path`` would do, with ``reward`` where its end is known
        (else 0, a virtual loss)."""
