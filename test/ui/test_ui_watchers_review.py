"""Review: ``GET /tot/ui/events`` watchers and ``POST /tot/search`` streams cost the HTTP event loop and memory.

Each watcher used to re-read the whole tree (``to_dict`` per node) for every progress event, synchronously inside
the search's step, and queue the diff without bound; nothing capped watchers, and a streaming client's queue grew
with the search. Now one feed per watched search reads the tree at most every ``POLL_S`` for all its watchers, a
slow watcher holds a cursor (its pending changes coalesce) and still converges to the whole tree, the watchers are
capped (429), and a stream's pending events are bounded (never dropping the result). In process, plus one live
check on the tiny server.
"""

from __future__ import annotations

import asyncio
import gc
import json
import random
import socket
import threading
import time
import tracemalloc
from collections import OrderedDict
from types import SimpleNamespace
from typing import Any, AsyncIterator, Dict, List, Optional, Tuple

import pytest
import requests
from fastapi import FastAPI, Request
from fastapi.responses import StreamingResponse
from search.helpers import wait_until
from unit.fake_port import FakePort

from sglang_spex.speculation.store import SpecEntry, SpecStore
from sglang_spex.srt import search_service, ui_routes
from sglang_spex.srt.http_api import STATE_ATTR
from sglang_spex.srt.search_service import SearchHandle
from sglang_spex.tot.callback_server import CallbackRewardServer
from sglang_spex.tot.context import SearchContext
from sglang_spex.tot.search_spec import SearchSpec
from sglang_spex.tot.tree import CANCELLED, DONE, GENERATING, Node, Tree
from sglang_spex.ui.observer import TreeObserver, node_view

# ---------------------------------------------------------------- harness


class FakeSearch:
    """A search context grown by hand: a real tree and speculative store; ``publish`` sends progress events."""

    def __init__(self, seed: int = 0):
        self.tree = Tree(0)
        self.store = SpecStore()
        self.tokens_generated = self.num_requests = 0
        self.inflight: set = set()
        self.stop_reason: Optional[str] = None
        self.progress = None
        self.rng = random.Random(seed)
        self.cancelled: List[str] = []

    def grow(self, n: int) -> List[Node]:
        """``n`` new done nodes under random done nodes, each redrawn a few times (generating, then done)."""
        made = []
        for _ in range(n):
            parent = self.rng.choice([x for x in list(self.tree)[-64:] if x.status == DONE] or [self.tree.root])
            node = self.tree.child(parent, len(parent.children))
            node.status, node.text = GENERATING, "step "
            self.progress({"event": "node", "path": node.path, "status": node.status})
            node.status, node.text, node.reward, node.num_tokens = DONE, f"step {node.path} " * 4, 0.5, 16
            self.tokens_generated += 16
            self.num_requests += 1
            self.progress({"event": "node", "path": node.path, "status": node.status})
            made.append(node)
        return made

    def speculate_and_cancel(self, parent: Node) -> None:
        """A speculative child issued and cancelled between two reads (BFS strict cancel)."""
        path = f"{parent.path}.{len(parent.children) + 100 + len(self.cancelled)}"
        self.store.entries[path] = SpecEntry(node=Node(path=path, parent=parent, status=GENERATING), distance=1)
        self.store.pop(path)
        self.cancelled.append(path)

    def finish(self, handle: SearchHandle) -> None:
        nodes = [n.to_dict() for n in self.tree]
        handle.result = SimpleNamespace(to_dict=lambda: {"status": "done", "nodes": nodes})
        handle.status = "done"
        handle.publish({"event": "result", "result": handle.result.to_dict()})


def make_app(*handles: SearchHandle) -> FastAPI:
    app = FastAPI()
    searches = OrderedDict((h.id, h) for h in handles)
    setattr(app.state, STATE_ATTR, SimpleNamespace(searches=SimpleNamespace(searches=searches)))
    ui_routes.install(app)
    return app


def http_request(app: FastAPI, gone_after: Optional[float] = None) -> Request:
    """A Starlette request of ``app`` whose client goes away ``gone_after`` seconds from now (None: never)."""
    gone_at = None if gone_after is None else time.monotonic() + gone_after

    async def receive() -> Dict[str, Any]:
        if gone_at is not None and time.monotonic() >= gone_at:
            return {"type": "http.disconnect"}
        await asyncio.sleep(3600)  # nothing from the client yet
        return {"type": "http.disconnect"}

    scope = {"type": "http", "app": app, "method": "GET", "path": "/", "headers": [], "query_string": b""}
    return Request(scope, receive)


