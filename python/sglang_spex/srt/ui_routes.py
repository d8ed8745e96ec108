"""The live tree view's routes (installed by :func:`sglang_spex.srt.routes.install`).

- ``GET /tot/ui`` → the page (``sglang_spex/ui/static/index.html``; no build step, nothing from a CDN).
- ``GET /tot/ui/static/{name}`` → its script and style (package data).
- ``GET /tot/ui/events/{search_id}[?wait=S]`` → server-sent events describing that search's tree as it grows:
  ``view`` (a node drawn or redrawn, with parent, text and how SPEX made it), ``state`` (totals, SPEX accounting,
  T3), the search's own ``frontier`` / ``answer`` events and a final ``result`` (``SearchResult.to_dict()`` plus
  ``ui``: the speculative nodes outside the tree and the adopted paths). ``wait``: seconds to wait for the search
  to appear (the page subscribes before it starts one with ``POST /tot/search``, ``"stream": true``, whose stream
  it holds open); a waiting request whose client goes away gives its place back at once. Watching never cancels a
  search. Past ``MAX_WATCHERS_PER_SEARCH`` watchers of one search or ``MAX_WATCHERS`` in all → 429
  ``{"error": {"field", "reason"}}`` with ``Retry-After``. A stream with nothing to send for ``KEEPALIVE_S`` sends
  an SSE comment, so proxies do not close an idle one (a queued search, a slow reward).

Cost on SGLang's HTTP event loop: one :class:`TreeFeed` per watched search (none without watchers: the search's
progress events then cost nothing here) reads the tree at most every ``POLL_S`` (and at most ``1 / DUTY`` of the
time) and serialises each changed node once, whatever the number of watchers; watchers wake only when it added
frames (or for a keep-alive). Each watcher only holds a cursor into the feed: a slow one gets each changed node's
latest view when it reads again (pending changes coalesce), so it still converges to the whole tree while its
memory stays bounded by ``BATCH`` frames.

The routes sit on SGLang's app, behind the same API-key middleware as every other route.
"""

from __future__ import annotations

import asyncio
import bisect
import logging
import time
import weakref
from typing import Any, AsyncIterator, Dict, List, Optional, Tuple

from fastapi import FastAPI, Request
from fastapi.responses import FileResponse, JSONResponse, Response, StreamingResponse

from sglang_spex.srt.http_api import BodyError, error_response, query_number
from sglang_spex.srt.http_state import http_state
from sglang_spex.srt.search_service import KEEPALIVE, KEEPALIVE_S, SearchHandle, sse_frame
from sglang_spex.ui import ASSETS, asset_path
from sglang_spex.ui.observer import TreeObserver

logger = logging.getLogger(__name__)

# A watched search's tree is re-read at most every POLL_S (speculative nodes publish no progress events, so it is
# also polled at that rate): live enough for a person; and at most 1/DUTY of the time (a big tree's read takes
# milliseconds), so one watched search costs SGLang's HTTP event loop at most ~10 % however many watch it.
POLL_S = 0.1
DUTY = 10
MAX_WAIT_S = 30.0
# Watchers cost a socket, a cursor and a share of the event loop: 16 pages on one search is plenty for people,
# 128 in all keeps a flood of them from holding the HTTP server (past either: 429 with Retry-After).
MAX_WATCHERS_PER_SEARCH = 16
MAX_WATCHERS = 128
RETRY_AFTER_S = 5
BATCH = 64  # frames a watcher takes from its feed at a time: its memory, however slow it reads
STATE_ATTR = "spex_ui_watchers"  # the app's Watchers on app.state


