"""Control routes for the scheduler-side hooks (installed by :func:`sglang_spex.srt.routes.install`).

- ``POST /spex/budget {"k": N | null}``: speculative admission cap (null = unlimited).
- ``POST /spex/cancel {"search_id": S} | {"rid_prefix": P}``: cancel a whole search (or any rid prefix) in
  one call; cancelling a search also releases its prefix protection.
- ``POST /spex/protect {"search_id": S}``: register a live search / renew its protection lease.
- ``POST /spex/release {"search_id": S, "node_prefix": "r.0"?}``: release a search's protection (or a
  subtree's); without ``search_id`` releases every protection.
- ``POST /spex/knobs {"immediate_cancel": bool, "protect_ttl_s": s, "protect_max_fraction": f}``.
- ``GET /spex/stats?history_since=N``: scheduler-side state (one IPC round trip) and the shared-memory
  batch statistics (latest step, counters, optionally the per-step rows since sequence number N).

Every POST answers with the scheduler-side state after the command was applied (see :mod:`.control`).
"""

from __future__ import annotations

from typing import Any, Dict, Optional

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from sglang_spex.config import SpexConfig
from sglang_spex.srt import batch_stats, control


def _tm():
    from sglang_spex.srt.routes import tokenizer_manager

    return tokenizer_manager()


async def _body(request: Request) -> Dict[str, Any]:
    try:
        body = await request.json()
    except Exception:
        body = {}
    return body if isinstance(body, dict) else {}


async def _run(cfg: SpexConfig, req: control.SpexControlReq) -> JSONResponse:
    if not cfg.enabled:
        return JSONResponse({"error": "speculation is off (start with --tot-speculation)"}, status_code=409)
    err = control.validate(req)
    if err:
        return JSONResponse({"error": err}, status_code=400)
    return JSONResponse({"ok": True, "scheduler": await control.send(_tm(), req)})


def install(app: FastAPI, cfg: SpexConfig) -> None:
    """Add the control routes to ``app``."""

    @app.post("/spex/budget")
    async def _budget(request: Request):
        k = (await _body(request)).get("k")
        if k is not None and (not isinstance(k, (int, float)) or k < 0):
            return JSONResponse({"error": "k must be a non-negative integer or null"}, status_code=400)
        return await _run(cfg, control.SpexControlReq(op="budget", value=None if k is None else float(int(k))))

    @app.post("/spex/cancel")
    async def _cancel(request: Request):
        body = await _body(request)
        sid, prefix = str(body.get("search_id") or ""), str(body.get("rid_prefix") or "")
        return await _run(cfg, control.SpexControlReq(op="cancel", search_id=sid, prefix=prefix))

    @app.post("/spex/promote")
    async def _promote(request: Request):
        rid = str((await _body(request)).get("rid") or "")
        if not rid:
            return JSONResponse({"error": "rid is required"}, status_code=400)
        return await _run(cfg, control.SpexControlReq(op="promote", prefix=rid))

    @app.post("/spex/protect")
    async def _protect(request: Request):
        sid = str((await _body(request)).get("search_id") or "")
        return await _run(cfg, control.SpexControlReq(op="protect", search_id=sid))

    @app.post("/spex/release")
    async def _release(request: Request):
        body = await _body(request)
        sid, node = str(body.get("search_id") or ""), str(body.get("node_prefix") or "")
        return await _run(cfg, control.SpexControlReq(op="release", search_id=sid, prefix=node))

    @app.post("/spex/knobs")
    async def _knobs(request: Request):
        body = await _body(request)
        last: Optional[JSONResponse] = None
        for key in control.KNOBS:
            if key in body:
                last = await _run(cfg, control.SpexControlReq(op="set", key=key, value=float(body[key])))
                if last.status_code != 200:
                    return last
        return last or JSONResponse({"error": f"give one of {list(control.KNOBS)}"}, status_code=400)

    @app.get("/spex/stats")
    async def _stats(history_since: Optional[int] = None):
        if not cfg.enabled:
            return JSONResponse({"error": "speculation is off (start with --tot-speculation)"}, status_code=409)
        out = {"scheduler": await control.scheduler_state(_tm())}
        out["batch"] = batch_stats.read_stats(history_since=history_since)
        return JSONResponse(out)