async def open_events(app: FastAPI, search_id: str, wait: float = 0.0, gone_after: Optional[float] = None) -> Any:
    return await ui_routes.get_events(http_request(app, gone_after), search_id, wait=wait)


def parse(frame: str) -> Dict[str, Any]:
    data = "\n".join(line[5:] for line in frame.split("\n") if line.startswith("data:"))
    return json.loads(data)


class Page:
    """One watcher as the page reads it: ``view`` events into ``nodes``, until the ``result``."""

    def __init__(self, response: StreamingResponse):
        self.body: AsyncIterator[str] = response.body_iterator
        self.nodes: Dict[str, Dict[str, Any]] = {}
        self.result: Optional[Dict[str, Any]] = None
        self.frames = 0

    async def read(self, limit: Optional[int] = None) -> None:
        """Read ``limit`` frames, or on to the stream's end (which must come right after the result)."""
        async for frame in self.body:
            if frame.startswith(":"):  # a keep-alive comment
                continue
            assert self.result is None
            self.frames += 1
            event = parse(frame)
            if event["event"] == "view":
                self.nodes[event["node"]["path"]] = event["node"]
            elif event["event"] == "result":
                self.result = event
            if limit is not None and self.frames >= limit:
                return

    def check_converged(self, search: FakeSearch) -> None:
        """Every node of the tree drawn as it is now, and every cancelled speculative node as cancelled."""
        assert self.result is not None
        tree = {n.path: node_view(n) for n in search.tree}
        assert {p: v for p, v in self.nodes.items() if not v["ghost"]} == tree
        ghosts = {p: v["show"] for p, v in self.nodes.items() if v["ghost"]}
        assert ghosts == {p: CANCELLED for p in search.cancelled}
        assert sorted(g["path"] for g in self.result["ui"]["ghosts"]) == sorted(search.cancelled)


@pytest.fixture
def walks(monkeypatch) -> Dict[str, int]:
    """Counts the observer's whole-tree reads (and those made inside a search's ``publish``)."""
    count = {"all": 0, "in_publish": 0}
    inside = [False]
    current, publish = TreeObserver._current, SearchHandle.publish

    def counted(self):
        count["all"] += 1
        count["in_publish"] += inside[0]
        return current(self)

    def publishing(self, event):
        inside[0] = True
        try:
            publish(self, event)
        finally:
            inside[0] = False

    monkeypatch.setattr(TreeObserver, "_current", counted)
    monkeypatch.setattr(SearchHandle, "publish", publishing)
    return count


# ---------------------------------------------------------------- one read per search, not per watcher


@pytest.mark.parametrize("n_watchers", [1, 16])
async def test_tree_reads_do_not_grow_with_watchers_or_events(walks, n_watchers):
    search = FakeSearch()
    handle = SearchHandle("s", search)
    search.grow(300)
    assert walks["all"] == 0  # nobody watches: a progress event costs no read
    app = make_app(handle)
    pages = [Page(await open_events(app, "s")) for _ in range(n_watchers)]
    readers = [asyncio.create_task(p.read()) for p in pages]
    began = time.monotonic()
    for _ in range(60):  # 60 × 5 nodes → 600 progress events over ~0.6 s
        search.grow(5)
        await asyncio.sleep(0.01)
    search.finish(handle)
    await asyncio.wait_for(asyncio.gather(*readers), 10)
    elapsed = time.monotonic() - began
    assert walks["in_publish"] == 0  # the search's own step never reads the tree
    # one read per POLL_S at most for all the watchers (old: one per watcher per event, 600 × n_watchers)
    assert walks["all"] <= elapsed / ui_routes.POLL_S + 3, (walks, elapsed)
    for page in pages:
        page.check_converged(search)
    assert handle.subscribers == []  # the last watcher left: the search's events cost nothing here again


async def test_the_feed_stops_with_its_last_watcher(walks):
    search = FakeSearch()
    handle = SearchHandle("s", search)
    search.grow(20)
    app = make_app(handle)
    page = Page(await open_events(app, "s"))
    await page.read(limit=5)
    assert len(handle.subscribers) == 1
    await page.body.aclose()  # the page went away
    assert handle.subscribers == [] and len(ui_routes.watchers_of(app)) == 0
    before = walks["all"]
    search.grow(50)
    await asyncio.sleep(3 * ui_routes.POLL_S)
    assert walks["all"] == before


# ---------------------------------------------------------------- a watcher that never reads