class TreeFeed:
    """One search's page events for all of its watchers: one :class:`TreeObserver`, refreshed by one pump task
    (rate-limited, see ``POLL_S``), each change serialised once into a log of SSE frames keyed by what it
    describes (a node's view, the state, the frontier, an answer, the result). A key's newer frame replaces its
    older one, so the log holds one frame per key and a watcher reading from any cursor gets the latest of each
    change since then, in the order they were made; ``result`` is the last frame."""

    def __init__(self, handle: SearchHandle):
        self.handle = handle
        self.observer = TreeObserver(handle.ctx)
        self.watchers = 0
        self.ended = False  # the result frame is in the log (or the feed failed): no frame follows
        self._seq = 0
        self._frames: Dict[str, Tuple[int, str]] = {}  # key -> (seq, frame)
        self._log: List[Tuple[int, str]] = []  # (seq, key) in seq order; stale once its key has a newer frame
        self._changed = asyncio.Event()  # replaced each time frames are added: watchers wait on the current one
        self._poke = asyncio.Event()  # the result was published: refresh now
        self._pump: Optional["asyncio.Task[None]"] = None

    def start(self) -> None:
        """Subscribe to the search's progress and start reading its tree."""
        self.handle.subscribers.append(self)
        self._pump = asyncio.get_running_loop().create_task(self._run(), name=f"tot-ui-feed-{self.handle.id}")

    def stop(self) -> None:
        """Unsubscribe and stop (the last watcher left): the search's events cost nothing here again."""
        if self in self.handle.subscribers:
            self.handle.subscribers.remove(self)
        if self._pump is not None:
            self._pump.cancel()

    # ---- the search side: progress events, O(1) each ---------------------------------------------------
    def put_nowait(self, event: Dict[str, Any]) -> None:
        """A progress event of the search (called inside its step): nodes come from the tree reads."""
        kind = event.get("event")
        if kind == "frontier":
            self._put("frontier", sse_frame(event))
            self._wake()
        elif kind == "answer":
            self._put(f"answer:{event.get('path')}", sse_frame(event))
            self._wake()
        elif kind == "result":
            self._poke.set()

    # ---- the pump --------------------------------------------------------------------------------------
    async def _run(self) -> None:
        try:
            while True:
                done = self.handle.result is not None
                began = time.perf_counter()
                added = self._refresh()
                if done:
                    ui = {"ghosts": self.observer.ghosts(), "adopted": self.observer.adopted()}
                    self._put(
                        "result", sse_frame({"event": "result", "result": self.handle.result.to_dict(), "ui": ui})
                    )
                    return
                if added:  # watchers sleep through a read that found nothing new
                    self._wake()
                pause = max(POLL_S, DUTY * (time.perf_counter() - began))
                try:
                    await asyncio.wait_for(self._poke.wait(), timeout=pause)
                except asyncio.TimeoutError:
                    pass
        except asyncio.CancelledError:
            raise
        except Exception:  # the watchers' streams end; the search goes on
            logger.exception("tree view of search %s failed", self.handle.id)
        finally:
            self.ended = True
            self._wake()

    def _refresh(self) -> int:
        """Read the tree; how many frames that added."""
        events = self.observer.changes()
        for event in events:
            key = f"view:{event['node']['path']}" if event["event"] == "view" else event["event"]
            self._put(key, sse_frame(event))
        return len(events)

    def _put(self, key: str, frame: str) -> None:
        self._seq += 1
        self._frames[key] = (self._seq, frame)
        self._log.append((self._seq, key))
        if len(self._log) > 2 * len(self._frames) + BATCH:  # drop stale entries: the log stays O(keys)
            self._log = [(seq, k) for seq, k in self._log if self._frames[k][0] == seq]

    def _wake(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    # ---- the watcher side ------------------------------------------------------------------------------
    def since(self, cursor: int, limit: int = BATCH) -> List[Tuple[int, str]]:
        """Up to ``limit`` (seq, frame) of the latest frames made after ``cursor``, oldest first."""
        out: List[Tuple[int, str]] = []
        i = bisect.bisect_right(self._log, cursor, key=lambda entry: entry[0])
        while i < len(self._log) and len(out) < limit:
            seq, key = self._log[i]
            if self._frames[key][0] == seq:
                out.append((seq, self._frames[key][1]))
            i += 1
        return out

    async def frames(self) -> AsyncIterator[str]:
        """One watcher's SSE frames: everything so far, then each change, until the result; a keep-alive comment
        after ``KEEPALIVE_S`` without one."""
        cursor = 0
        while True:
            batch = self.since(cursor)
            for cursor, frame in batch:
                yield frame
            if batch:
                continue
            if self.ended:
                return
            try:
                await asyncio.wait_for(self._changed.wait(), timeout=KEEPALIVE_S)
            except asyncio.TimeoutError:
                yield KEEPALIVE


class Watcher:
    """One ``/tot/ui/events`` request's place under the caps; it frees itself when released or collected (a
    response whose body never started)."""

    def __init__(self) -> None:
        self.handle: Optional[SearchHandle] = None


class Watchers:
    """This app's watchers (the caps) and the feed of each watched search."""

    def __init__(self, per_search: int = MAX_WATCHERS_PER_SEARCH, total: int = MAX_WATCHERS):
        self.per_search, self.total = per_search, total
        self.feeds: Dict[SearchHandle, TreeFeed] = {}
        self._live: "weakref.WeakSet[Watcher]" = weakref.WeakSet()

    def __len__(self) -> int:
        return len(self._live)

    def admit(self) -> Optional[Watcher]:
        """A place under the total cap, or None."""
        if len(self._live) >= self.total:
            return None
        watcher = Watcher()
        self._live.add(watcher)
        return watcher

    def bind(self, watcher: Watcher, handle: SearchHandle) -> bool:
        """Count ``watcher`` against ``handle``'s cap; False if that search has as many as it may."""
        if sum(1 for w in self._live if w.handle is handle) >= self.per_search:
            return False
        watcher.handle = handle
        return True

    def release(self, watcher: Watcher) -> None:
        self._live.discard(watcher)

    async def stream(self, watcher: Watcher, handle: SearchHandle) -> AsyncIterator[str]:
        """``watcher``'s frames of ``handle``'s feed (made by its first watcher, stopped after its last)."""
        feed = self.feeds.get(handle)
        if feed is None:
            feed = self.feeds[handle] = TreeFeed(handle)
            feed.start()
        feed.watchers += 1
        try:
            async for frame in feed.frames():
                yield frame
        finally:
            feed.watchers -= 1
            if feed.watchers == 0:
                feed.stop()
                if self.feeds.get(handle) is feed:
                    del self.feeds[handle]
            self.release(watcher)


def watchers_of(app: FastAPI) -> Watchers:
    return getattr(app.state, STATE_ATTR)


def _busy(field_name: str, reason: str) -> JSONResponse:
    response = error_response(field_name, f"{reason}; retry later", status_code=429)
    response.headers["Retry-After"] = str(RETRY_AFTER_S)
    return response


async def get_page(request: Request) -> Response:
    return FileResponse(asset_path("index.html"), media_type="text/html", headers={"Cache-Control": "no-cache"})


async def get_asset(request: Request, name: str) -> Response:
    if name not in ASSETS:
        return error_response("name", f"unknown asset {name!r}; expected one of {sorted(ASSETS)}", status_code=404)
    return FileResponse(asset_path(name), media_type=ASSETS[name], headers={"Cache-Control": "no-cache"})


async def get_events(request: Request, search_id: str, wait: Optional[str] = None) -> Response:
    """``wait``: seconds to wait for a search of that id to start (the page opens this before starting it)."""
    try:
        wait_s = query_number(wait, "wait", float, 0.0)
    except BodyError as e:
        return error_response(e.field, e.reason)
    watchers = watchers_of(request.app)
    watcher = watchers.admit()  # a waiting request holds its place too, until its client goes away
    if watcher is None:
        return _busy("search_id", f"{watchers.total} tree-view watchers are open on this server")
    searches = http_state(request).searches.searches
    deadline = time.monotonic() + min(max(wait_s, 0.0), MAX_WAIT_S)
    while search_id not in searches and time.monotonic() < deadline:
        await asyncio.sleep(POLL_S)
        if await request.is_disconnected():
            watchers.release(watcher)
            return error_response("search_id", "the client went away while waiting", status_code=499)
    handle = searches.get(search_id)
    if handle is None:
        watchers.release(watcher)
        return error_response("search_id", f"unknown search {search_id!r}", status_code=404)
    if not watchers.bind(watcher, handle):
        watchers.release(watcher)
        return _busy("search_id", f"search {search_id!r} has {watchers.per_search} tree-view watchers")
    return StreamingResponse(
        watchers.stream(watcher, handle), media_type="text/event-stream", headers={"Cache-Control": "no-cache"}
    )


def install(app: FastAPI) -> None:
    """Add ``/tot/ui``, its assets and its event stream to ``app``."""
    setattr(app.state, STATE_ATTR, Watchers())
    app.add_api_route("/tot/ui", get_page, methods=["GET"])
    app.add_api_route("/tot/ui/static/{name}", get_asset, methods=["GET"])
    app.add_api_route("/tot/ui/events/{search_id}", get_events, methods=["GET"])
