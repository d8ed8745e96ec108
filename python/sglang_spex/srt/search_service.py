"""Server-side searches: run inside the SGLang HTTP server process, next to the scheduler.

Each search is an asyncio task on the server's event loop whose requests go through SGLang's own
TokenizerManager (``TokenizerManagerPort``), never HTTP back to ourselves. The service keeps every search by
id for status, progress subscribers (server-sent events) and cancellation (one prefix abort of all of its
requests). ``context_factory`` is where SPEX plugs its :class:`SearchContext` subclass in.
"""

from __future__ import annotations

import asyncio
import re
import time
import uuid
from collections import OrderedDict
from typing import Any, Callable, Dict, List, Optional

from sglang_spex.tot.context import SearchContext
from sglang_spex.tot.engine import EnginePort
from sglang_spex.tot.search import ContextFactory, SearchResult, build_result, run_context
from sglang_spex.tot.search_spec import SearchSpec, SearchSpecError

QUEUED, RUNNING = "queued", "running"
FINISHED = ("done", "cancelled", "failed")
_ID = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
BODY_FIELDS = {"spec", "question", "reference", "stream", "search_id"}


class SearchHandle:
    """One server-side search: its context, task, status and progress subscribers."""

    def __init__(self, search_id: str, ctx: SearchContext):
        self.id = search_id
        self.ctx = ctx
        self.status = QUEUED
        self.created = time.time()
        self.result: Optional[SearchResult] = None
        self.task: Optional[asyncio.Task] = None
        self.subscribers: List[asyncio.Queue] = []
        ctx.progress = self.publish

    def publish(self, event: Dict[str, Any]) -> None:
        for q in self.subscribers:
            q.put_nowait(event)

    def subscribe(self) -> asyncio.Queue:
        q: asyncio.Queue = asyncio.Queue()
        self.subscribers.append(q)
        return q

    @property
    def finished(self) -> bool:
        return self.status in FINISHED

    def info(self) -> Dict[str, Any]:
        ctx = self.ctx
        return {
            "search_id": self.id,
            "status": self.status,
            "policy": ctx.spec.policy.name,
            "question": ctx.question,
            "num_nodes": len(ctx.tree) - 1,
            "num_requests": ctx.num_requests,
            "tokens_generated": ctx.tokens_generated,
            "inflight": len(ctx.inflight),
            "answers": len(ctx.tree.terminals()),
            "elapsed": time.monotonic() - ctx.started,
            "result": self.result.to_dict() if self.result is not None else None,
        }


def parse_body(body: Any) -> Dict[str, Any]:
    """Validate a ``POST /tot/search`` body; raises :class:`SearchSpecError` naming the field."""
    if not isinstance(body, dict):
        raise SearchSpecError("body", "must be a JSON object")
    unknown = sorted(set(body) - BODY_FIELDS)
    if unknown:
        raise SearchSpecError(unknown[0], f"unknown field; expected {sorted(BODY_FIELDS)}")
    q = body.get("question")
    if not isinstance(q, str) or not q.strip():
        raise SearchSpecError("question", "must be a non-empty string")
    ref = body.get("reference")
    if ref is not None and not isinstance(ref, (str, int, float)):
        raise SearchSpecError("reference", "must be a string or a number")
    if not isinstance(body.get("stream", False), bool):
        raise SearchSpecError("stream", "must be a boolean")
    sid = body.get("search_id")
    if sid is not None and (not isinstance(sid, str) or not _ID.match(sid)):
        raise SearchSpecError("search_id", "must match [A-Za-z0-9_-]{1,64}")
    spec = SearchSpec.from_dict(body.get("spec", {}))
    return {
        "spec": spec,
        "question": q,
        "reference": None if ref is None else str(ref),
        "stream": bool(body.get("stream", False)),
        "search_id": sid,
    }


class SearchService:
    def __init__(
        self,
        port_factory: Callable[[], EnginePort],
        max_concurrent: int = 64,
        reward_timeout: Optional[float] = None,
        context_factory: ContextFactory = SearchContext,
        keep_finished: int = 256,
    ):
        self._port_factory = port_factory
        self._port: Optional[EnginePort] = None
        self.max_concurrent = max_concurrent
        self.reward_timeout = reward_timeout
        self.context_factory = context_factory
        self.keep_finished = keep_finished
        self.searches: "OrderedDict[str, SearchHandle]" = OrderedDict()
        self._sem: Optional[asyncio.Semaphore] = None

    @property
    def port(self) -> EnginePort:
        if self._port is None:
            self._port = self._port_factory()
        return self._port

    def submit(self, parsed: Dict[str, Any]) -> SearchHandle:
        """Start a search from a body parsed by :func:`parse_body`."""
        sid = parsed["search_id"] or uuid.uuid4().hex[:16]
        if sid in self.searches and not self.searches[sid].finished:
            raise SearchSpecError("search_id", f"search {sid!r} is already running")
        if self._sem is None:
            self._sem = asyncio.Semaphore(self.max_concurrent)
        ctx = self.context_factory(
            parsed["spec"],
            parsed["question"],
            self.port,
            reference=parsed["reference"],
            search_id=sid,
            reward_timeout=self.reward_timeout,
        )
        handle = SearchHandle(sid, ctx)
        self.searches[sid] = handle
        self.searches.move_to_end(sid)
        handle.task = asyncio.create_task(self._run(handle), name=f"tot-search-{sid}")
        self._trim()
        return handle

    async def _run(self, h: SearchHandle) -> None:
        try:
            async with self._sem:
                if h.ctx.cancelled:
                    h.result = build_result(h.ctx, "cancelled")
                else:
                    h.status = RUNNING
                    h.result = await run_context(h.ctx)
        except asyncio.CancelledError:
            h.result = build_result(h.ctx, "cancelled")
        except Exception as e:  # never lose a search silently
            h.result = build_result(h.ctx, "failed", repr(e))
        h.status = h.result.status
        h.publish({"event": "result", "result": h.result.to_dict()})

    async def cancel(self, search_id: str, reason: str = "cancelled") -> Optional[SearchHandle]:
        """Cancel a search: abort all of its requests in SGLang (by rid prefix) and let it finish."""
        h = self.searches.get(search_id)
        if h is None:
            return None
        if not h.finished:
            await h.ctx.cancel(reason)
            if h.task is not None:
                try:
                    await asyncio.wait_for(asyncio.shield(h.task), timeout=10)
                except asyncio.TimeoutError:
                    h.task.cancel()
        return h

    def _trim(self) -> None:
        done = [k for k, h in self.searches.items() if h.finished]
        for k in done[: max(0, len(done) - self.keep_finished)]:
            del self.searches[k]

    def summary(self) -> Dict[str, Any]:
        return {
            "searches": [{"search_id": k, "status": h.status} for k, h in self.searches.items()],
            "running": sum(1 for h in self.searches.values() if h.status == RUNNING),
            "inflight": sum(len(h.ctx.inflight) for h in self.searches.values()),
        }
