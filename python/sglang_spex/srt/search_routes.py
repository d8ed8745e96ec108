"""``/tot/search`` routes on SGLang's FastAPI app (installed by ``srt.routes.install``).

- ``POST /tot/search`` body ``{"spec": {...}, "question": str, "reference"?: str, "stream"?: bool,
  "search_id"?: str}`` → the search result (``SearchResult.to_dict()``), or with ``"stream": true`` server-sent
  events (``event: node|frontier|answer|result``, JSON ``data``). An invalid body or spec → HTTP 400
  ``{"error": {"field", "reason"}}`` and nothing starts. A client that disconnects cancels its search.
- ``GET /tot/search/{id}`` → status and progress (and the result once finished).
- ``DELETE /tot/search/{id}`` → cancel: every request of the search is aborted by one rid-prefix abort.
- ``GET /tot/searches`` → all known searches.
"""

from __future__ import annotations

import asyncio
import json
from typing import Optional

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from sglang_spex.config import SpexConfig
from sglang_spex.srt.search_service import SearchHandle, SearchService, parse_body
from sglang_spex.tot.engine import search_rid_prefix
from sglang_spex.tot.search_spec import SearchSpecError

DISCONNECT_POLL_S = 0.25
_service: Optional[SearchService] = None


def service() -> Optional[SearchService]:
    """The process's search service (None before the routes are installed); SPEX sets ``context_factory``."""
    return _service


def _bad(e: SearchSpecError) -> JSONResponse:
    return JSONResponse({"error": e.to_dict(), "detail": str(e)}, status_code=400)


def _sse(event: dict) -> str:
    return f"event: {event.get('event', 'message')}\ndata: {json.dumps(event)}\n\n"


async def _stream(svc: SearchService, h: SearchHandle, queue: asyncio.Queue):
    try:
        yield _sse({"event": "started", "search_id": h.id})
        while True:
            event = await queue.get()
            yield _sse(event)
            if event.get("event") == "result":
                return
    finally:  # the client went away (or we finished): a search nobody listens to is cancelled
        if not h.finished:
            await svc.cancel(h.id, "client disconnected")


async def _wait_or_disconnect(svc: SearchService, h: SearchHandle, request: Request) -> None:
    while not h.task.done():
        await asyncio.wait({h.task}, timeout=DISCONNECT_POLL_S)
        if not h.task.done() and await request.is_disconnected():
            await svc.cancel(h.id, "client disconnected")
            return


def install(app: FastAPI, cfg: SpexConfig) -> None:
    global _service
    from sglang_spex.srt.engine_port import TokenizerManagerPort
    from sglang_spex.srt.routes import tokenizer_manager

    _service = svc = SearchService(
        lambda: TokenizerManagerPort(tokenizer_manager()),
        max_concurrent=cfg.max_concurrent_searches,
        reward_timeout=cfg.reward_timeout,
    )

    @app.post("/tot/search")
    async def _search(request: Request):
        try:
            body = await request.json()
        except Exception:
            return _bad(SearchSpecError("body", "must be valid JSON"))
        try:
            parsed = parse_body(body)
            handle = svc.submit(parsed)
        except SearchSpecError as e:
            return _bad(e)
        if parsed["stream"]:
            queue = handle.subscribe()
            return StreamingResponse(
                _stream(svc, handle, queue),
                media_type="text/event-stream",
                headers={"X-Search-Id": handle.id, "Cache-Control": "no-cache"},
            )
        await _wait_or_disconnect(svc, handle, request)
        await asyncio.wait({handle.task})
        return JSONResponse(handle.result.to_dict())

    @app.get("/tot/search/{search_id}")
    async def _status(search_id: str):
        h = svc.searches.get(search_id)
        if h is None:
            return JSONResponse({"error": {"field": "search_id", "reason": "unknown search"}}, status_code=404)
        info = h.info()
        prefix = search_rid_prefix(search_id)  # requests of this search SGLang still tracks
        info["engine_requests"] = sum(1 for rid in list(tokenizer_manager().rid_to_state) if rid.startswith(prefix))
        return JSONResponse(info)

    @app.delete("/tot/search/{search_id}")
    async def _cancel(search_id: str):
        h = await svc.cancel(search_id)
        if h is None:
            return JSONResponse({"error": {"field": "search_id", "reason": "unknown search"}}, status_code=404)
        return JSONResponse({"search_id": h.id, "status": h.status, "inflight": len(h.ctx.inflight)})

    @app.get("/tot/searches")
    async def _list():
        return JSONResponse(svc.summary())
