"""TreeObserver's view of a search context: changes only, adopted / speculative / cancelled nodes (no server)."""

from __future__ import annotations

from types import SimpleNamespace

from sglang_spex.speculation.store import SpecEntry, SpecStore
from sglang_spex.tot.tree import DONE, GENERATING, Node, Tree
from sglang_spex.ui.observer import TreeObserver


def entry(node: Node) -> SimpleNamespace:
    return SimpleNamespace(path=node.path, node=node)


def test_observer_reports_changes_and_speculative_nodes():
    tree = Tree(0)
    a = tree.child(tree.root, 0)
    a.status, a.text, a.reward = DONE, "step a", 0.5
    spec_b = Node(path="r.1", parent=tree.root, status=GENERATING)  # speculative, outside the tree
    store = [entry(spec_b)]
    ctx = SimpleNamespace(tree=tree, store=store, tokens_generated=3, num_requests=1, inflight=set(), stop_reason=None)
    obs = TreeObserver(ctx)
    first = obs.changes()
    views = {e["node"]["path"]: e["node"] for e in first if e["event"] == "view"}
    assert set(views) == {"r", "r.0", "r.1"} and [e["event"] for e in first].count("state") == 1
    assert views["r.0"]["show"] == "primary" and views["r.0"]["text"] == "step a"
    assert views["r.1"]["show"] == "speculative" and views["r.1"]["ghost"]
    assert obs.changes() == []  # nothing changed

    # r.1 is adopted: it joins the tree with SPEX's mark and leaves the store
    b = tree.child(tree.root, 1)
    b.status, b.extra = DONE, {"speculative": True}
    store.clear()
    # r.0.0 speculated, then cancelled (left the store without joining the tree)
    store.append(entry(Node(path="r.0.0", parent=a, status=GENERATING)))
    obs.changes()
    store.clear()
    last = {e["node"]["path"]: e["node"] for e in obs.changes() if e["event"] == "view"}
    assert set(last) == {"r.0.0"} and last["r.0.0"]["show"] == "cancelled" and last["r.0.0"]["ghost"]
    assert obs.adopted() == ["r.1"] and [g["path"] for g in obs.ghosts()] == ["r.0.0"]


def test_observer_draws_a_node_issued_and_cancelled_between_two_calls():
    """BFS strict cancel often aborts a speculative node before its first token, between two of the watcher's
    reads, or before the page attached at all: the store keeps what left it, so the page still draws it as
    cancelled; an adopted one joins the tree instead."""
    tree = Tree(0)
    a = tree.child(tree.root, 0)
    a.status = DONE
    store = SpecStore()
    ctx = SimpleNamespace(tree=tree, store=store, tokens_generated=0, num_requests=1, inflight=set(), stop_reason=None)

    def issue(path):
        store.entries[path] = SpecEntry(node=Node(path=path, parent=a, status=GENERATING), distance=1)

    issue("r.0.2")
    store.pop("r.0.2")  # cancelled before any observer attached
    obs = TreeObserver(ctx)
    first = {e["node"]["path"]: e["node"] for e in obs.changes() if e["event"] == "view"}
    assert first["r.0.2"]["show"] == "cancelled" and first["r.0.2"]["ghost"]
    for path in ("r.0.0", "r.0.1"):  # issued and popped with no read in between
        issue(path)
    store.pop("r.0.1")  # cancelled
    adopted = tree.child(a, 0)
    adopted.status, adopted.extra = DONE, {"speculative": True}
    store.pop("r.0.0")  # adopted
    views = {e["node"]["path"]: e["node"] for e in obs.changes() if e["event"] == "view"}
    assert views["r.0.1"]["show"] == "cancelled" and views["r.0.1"]["ghost"]
    assert views["r.0.0"]["show"] == "adopted" and not views["r.0.0"]["ghost"]
    assert sorted(g["path"] for g in obs.ghosts()) == ["r.0.1", "r.0.2"] and obs.changes() == []  # drawn once
    late = TreeObserver(ctx)  # a page attaching now draws the same tree
    late.changes()
    assert late.ghosts() == obs.ghosts() and late.adopted() == obs.adopted() == ["r.0.0"]
