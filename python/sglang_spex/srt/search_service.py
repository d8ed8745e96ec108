"""Server-side searches: the registry, their SPEX wiring and the ``/tot/search`` routes.

Each search is an asyncio task on the SGLang HTTP server's event loop whose requests go through SGLang's own
TokenizerManager (``TokenizerManagerPort``), never HTTP back to ourselves. The service keeps every search by
id for status, progress subscribers (server-sent events) and cancellation (one prefix abort of all of its
requests). Under ``--tot-speculation`` searches run as ``SpexContext``s sharing one T2 budget
(:class:`~sglang_spex.srt.spex_wiring.SpexWiring`); ``--tot-k-total auto`` starts at the runner's default and takes the roofline knee once
the profile is ready. At the end of each search its accounting goes to ``/metrics``.

Routes (state from ``app.state.spex.searches``, see ``srt/http_state.py``):

- ``POST /tot/search`` body :class:`~sglang_spex.srt.http_api.SearchBody` → the search result
  (``SearchResult.to_dict()``), or with ``"stream": true`` server-sent events (``event:
  started|node|frontier|answer|result``, JSON ``data``). An invalid body or spec → HTTP 400
  ``{"error": {"field", "reason"}}`` and nothing starts. A client that disconnects cancels its search. A client
  that reads slower than the search publishes loses its oldest pending progress events past
  ``STREAM_MAX_PENDING`` (its ``result`` event then says how many in ``dropped``), never the result.
- ``GET /tot/search/{id}`` → status and progress (and the result once finished).
- ``DELETE /tot/search/{id}`` → cancel: every request of the search is aborted by one rid-prefix abort.
- ``GET /tot/searches`` → all known searches.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import logging
import math
import secrets
import statistics
import time
from collections import OrderedDict, deque
from typing import Any, AsyncIterator, Callable, Deque, Dict, List, Optional, Protocol

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from sglang_spex.config import SpexConfig
from sglang_spex.profile.manager import ProfileManager
from sglang_spex.speculation.settings import check_without_speculation
from sglang_spex.srt.engine_port import TokenizerManagerPort
from sglang_spex.srt.http_api import STATE_ATTR, BodyError, SearchBody, error_response, json_body
from sglang_spex.srt.spex_wiring import SpexWiring
from sglang_spex.tot.context import SearchContext
from sglang_spex.tot.engine import EngineLost, search_rid_prefix
from sglang_spex.tot.limits import SearchLimits, derive
from sglang_spex.tot.search import ContextFactory, SearchResult
from sglang_spex.tot.search_spec import SearchSpec, SearchSpecError

logger = logging.getLogger(__name__)

QUEUED, RUNNING = "queued", "running"
CANCEL_GRACE_S = 2.0  # a cancelled running search's time to wind down before its task is cancelled
# SpexConfig fields that are per-search limits (tot/limits.py); None = derived from the live engine
LIMIT_FIELDS = ("max_width", "max_depth", "max_iterations", "max_nodes", "max_search_tokens", "max_step_tokens")
FINISHED = ("done", "cancelled", "failed")
DISCONNECT_POLL_S = 0.25
# Progress events a streaming client may leave unread before its oldest are dropped: a node event is about a step's
# text (≲ 1 KiB), so a client that never reads holds at most ~1 MiB of the server's memory, whatever the search size.
STREAM_MAX_PENDING = 1024


class Busy(Exception):
    """Every search slot and queue place is taken; answer 429 with ``Retry-After``."""

    def __init__(self, retry_after: int, counts: Dict[str, int]):
        super().__init__(f"server busy: {counts['running']} searches running, {counts['queued']} queued")
        self.retry_after = retry_after


class Subscriber(Protocol):
    """A progress subscriber: ``put_nowait`` runs inside the search's own step, so it must be cheap."""

    def put_nowait(self, event: Dict[str, Any]) -> None: ...


class StreamQueue:
    """One streaming client's pending progress events, at most ``maxlen``: past that the oldest is dropped (and
    counted in ``dropped``). The ``result`` event is published last, so it is never the one dropped."""

    def __init__(self, maxlen: int = STREAM_MAX_PENDING):
        self.maxlen = maxlen
        self.dropped = 0
        self._events: Deque[Dict[str, Any]] = deque()
        self._ready = asyncio.Event()

    def __len__(self) -> int:
        return len(self._events)

    def put_nowait(self, event: Dict[str, Any]) -> None:
        if len(self._events) >= self.maxlen:
            self._events.popleft()
            self.dropped += 1
        self._events.append(event)
        self._ready.set()

    async def get(self) -> Dict[str, Any]:
        while not self._events:
            self._ready.clear()
            await self._ready.wait()
        return self._events.popleft()