async def _never_reading(n_watchers: int) -> Tuple[int, int, FakeSearch, List[Page]]:
    """Grow a ~1,500-node search (every node drawn twice, speculative nodes cancelled) under ``n_watchers``
    watchers that read one frame and then nothing; memory traced at the end (before they read on)."""
    search = FakeSearch(seed=1)
    handle = SearchHandle("big", search)
    app = make_app(handle)
    gc.collect()
    tracemalloc.start()
    base = tracemalloc.get_traced_memory()[0]
    pages = [Page(await open_events(app, "big")) for _ in range(n_watchers)]
    for page in pages:
        await page.read(limit=1)
    for step in range(150):
        for node in search.grow(10):
            if node.depth < 4 and step % 3 == 0:
                search.speculate_and_cancel(node)
        if step % 10 == 0:
            await asyncio.sleep(ui_routes.POLL_S)  # let the feed read the tree
        else:
            await asyncio.sleep(0)
    await asyncio.sleep(2 * ui_routes.POLL_S)
    gc.collect()
    held = tracemalloc.get_traced_memory()[0] - base
    tracemalloc.stop()
    search.finish(handle)
    return held, len(search.tree), search, pages


async def test_a_never_reading_watcher_holds_bounded_memory_and_converges():
    one, nodes, _, pages = await _never_reading(1)
    for page in pages:
        await page.body.aclose()
    nine, _, search, pages = await _never_reading(9)
    assert nodes > 1500
    per_watcher = (nine - one) / 8
    # old: each watcher queued a view of every change (≈ 1 KiB per node per redraw) and kept its own copy of
    # the tree, so a watcher cost megabytes here; now a cursor and at most a batch of BATCH frames. The difference
    # also carries run-to-run changes of the shared feed's state (its stale log entries and pending views when
    # memory is read depend on when it polled: a loaded host measured 207 KB per watcher), hence BATCH × 4 KiB
    assert per_watcher < ui_routes.BATCH * 4096, (one, nine)
    for page in pages:  # they read on: each change's latest view, ending with the whole tree
        await asyncio.wait_for(page.read(), 30)
        page.check_converged(search)
        assert page.frames < 3 * nodes  # coalesced: not one frame per change since it stopped reading


async def test_a_real_search_is_drawn_whole():
    """A REBASE search over the in-memory port: a watcher that attaches before it starts and one that attaches
    after it finished draw the same tree, the result's."""
    spec = SearchSpec.from_dict(
        {"policy": {"name": "rebase", "width": 8, "max_depth": 4}, "reward": {"type": "logprob"}, "seed": 3}
    )
    ctx = SearchContext(spec, "What is 2 + 3?", FakePort(delay=0.002), search_id="real")
    handle = SearchHandle("real", ctx)
    app = make_app(handle)
    early = Page(await open_events(app, "real"))
    reading = asyncio.create_task(early.read())
    await asyncio.sleep(0)
    handle.result = await ctx.run()
    handle.publish({"event": "result", "result": handle.result.to_dict()})
    await asyncio.wait_for(reading, 10)
    late = Page(await open_events(app, "real"))
    await asyncio.wait_for(late.read(), 10)
    paths = sorted(n["path"] for n in handle.result.to_dict()["nodes"])
    for page in (early, late):
        assert sorted(page.nodes) == paths and page.result["result"]["nodes"] == handle.result.to_dict()["nodes"]
    assert early.nodes == late.nodes


# ---------------------------------------------------------------- caps


def _assert_busy(response: Any) -> None:
    assert response.status_code == 429 and int(response.headers["Retry-After"]) > 0
    error = json.loads(response.body)["error"]
    assert set(error) == {"field", "reason"} and error["field"] == "search_id" and error["reason"]


