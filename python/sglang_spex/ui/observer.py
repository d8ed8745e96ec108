"""Watch one running search and describe its tree as the page's events (changes only).

The search service's progress events (``node``/``frontier``/``answer``/``result``) name a node by path and
engine status only. The page also draws each node's parent and text, whether SPEX made it (``adopted``), the
speculative nodes that are not (yet) in the primary tree (running, cancelled, never used), T3's state and the
live accounting. :class:`TreeObserver` reads them from the search's context (``SearchContext`` or
``SpexContext``, duck-typed: ``tree``, and for SPEX ``store``, ``acc``, ``early``) each time it is asked, and
returns what changed since the last call. Each call reads the whole tree, so a watched search has one observer,
asked at a bounded rate for all of its watchers (``srt/ui_routes.TreeFeed``), never one per watcher or per event. It also reads every entry that has left the store (``SpecStore.left``),
so a speculative node issued and cancelled between two calls (BFS strict cancel often aborts one before its first
token), or before the observer attached, is still drawn as cancelled.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional

from sglang_spex.tot.tree import CANCELLED, FAILED, PENDING, Node

# How the page shows a node (``show``): primary work, SPEX's work (running or never used, adopted, cancelled).
PRIMARY, SPECULATIVE, ADOPTED = "primary", "speculative", "adopted"
SHOWN = (PRIMARY, SPECULATIVE, ADOPTED, CANCELLED, FAILED)


def shown_status(status: str, speculative: bool) -> str:
    """How the page styles a node of the primary tree with this engine ``status``."""
    if status in (FAILED, CANCELLED):
        return status
    return ADOPTED if speculative else PRIMARY


def node_view(node: Node, ghost: bool = False, show: Optional[str] = None) -> Dict[str, Any]:
    """What the page draws for ``node`` (its result dict plus ``show``); ``ghost``: a speculative node outside
    the primary tree."""
    shown = show or shown_status(node.status, bool(node.extra.get("speculative")))
    return {**node.to_dict(), "show": shown, "ghost": ghost}


def _counters(accounting: Dict[str, Any]) -> Dict[str, Any]:
    """The accounting's scalar fields (its per-depth tables and time series stay for the result)."""
    return {k: v for k, v in accounting.items() if not isinstance(v, (list, dict))}


class TreeObserver:
    """Turns one search context into ``view`` events (a node drawn or redrawn) and ``state`` events."""

    def __init__(self, ctx: Any):
        self.ctx = ctx
        self._views: Dict[str, Dict[str, Any]] = {}
        self._state: Optional[Dict[str, Any]] = None
        self._left_read = 0  # entries of the store's ``left`` already read

    def _current(self) -> Dict[str, Dict[str, Any]]:
        tree = self.ctx.tree
        store = getattr(self.ctx, "store", None)
        views: Dict[str, Dict[str, Any]] = {}
        for node in list(tree):
            views[node.path] = node_view(node)
        for entry in list(store) if store is not None else []:
            in_tree = tree.nodes.get(entry.path)
            if in_tree is not None and in_tree.status != PENDING:
                continue  # the primary tree's node (adopted or made by the search itself) is what counts
            views[entry.path] = node_view(entry.node, ghost=in_tree is None, show=SPECULATIVE)
        for path, old in self._views.items():
            if path not in views and old["ghost"]:  # left the store without joining the tree: cancelled
                views[path] = {**old, "show": CANCELLED}
        left = getattr(store, "left", None) or []
        for entry in left[self._left_read :]:  # left before this call could see it: never joined the tree
            if entry.path not in views:
                views[entry.path] = node_view(entry.node, ghost=True, show=CANCELLED)
        self._left_read = len(left)
        return views

    def state(self) -> Dict[str, Any]:
        """Totals, the SPEX accounting (None for a baseline search) and T3's state."""
        ctx = self.ctx
        acc = getattr(ctx, "acc", None)
        early = getattr(ctx, "early", None)
        out: Dict[str, Any] = {
            "tokens_generated": ctx.tokens_generated,
            "num_requests": ctx.num_requests,
            "inflight": len(ctx.inflight),
            "stop_reason": ctx.stop_reason,
            "accounting": _counters(acc.to_dict()) if acc is not None else None,
            "t3": None,
        }
        if early is not None:
            out["t3"] = {
                "enabled": early.enabled,
                "answers": early.n,
                "min_answers": early.min_answers,
                "alpha": early.alpha,
                "mass": dict(early.mass),
                "stopped_answer": early.stopped_answer,
            }
        return out

    def changes(self) -> List[Dict[str, Any]]:
        """Events for everything that changed since the last call (all of it on the first call)."""
        events: List[Dict[str, Any]] = []
        views = self._current()
        for path, view in views.items():
            if self._views.get(path) != view:
                events.append({"event": "view", "node": view})
        self._views = views
        state = self.state()
        if state != self._state:
            events.append({"event": "state", **state})
            self._state = state
        return events

    def ghosts(self) -> List[Dict[str, Any]]:
        """The speculative nodes outside the primary tree seen so far (running, cancelled or never used)."""
        return [v for v in self._views.values() if v["ghost"]]

    def adopted(self) -> List[str]:
        """Paths of the primary tree's nodes SPEX made (adopted from speculation)."""
        return [p for p, v in self._views.items() if v["show"] == ADOPTED and not v["ghost"]]
