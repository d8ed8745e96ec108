"""The live tree view's routes (installed by :func:`sglang_spex.srt.routes.install`).

- ``GET /tot/ui`` → the page (``sglang_spex/ui/static/index.html``; no build step, nothing from a CDN).
- ``GET /tot/ui/static/{name}`` → its script and style (package data).
- ``GET /tot/ui/events/{search_id}[?wait=S]`` → server-sent events describing that search's tree as it grows:
  ``view`` (a node drawn or redrawn, with parent, text and how SPEX made it), ``state`` (totals, SPEX accounting,
  T3), the search's own ``frontier`` / ``answer`` events and a final ``result`` (``SearchResult.to_dict()`` plus
  ``ui``: the speculative nodes outside the tree and the adopted paths). ``wait``: seconds to wait for the search
  to appear (the page subscribes before it starts one with ``POST /tot/search``, ``"stream": true``, whose stream
  it holds open). Watching never cancels a search.

The routes sit on SGLang's app, behind the same API-key middleware as every other route.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any, AsyncIterator, Dict

from fastapi import FastAPI, Request
from fastapi.responses import FileResponse, Response, StreamingResponse

from sglang_spex.srt.http_api import error_response
from sglang_spex.srt.http_state import http_state
from sglang_spex.srt.search_service import SearchHandle, sse_frame
from sglang_spex.ui import ASSETS, asset_path
from sglang_spex.ui.observer import TreeObserver

# How often a watcher re-reads the tree while no progress event arrives (speculative nodes publish none): 10 Hz is
# live enough for a person and keeps 100 watchers at 1,000 light wake-ups/s on SGLang's HTTP event loop.
POLL_S = 0.1
MAX_WAIT_S = 30.0


class _ObservedQueue(asyncio.Queue):
    """A progress subscriber that queues a tree snapshot (the observer's changes) whenever the search publishes
    an event, before the search acts on it (a BFS frontier decision cancels speculative nodes right after
    announcing it); every event the page gets passes through it, so they stay in order."""

    def __init__(self, observer: TreeObserver):
        super().__init__()
        self.observer = observer

    def snapshot(self) -> None:
        for event in self.observer.changes():
            super().put_nowait(event)

    def put_nowait(self, item: Dict[str, Any]) -> None:
        self.snapshot()
        if item.get("event") in ("frontier", "answer", "result"):
            super().put_nowait(item)


async def watch(handle: SearchHandle, poll_s: float = POLL_S) -> AsyncIterator[Dict[str, Any]]:
    """The page's events for one search, until its result (at once if it has finished)."""
    observer = TreeObserver(handle.ctx)
    queue = _ObservedQueue(observer)
    handle.subscribers.append(queue)
    try:
        queue.snapshot()
        while True:
            if not queue.empty():
                event = queue.get_nowait()
            elif handle.result is not None:
                break
            else:
                try:
                    event = await asyncio.wait_for(queue.get(), timeout=poll_s)
                except asyncio.TimeoutError:
                    queue.snapshot()
                    continue
            if event.get("event") != "result":  # the final result goes out last, below
                yield event
        for event in observer.changes():
            yield event
        ui = {"ghosts": observer.ghosts(), "adopted": observer.adopted()}
        yield {"event": "result", "result": handle.result.to_dict(), "ui": ui}
    finally:
        if queue in handle.subscribers:
            handle.subscribers.remove(queue)


async def get_page(request: Request) -> Response:
    return FileResponse(asset_path("index.html"), media_type="text/html", headers={"Cache-Control": "no-cache"})


async def get_asset(request: Request, name: str) -> Response:
    if name not in ASSETS:
        return error_response("name", f"unknown asset {name!r}; expected one of {sorted(ASSETS)}", status_code=404)
    return FileResponse(asset_path(name), media_type=ASSETS[name], headers={"Cache-Control": "no-cache"})


async def get_events(request: Request, search_id: str, wait: float = 0.0) -> Response:
    """``wait``: seconds to wait for a search of that id to start (the page opens this before starting it)."""
    searches = http_state(request).searches.searches
    deadline = time.monotonic() + min(max(wait, 0.0), MAX_WAIT_S)
    while search_id not in searches and time.monotonic() < deadline:
        await asyncio.sleep(POLL_S)
    handle = searches.get(search_id)
    if handle is None:
        return error_response("search_id", f"unknown search {search_id!r}", status_code=404)

    async def body() -> AsyncIterator[str]:
        async for event in watch(handle):
            yield sse_frame(event)

    return StreamingResponse(body(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})


def install(app: FastAPI) -> None:
    """Add ``/tot/ui``, its assets and its event stream to ``app``."""
    app.add_api_route("/tot/ui", get_page, methods=["GET"])
    app.add_api_route("/tot/ui/static/{name}", get_asset, methods=["GET"])
    app.add_api_route("/tot/ui/events/{search_id}", get_events, methods=["GET"])