async def test_watchers_are_capped_per_search_and_in_total():
    per, total = ui_routes.MAX_WATCHERS_PER_SEARCH, ui_routes.MAX_WATCHERS
    handles = [SearchHandle(f"s{i}", FakeSearch()) for i in range(total // per + 1)]
    app = make_app(*handles)
    held = [await open_events(app, "s0") for _ in range(per)]
    assert all(isinstance(r, StreamingResponse) for r in held)
    _assert_busy(await open_events(app, "s0"))
    for h in handles[1 : total // per]:
        held += [await open_events(app, h.id) for _ in range(per)]
    assert len(held) == total and all(isinstance(r, StreamingResponse) for r in held)
    _assert_busy(await open_events(app, handles[-1].id))  # this search has none, but the server has its fill
    assert (await open_events(app, "nope")).status_code == 429  # a place is taken before a search is looked up
    # a page that goes away frees its place, even one whose stream never started
    page = Page(held.pop())
    await page.read(limit=1)
    await page.body.aclose()
    held.pop()
    gc.collect()
    again = [await open_events(app, handles[-1].id) for _ in range(2)]
    assert all(isinstance(r, StreamingResponse) for r in again)
    _assert_busy(await open_events(app, handles[-1].id))
    assert (await open_events(app, "s0")).status_code == 429
    held.clear()
    gc.collect()
    unknown = await open_events(app, "nope")
    assert unknown.status_code == 404 and json.loads(unknown.body)["error"]["field"] == "search_id"


async def test_a_waiting_watcher_whose_client_left_frees_its_place_at_once():
    """Review: a ``?wait=`` request kept its place for up to 30 s after its client had gone, so 128 of them locked
    every tree view out for 29 s. Now the wait loop notices the disconnect and gives the place back."""
    handle = SearchHandle("s", FakeSearch())
    app = make_app(handle)
    waiting = [open_events(app, f"nobody{i}", wait=30, gone_after=0.3) for i in range(ui_routes.MAX_WATCHERS)]
    tasks = [asyncio.ensure_future(w) for w in waiting]
    await asyncio.sleep(0.1)
    assert len(ui_routes.watchers_of(app)) == ui_routes.MAX_WATCHERS
    _assert_busy(await open_events(app, "s"))  # all places held while the clients are there
    began = time.monotonic()
    answers = await asyncio.wait_for(asyncio.gather(*tasks), 5)  # old: each held on for the whole 30 s
    assert time.monotonic() - began < 2.0
    assert all(not isinstance(a, StreamingResponse) for a in answers)
    assert len(ui_routes.watchers_of(app)) == 0
    assert isinstance(await open_events(app, "s"), StreamingResponse)


async def test_an_idle_watcher_gets_keep_alives_and_is_not_woken_for_nothing(monkeypatch):
    """Review: a running search that changes nothing sent its watchers zero bytes (a proxy closes such a stream,
    and the page then showed "running" forever), while each watcher woke 10 times a second to find nothing. Now
    the watchers sleep until the feed adds frames, and get an SSE comment every ``KEEPALIVE_S`` meanwhile."""
    monkeypatch.setattr(ui_routes, "KEEPALIVE_S", 0.4, raising=False)
    calls = [0]
    since = ui_routes.TreeFeed.since

    def counted(self, cursor, limit=ui_routes.BATCH):
        calls[0] += 1
        return since(self, cursor, limit)

    monkeypatch.setattr(ui_routes.TreeFeed, "since", counted)
    search = FakeSearch()
    handle = SearchHandle("idle", search)
    search.grow(5)
    app = make_app(handle)
    body = (await open_events(app, "idle")).body_iterator
    frames: List[str] = []

    async def read() -> None:
        async for frame in body:
            frames.append(frame)

    reader = asyncio.create_task(read())
    await asyncio.sleep(0.15)  # the first read's frames are in: 6 views and the state
    first, calls[0] = len(frames), 0
    assert first == 7 and all(not f.startswith(":") for f in frames), frames
    await asyncio.sleep(1.7)  # nothing changes
    pings = frames[first:]
    assert 2 <= len(pings) <= 6 and all(f == ui_routes.KEEPALIVE for f in pings), pings
    assert calls[0] <= len(pings) + 2, calls  # old: ~15 wake-ups for nothing (POLL_S = 0.1), and no keep-alive
    search.grow(1)
    search.finish(handle)
    await asyncio.wait_for(reader, 5)
    assert parse(frames[-1])["event"] == "result"


# ---------------------------------------------------------------- POST /tot/search "stream": true


async def test_a_stream_client_that_does_not_read_holds_bounded_events_and_gets_the_result():
    handle = SearchHandle("st", FakeSearch())
    svc = SimpleNamespace()  # the search is finished when the stream ends: nothing to cancel
    stream = search_service._stream(svc, handle, handle.subscribe())
    assert parse(await stream.__anext__())["event"] == "started"
    n = 20_000
    for i in range(n):  # the client reads nothing meanwhile
        handle.publish({"event": "node", "path": f"r.{i}", "status": DONE, "text": "x" * 200})
    handle.status = "done"
    handle.publish({"event": "result", "result": {"status": "done", "nodes": []}})
    events = [parse(frame) async for frame in stream]
    nodes = [e for e in events if e["event"] == "node"]
    assert len(nodes) <= 2048  # old: all 20,000 held for the client
    assert nodes[-1]["path"] == f"r.{n - 1}"  # the newest kept, the oldest dropped
    assert events[-1]["event"] == "result" and events[-1]["result"]["status"] == "done"
    assert events[-1]["dropped"] == n - len(nodes)
    assert handle.subscribers == []


# ---------------------------------------------------------------- live


def _raw_watcher(url: str, search_id: str) -> socket.socket:
    """A watcher that sends its request and never reads (a small receive buffer: backpressure comes soon)."""
    host, port = url.split("//")[1].split(":")
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    s.connect((host, int(port)))
    s.sendall(f"GET /tot/ui/events/{search_id} HTTP/1.1\r\nHost: {host}\r\nAccept: */*\r\n\r\n".encode())
    return s


def _read_events(response: requests.Response) -> List[Dict[str, Any]]:
    events, data = [], []
    for line in response.iter_lines(decode_unicode=True):
        if line.startswith("data:"):
            data.append(line[5:])
        elif not line and data:
            events.append(json.loads("\n".join(data)))
            data = []
            if events[-1]["event"] == "result":
                break
    return events


def test_live_watchers_capped_and_the_server_stays_responsive(spex_server):
    """A search held at its first rewards (a gated callback) while 15 watchers that never read and one page
    attach: a 17th is refused; released, it runs to its end with other clients served, and the page draws it."""
    url, sid = spex_server.url, "ui-watchers-review"
    gate = threading.Event()
    cb = CallbackRewardServer(lambda body: gate.wait(120) and 0.5)
    spec = {
        "policy": {"name": "rebase", "width": 32, "max_depth": 6},
        "step": {"max_tokens": 8, "stop": ["\n\n"], "temperature": 1.0},
        "reward": {"type": "callback", "url": cb.url},
        "seed": 0,
        "speculation": {"enabled": True},
    }
    body = {"spec": spec, "question": "What is 12 + 7?", "stream": True, "search_id": sid}
    out: Dict[str, Any] = {}

    def run_search() -> None:
        with requests.post(url + "/tot/search", json=body, stream=True, timeout=300) as r:
            out["search"] = _read_events(r)

    def watch() -> None:
        with requests.get(f"{url}/tot/ui/events/{sid}?wait=10", stream=True, timeout=300) as r:
            out["watch"] = _read_events(r)

    threads = [threading.Thread(target=watch), threading.Thread(target=run_search)]
    for t in threads:
        t.start()
    sockets: List[socket.socket] = []
    slowest = 0.0
    try:
        assert wait_until(lambda: _status(url, sid) == "running", timeout=30)
        sockets = [_raw_watcher(url, sid) for _ in range(ui_routes.MAX_WATCHERS_PER_SEARCH - 1)]
        time.sleep(1.0)
        refused = requests.get(f"{url}/tot/ui/events/{sid}", timeout=30)
        assert refused.status_code == 429 and int(refused.headers["Retry-After"]) > 0, refused.text
        assert refused.json()["error"]["field"] == "search_id" and _status(url, sid) == "running"
        gate.set()
        while threads[1].is_alive():  # other clients are served while 15 watchers never read
            began = time.monotonic()
            r = requests.post(
                url + "/generate", json={"text": "Hi", "sampling_params": {"max_new_tokens": 1}}, timeout=60
            )
            assert r.status_code == 200
            slowest = max(slowest, time.monotonic() - began)
            time.sleep(0.1)
        for t in threads:
            t.join(timeout=60)
    finally:
        gate.set()
        for s in sockets:
            s.close()
        cb.close()
    assert slowest < 3.0, slowest
    result = out["search"][-1]["result"]
    assert result["status"] == "done"
    drawn: Dict[str, Dict[str, Any]] = {}
    for event in out["watch"]:
        if event["event"] == "view":
            drawn[event["node"]["path"]] = event["node"]
    assert out["watch"][-1]["event"] == "result"
    assert sorted(p for p, v in drawn.items() if not v["ghost"]) == sorted(n["path"] for n in result["nodes"])
    cancelled = [p for p, v in drawn.items() if v["ghost"] and v["show"] == CANCELLED]
    assert len(cancelled) == result["speculation"]["cancelled"]
    # the closed sockets' places are freed: a page attaches to the finished search and gets all of it
    assert wait_until(lambda: requests.get(f"{url}/tot/ui/events/{sid}", timeout=30).status_code == 200, 15)


def _status(url: str, sid: str) -> Optional[str]:
    r = requests.get(f"{url}/tot/search/{sid}", timeout=30)
    return r.json()["status"] if r.status_code == 200 else None