class SearchHandle:
    """One server-side search: its context, task, status and progress subscribers."""

    def __init__(self, search_id: str, ctx: SearchContext):
        self.id = search_id
        self.ctx = ctx
        self.status = QUEUED
        self.created = time.time()
        self.result: Optional[SearchResult] = None
        self.task: Optional[asyncio.Task] = None
        self.subscribers: List[Subscriber] = []
        ctx.progress = self.publish

    def publish(self, event: Dict[str, Any]) -> None:
        for q in self.subscribers:
            q.put_nowait(event)

    def subscribe(self, maxlen: int = STREAM_MAX_PENDING) -> StreamQueue:
        """A bounded queue of this search's progress events (a streaming client's)."""
        q = StreamQueue(maxlen)
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
            "dp_rank": ctx.dp_rank,
            "question": ctx.question,
            "num_nodes": len(ctx.tree) - 1,
            "num_requests": ctx.num_requests,
            "tokens_generated": ctx.tokens_generated,
            "inflight": len(ctx.inflight),
            "answers": len(ctx.tree.terminals()),
            "elapsed": time.monotonic() - ctx.started,
            "result": self.result.to_dict() if self.result is not None else None,
        }


class SearchService:
    """The server's searches by id; runs each on the event loop, at most ``max_concurrent_searches`` at once."""

    def __init__(
        self,
        port: Callable[[], TokenizerManagerPort],
        cfg: SpexConfig,
        profile: Callable[[], ProfileManager],
        keep_finished: int = 256,
    ):
        self._port = port
        self.cfg = cfg
        self.max_concurrent = cfg.max_concurrent_searches
        self.max_queued = cfg.max_queued_searches
        self.reward_timeout = cfg.reward_timeout
        self.spex = SpexWiring(cfg, profile) if cfg.enabled else None
        self.context_factory: ContextFactory = self.spex.make_context if self.spex else SearchContext
        self.keep_finished = keep_finished
        self.searches: "OrderedDict[str, SearchHandle]" = OrderedDict()
        self._cancelling: Dict[str, "asyncio.Task[None]"] = {}  # searches being cancelled: their cancel's task
        self.rejected = 0  # searches refused with 429
        self._sem: Optional[asyncio.Semaphore] = None
        self._limits: Optional[SearchLimits] = None
        self._durations: Deque[float] = deque(maxlen=32)  # of recent finished searches, for Retry-After

    @property
    def port(self) -> TokenizerManagerPort:
        return self._port()

    async def limits(self) -> SearchLimits:
        """The per-search limits: the launcher's flags, ``auto`` ones from the live engine (asked once)."""
        if self._limits is None:
            configured = {name: getattr(self.cfg, name) for name in LIMIT_FIELDS}
            capacity = await self.port.capacity()
            self._limits = derive(configured, reward_hosts=self.cfg.reward_hosts, **capacity)
        return self._limits

    def counts(self) -> Dict[str, int]:
        """Searches running and waiting for a slot."""
        running = sum(1 for h in self.searches.values() if h.status == RUNNING)
        queued = sum(1 for h in self.searches.values() if h.status == QUEUED)
        return {"running": running, "queued": queued}

    def dp_loads(self) -> Dict[int, int]:
        """Unfinished searches per DP rank (``--dp-size`` > 1; empty otherwise)."""
        dp_size = int(getattr(self.port.tm.server_args, "dp_size", 1) or 1)
        if dp_size <= 1:
            return {}
        loads = {rank: 0 for rank in range(dp_size)}
        for h in self.searches.values():
            if not h.finished and h.ctx.dp_rank is not None:
                loads[h.ctx.dp_rank] += 1
        return loads

    def pick_dp_rank(self) -> Optional[int]:
        """The DP rank a new search's requests all go to: the one running the fewest searches (lowest on ties);
        None with one rank. Keeping a search on one rank keeps its prefix KV, budget, stats and protection
        together in one scheduler."""
        loads = self.dp_loads()
        return min(loads, key=lambda r: (loads[r], r)) if loads else None

    def retry_after(self) -> int:
        """Seconds a refused client should wait: the median duration of recent searches (1–600 s)."""
        if not self._durations:
            return 5
        return max(1, min(600, math.ceil(statistics.median(self._durations))))

    async def submit(self, body: SearchBody) -> SearchHandle:
        """Start a search. Raises :class:`SearchSpecError` for a bad spec or one over a limit,
        :class:`BodyError` for an id in use (409), :class:`Busy` when the queue is full."""
        spec = SearchSpec.from_dict(body.spec)
        if self.spex is None:
            check_without_speculation(spec.speculation)
        limits = await self.limits()
        prompt = spec.step.prompt_template.format(question=body.question)
        limits.check_spec(spec, prompt_tokens=await self.port.count_tokens(prompt))
        sid = body.search_id or secrets.token_hex(16)  # unguessable: the id is the caller's handle on it
        if sid in self.searches:
            raise BodyError("search_id", f"search {sid!r} exists; choose another id", 409)
        c = self.counts()
        if c["running"] + c["queued"] >= self.max_concurrent + self.max_queued:
            self.rejected += 1
            raise Busy(self.retry_after(), c)
        if self._sem is None:
            self._sem = asyncio.Semaphore(self.max_concurrent)
        ctx = self.context_factory(
            spec,
            body.question,
            self.port,
            reference=body.reference,
            search_id=sid,
            reward_timeout=self.reward_timeout,
        )
        ctx.limits = limits
        ctx.dp_rank = self.pick_dp_rank()
        handle = SearchHandle(sid, ctx)
        self.searches[sid] = handle
        handle.task = asyncio.create_task(self._run(handle), name=f"tot-search-{sid}")
        self._trim()
        return handle

    async def _run(self, h: SearchHandle) -> None:
        status, error = "cancelled", None
        try:
            async with self._sem:
                if not h.ctx.cancelled:
                    h.status = RUNNING
                    h.result = await h.ctx.run()  # (run closes the context itself, however it ends)
        except asyncio.CancelledError:
            pass
        except Exception as e:  # never lose a search silently
            status, error = "failed", repr(e)
        if h.status == QUEUED:  # it never ran (cancelled while it waited for a slot): close it as run would
            await _close_unstarted(h)
        if h.result is None:
            h.result = await _finish(h, status, error)
        h.status = h.result.status
        self._durations.append(time.time() - h.created)
        h.publish({"event": "result", "result": h.result.to_dict()})

    async def cancel(self, search_id: str, reason: str = "cancelled") -> Optional[SearchHandle]:
        """Cancel a search and return it finished: a queued one at once; a running one has its requests aborted
        in SGLang (by rid prefix) and ``CANCEL_GRACE_S`` to wind down (its aborted requests return), then its
        task is cancelled (e.g. while it waits on a slow reward). The work runs in its own task, so a caller
        cancelled meanwhile (a streaming client that went away) cuts nothing short."""
        h = self.searches.get(search_id)
        if h is None:
            return None
        if not h.finished and h.task is not None:
            job = self._cancelling.get(h.id)
            if job is None:
                job = self._cancelling[h.id] = asyncio.create_task(self._cancel(h, reason))
                job.add_done_callback(lambda _: self._cancelling.pop(h.id, None))
            await asyncio.shield(job)
        return h

    async def _cancel(self, h: SearchHandle, reason: str) -> None:
        if h.status == QUEUED:
            h.ctx.cancelled, h.ctx.stop_reason = True, h.ctx.stop_reason or reason
            h.task.cancel()
        else:
            await h.ctx.cancel(reason)
            await asyncio.wait({h.task}, timeout=CANCEL_GRACE_S)
            h.task.cancel()
        await asyncio.wait({h.task})

    def _trim(self) -> None:
        done = [k for k, h in self.searches.items() if h.finished]
        for k in done[: max(0, len(done) - self.keep_finished)]:
            del self.searches[k]

    def summary(self) -> Dict[str, Any]:
        return {
            "searches": [{"search_id": k, "status": h.status} for k, h in self.searches.items()],
            **self.counts(),
            "rejected": self.rejected,
            "inflight": sum(len(h.ctx.inflight) for h in self.searches.values()),
        }

    def info(self) -> Dict[str, Any]:
        """For ``/spex/info`` (which adds the limits in force, :meth:`limits`): the queue and rejections."""
        return {
            "max_concurrent_searches": self.max_concurrent,
            "max_queued_searches": self.max_queued,
            "max_body_bytes": self.cfg.max_body_bytes,
            **self.counts(),
            "rejected": self.rejected,
            "searches_per_dp_rank": self.dp_loads(),
        }


