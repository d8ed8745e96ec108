"""The speculative node store: nodes generated ahead of the search, keyed by their tree path.

A speculative node is built exactly as the primary search would build it (same path → same prompt and seed, the
same rid up to its role suffix), but stays detached from the primary tree until the search asks for that path: then
it is *adopted* (its result copied into the primary node) instead of regenerated. Entries still generating can be
adopted too (the primary awaits the in-flight request) or cancelled (BFS strict cancel).
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import Awaitable, Callable, Dict, Iterator, List, Optional, Set

from sglang_spex.tot.tree import Node

logger = logging.getLogger(__name__)

RUNNING = "running"
READY = "ready"
CANCELLED = "cancelled"
FAILED = "failed"

# Result fields copied from a speculative node into the primary node on adoption.
ADOPTED_FIELDS = (
    "text",
    "status",
    "num_tokens",
    "prompt_tokens",
    "cached_tokens",
    "logprobs",
    "finish_reason",
    "reward",
    "is_terminal",
    "answer",
    "error",
    "latency",
    "rid",
    "seed",
)


@dataclass(eq=False)
class SpecEntry:
    node: Node
    distance: int  # how many steps ahead of the primary search it was predicted (1 = next)
    task: Optional["asyncio.Task"] = None
    state: str = RUNNING
    issued_at: float = field(default_factory=time.monotonic)  # SpecStore.issue sets it from the store's clock
    cancel_requested_at: Optional[float] = None

    @property
    def path(self) -> str:
        return self.node.path


class SpecStore:
    """Speculative entries by path; one per path at most. ``left`` keeps every entry that has left the store
    (adopted or cancelled), in order, for the search's lifetime: a watcher that reads it from any point on misses
    none, however short-lived, and one that attaches late sees what happened before it."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self.entries: Dict[str, SpecEntry] = {}
        self.left: List[SpecEntry] = []
        self.barred: Set[str] = set()  # paths whose speculative request failed: not issued again (``drop``)

    def __contains__(self, path: str) -> bool:
        return path in self.entries

    def __iter__(self) -> Iterator[SpecEntry]:
        return iter(list(self.entries.values()))

    def get(self, path: str) -> Optional[SpecEntry]:
        return self.entries.get(path)

    def issue(self, node: Node, distance: int, run: Callable[[Node], Awaitable[None]]) -> SpecEntry:
        """Start generating ``node`` speculatively; ``run(node)`` fills it in place."""
        if node.path in self.entries:
            raise KeyError(f"speculative node {node.path} already issued")
        entry = SpecEntry(node=node, distance=distance, issued_at=self.clock())

        async def _run() -> None:
            try:
                await run(node)
                if entry.state == RUNNING:
                    entry.state = READY if node.status == "done" else FAILED
            except asyncio.CancelledError:
                entry.state = CANCELLED
                raise
            except Exception:  # a bug in ``run``: the entry must not hold its slot as running for the search's rest
                logger.exception("spex: speculative node %s failed", node.path)
                entry.state = FAILED

        entry.task = asyncio.ensure_future(_run())
        self.entries[node.path] = entry
        return entry

    def pop(self, path: str) -> Optional[SpecEntry]:
        entry = self.entries.pop(path, None)
        if entry is not None:
            self.left.append(entry)
        return entry

    def drop(self, node: Node, bar: bool) -> bool:
        """Take out ``node``'s entry, whose request ended without a result; False if it had already left (cancelled
        or adopted). ``bar``: its path goes into ``barred``."""
        entry = self.entries.get(node.path)
        if entry is None or entry.node is not node:
            return False
        self.pop(node.path)
        if bar:
            self.barred.add(node.path)
        return True

    def running(self) -> List[SpecEntry]:
        return [e for e in self.entries.values() if e.state == RUNNING]

    def children_of(self, parent_path: str) -> List[SpecEntry]:
        prefix = parent_path + "."
        return [e for p, e in self.entries.items() if p.startswith(prefix) and "." not in p[len(prefix) :]]

    def subtree(self, path: str) -> List[SpecEntry]:
        prefix = path + "."
        return [e for p, e in self.entries.items() if p == path or p.startswith(prefix)]


def adopt(primary: Node, spec: Node) -> None:
    """Copy a speculative node's result into the primary tree's node at the same path."""
    if primary.path != spec.path:
        raise ValueError(f"cannot adopt {spec.path} into {primary.path}")
    for name in ADOPTED_FIELDS:
        setattr(primary, name, getattr(spec, name))
    primary.extra = {**spec.extra, **primary.extra, "speculative": True}