async def _close_unstarted(h: SearchHandle) -> None:
    """End a search that never ran as ``ctx.run()`` would have: ``ctx.close()``. A SPEX context registered in the
    server-wide T2 budget when it was made, and only its close (``finalize``) unregisters it and reports it; left
    registered it would be counted on every refill, and hold off ``--tot-k-total auto``'s re-profiles, forever. The
    close runs in its own task: a second cancel of this one cuts nothing short (a failure is logged)."""
    job = asyncio.ensure_future(h.ctx.close())
    job.add_done_callback(functools.partial(_log_close_failure, h.id))
    with contextlib.suppress(Exception, asyncio.CancelledError):
        await asyncio.shield(job)


def _log_close_failure(search_id: str, job: "asyncio.Future[None]") -> None:
    if not job.cancelled() and job.exception() is not None:
        logger.error("closing search %s (cancelled before it started) failed", search_id, exc_info=job.exception())


async def _finish(h: SearchHandle, status: str, error: Optional[str] = None) -> SearchResult:
    """The search's result with its answer judged off the event loop (unjudged if this task is cancelled again)."""
    try:
        return await h.ctx.finish(status, error)
    except asyncio.CancelledError:
        return h.ctx.result(status, error, judged=False)


# ---------------------------------------------------------------- routes
def _service(request: Request) -> SearchService:
    return getattr(request.app.state, STATE_ATTR).searches


def sse_frame(event: Dict[str, Any]) -> str:
    """One server-sent event: its ``event`` name and the JSON of the whole event as ``data``."""
    return f"event: {event.get('event', 'message')}\ndata: {json.dumps(event)}\n\n"


# An SSE stream with nothing to send for this long sends a comment (clients ignore it), so a proxy's idle timeout
# (nginx's default read timeout is 60 s) does not cut a quiet search (queued, or waiting on a slow reward): a cut
# search stream cancels its search.
KEEPALIVE_S = 15.0
KEEPALIVE = ": keep-alive\n\n"


async def _stream(svc: SearchService, h: SearchHandle, queue: StreamQueue) -> AsyncIterator[str]:
    try:
        yield sse_frame({"event": "started", "search_id": h.id})
        while True:
            try:
                event = await asyncio.wait_for(queue.get(), timeout=KEEPALIVE_S)  # (get is safe to cancel)
            except asyncio.TimeoutError:
                yield KEEPALIVE
                continue
            if event.get("event") == "result":
                yield sse_frame({**event, "dropped": queue.dropped} if queue.dropped else event)
                return
            yield sse_frame(event)
    finally:  # the client went away (or we finished): a search nobody listens to is cancelled
        if queue in h.subscribers:
            h.subscribers.remove(queue)
        if not h.finished:
            await svc.cancel(h.id, "client disconnected")


async def _wait_or_disconnect(svc: SearchService, h: SearchHandle, request: Request) -> None:
    while not h.task.done():
        await asyncio.wait({h.task}, timeout=DISCONNECT_POLL_S)
        if not h.task.done() and await request.is_disconnected():
            await svc.cancel(h.id, "client disconnected")
            return


def _unknown(search_id: str) -> JSONResponse:
    return error_response("search_id", f"unknown search {search_id!r}", status_code=404)


@json_body(SearchBody)
async def post_search(request: Request, body: SearchBody) -> Response:
    svc = _service(request)
    try:
        handle = await svc.submit(body)
    except SearchSpecError as e:
        return error_response(e.field, e.reason)
    except BodyError as e:
        return error_response(e.field, e.reason, e.status_code)
    except Busy as e:
        response = error_response("search", f"{e}; retry later", status_code=429)
        response.headers["Retry-After"] = str(e.retry_after)
        return response
    except EngineLost as e:  # the engine's limits could not be read (a scheduler not answering)
        return error_response("engine", str(e), status_code=503)
    if body.stream:
        return StreamingResponse(
            _stream(svc, handle, handle.subscribe()),
            media_type="text/event-stream",
            headers={"X-Search-Id": handle.id, "Cache-Control": "no-cache"},
        )
    await _wait_or_disconnect(svc, handle, request)
    await asyncio.wait({handle.task})
    return JSONResponse(handle.result.to_dict())


async def get_search(request: Request, search_id: str) -> Response:
    svc = _service(request)
    h = svc.searches.get(search_id)
    if h is None:
        return _unknown(search_id)
    info = h.info()
    info["engine_requests"] = len(svc.port.rids(search_rid_prefix(search_id)))  # of this search, in SGLang
    return JSONResponse(info)


async def delete_search(request: Request, search_id: str) -> Response:
    h = await _service(request).cancel(search_id)
    if h is None:
        return _unknown(search_id)
    return JSONResponse({"search_id": h.id, "status": h.status, "inflight": len(h.ctx.inflight)})


async def list_searches(request: Request) -> Response:
    return JSONResponse(_service(request).summary())


def install(app: FastAPI) -> None:
    """Add the ``/tot/search*`` routes to ``app`` (the service is ``app.state.spex.searches``)."""
    app.add_api_route("/tot/search", post_search, methods=["POST"])
    app.add_api_route("/tot/search/{search_id}", get_search, methods=["GET"])
    app.add_api_route("/tot/search/{search_id}", delete_search, methods=["DELETE"])
    app.add_api_route("/tot/searches", list_searches, methods=["GET"])
