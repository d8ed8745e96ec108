"""The client-side engine port: any SGLang HTTP endpoint (``/generate``, ``/abort_request``), or an sglang-router
in front of several of them.

``api_key`` is sent as ``Authorization: Bearer`` on every request (a server started with ``--api-key``). The SPEX
control calls (``/spex/promote``, ``/spex/release``) are admin-scoped: against a server with ``--admin-api-key``
they need that key, and without it they are refused and ignored (the search still runs, unprotected).

Behind sglang-router (``docs/scale.md``): every request of a search carries the router's affinity header
``X-SMG-Routing-Key: <search id>`` (``affinity=True``, the default; a plain SGLang server only logs it), so the
router's ``manual`` policy keeps the search on one worker. The router proxies neither ``/abort_request`` nor
``/spex/*``: when ``base_url`` answers ``GET /workers`` like a router, aborts go to every worker it lists (SGLang
ignores an abort for a rid it does not hold, so only the holder acts; one the router has just marked unhealthy may
still hold the search's requests), control calls only to those it lists healthy. Each of these calls waits at most
``CONTROL_TIMEOUT_S`` for a worker, so a hung worker that does not hold the search delays it by no more. A search
whose worker drops its connection, or that the router answers with an error of its own (any 5xx with an
``x-smg-error-code`` header: 500 ``call_upstream_request_error`` when the worker died mid-request, 503
``no_available_workers``; or a gateway's 502/504), is *lost*: its later requests fail at once with
:class:`WorkerLost` instead of landing on another worker with none of its cache. A worker's *own* 503 (SGLang's
load shedding: ``--max-queued-requests`` "The request queue is full.", or a queued request preempted by a higher
priority one, or one retracted under memory pressure) comes from a live worker, so it is *busy*, not lost: it
raises :class:`WorkerBusy` at once and the search goes on. Sending a refused primary again is the search's
(``tot/backpressure.py``, the same back-off as the in-process port's); a refused speculative request is a miss.

A request whose caller stops waiting (a cancel, or the client's timeout) is aborted: closing its connection stops
it on a plain server, not behind a router. An abort can also reach the worker before the ``/generate`` it is for
(which takes the router's hop), and SGLang ignores an abort for a rid it does not know yet: so behind a router
the abort of a cancelled or timed-out request is sent again after each of ``ABORT_WAITS_S`` but the last (its POST
is closed at once, freeing its connection, so whether it reached the worker is unknown), and an explicit
:meth:`HttpPort.abort` of a request still awaited is sent again the same way, anywhere, while its POST is open.

:meth:`HttpPort.capacity` asks the server (a router's first healthy worker) once for the model's context length
and longest prompt, :meth:`HttpPort.count_tokens` counts a prompt's tokens (``/tokenize``): the client-side runner
(``tot/search.py``) checks a question and ends a path at the context as the server does. An error answer of
``/generate`` fails its node with SGLang's reason (the start of the body).
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, Dict, List, Optional, Set

import httpx

from sglang_spex.scale.router import ROUTING_KEY_HEADER, affinity_key, parse_workers
from sglang_spex.tot.engine import EngineLost, EnginePort, GenRequest, GenResult
from sglang_spex.tot.validation import SearchSpecError

logger = logging.getLogger(__name__)

# An idle pooled connection is dropped before the server closes it (SGLang's uvicorn: SGLANG_TIMEOUT_KEEP_ALIVE,
# 5 s; httpx's own default is also 5 s): otherwise a request sent on a connection the server is closing fails with
# a read error although the server is fine, and the search would be taken for lost.
KEEPALIVE_EXPIRY_S = 2.0
WORKERS_TTL_S = 10.0  # how long the router's worker list is reused for aborts and control calls
# Per worker, for an abort or SPEX control call (and the router's /workers): they answer in milliseconds (a control
# call's acknowledgement within a scheduler step or so), so this only cuts short a hung or stopped worker.
CONTROL_TIMEOUT_S = 5.0
LOST_STATUS = (502, 504)  # a gateway reached no worker (SGLang itself never answers these)
BUSY_STATUS = 503  # without the router's header: a live worker shedding load (its queue is full)
ROUTER_ERROR_HEADER = "x-smg-error-code"  # sglang-router's own errors, e.g. 500 call_upstream_request_error
ERROR_BODY_CHARS = 500  # of an error answer's body kept in the error (SGLang's reason)
CLOSE_WAIT_S = 10.0  # how long close() waits for the abort loops to end (then they are cancelled)
# An abort is sent again after each of these waits but the last (at 0.1, 0.5 and 2 s): for a request nobody awaits
# any more every time (behind a router), for one still awaited while its POST is open; the last bounds that watch.
ABORT_WAITS_S = (0.1, 0.4, 1.5, 3.0)


def pool_limits(max_connections: Optional[int] = None) -> httpx.Limits:
    """Connection-pool limits for a long-lived client of an SGLang server (idle connections expire first)."""
    return httpx.Limits(max_connections=max_connections, keepalive_expiry=KEEPALIVE_EXPIRY_S)


def check_status(r: httpx.Response, what: str) -> None:
    """Raise :class:`httpx.HTTPStatusError` for an error answer, its message holding the start of the body (the
    server's reason, e.g. SGLang's ``{"error": {"message": ...}}``), which ``raise_for_status`` drops."""
    if r.is_error:
        raise httpx.HTTPStatusError(
            f"{what}: HTTP {r.status_code} {r.reason_phrase}: {r.text[:ERROR_BODY_CHARS]}",
            request=r.request,
            response=r,
        )


class NotASpexServer(RuntimeError):
    """The URL answers, but has no ``/tot/search``."""


def check_search_answer(r: httpx.Response) -> None:
    """Map an error answer of ``POST /tot/search`` to one exception with a one-line message: a 400 to
    :class:`SearchSpecError` naming the server's field, a 404 to :class:`NotASpexServer` (what the URL is instead),
    any other to :class:`httpx.HTTPStatusError` with the start of the body (e.g. 429: the server is busy)."""
    if r.status_code == 400:
        try:
            err = r.json()["error"]
            field, reason = str(err["field"]), str(err["reason"])
        except (ValueError, KeyError, TypeError):
            pass  # not the plugin's body: reported as the HTTP error below
        else:
            raise SearchSpecError(field, reason)
    elif r.status_code == 404:
        raise NotASpexServer(
            f"{r.url} not found: not a sglang-spex server (sglang-router and plain SGLang have no server-side "
            "search; search client-side through them with sglang_spex.tot.search and HttpPort)"
        )
    if r.is_error:
        said = " ".join(r.text[:ERROR_BODY_CHARS].split())
        raise httpx.HTTPStatusError(f"search: HTTP {r.status_code}: {said}", request=r.request, response=r)


class WorkerLost(EngineLost):
    """The worker holding a search's requests went away; the search cannot go on where its cache is."""


class WorkerBusy(httpx.HTTPStatusError):
    """A live worker refused a request (503: its queue is full, or a higher priority request took its place); the
    search is not lost (a primary is sent again by ``tot/backpressure.py``)."""


class HttpPort(EnginePort):
    def __init__(
        self,
        base_url: str,
        timeout: float = 600.0,
        client: Optional[httpx.AsyncClient] = None,
        api_key: Optional[str] = None,
        affinity: bool = True,
    ):
        self.base_url = base_url.rstrip("/")
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else None
        self.client = client or httpx.AsyncClient(timeout=timeout, limits=pool_limits(256), headers=headers)
        self.inflight: Set[str] = set()
        self.affinity = affinity
        self.lost: Dict[str, str] = {}  # search id -> why its worker is gone
        self._targets: Optional[List[str]] = None
        self._healthy: List[str] = []  # of _targets, those the router lists healthy (all of them for a server)
        self._targets_at = 0.0
        self._targets_expire = False  # a router's worker list expires (so does a failed lookup); a server's not
        self._targets_lock = asyncio.Lock()
        self._background: Set["asyncio.Future[None]"] = set()  # the abort loops; close() ends them
        self._aborting: Dict[str, "asyncio.Future[None]"] = {}  # rid -> its running abort loop
        self._posts: Dict[str, "asyncio.Future[httpx.Response]"] = {}  # rid -> its /generate POST, while awaited
        self._capacity: Optional[Dict[str, Optional[int]]] = None
        self._capacity_lock = asyncio.Lock()

    async def generate(self, req: GenRequest) -> GenResult:
        body: Dict[str, Any] = {"text": req.prompt, "sampling_params": req.sampling_params(), "rid": req.rid}
        if req.return_logprob:
            body["return_logprob"] = True
        if req.priority is not None:
            body["priority"] = req.priority
        if req.dp_rank is not None:
            body["routed_dp_rank"] = req.dp_rank
        key = affinity_key(req.search_id, req.rid) if self.affinity else None
        if key is not None and key in self.lost:
            raise WorkerLost(self.lost[key])
        headers = {ROUTING_KEY_HEADER: key} if key is not None else None
        pending = self._aborting.get(req.rid)
        if pending is not None:
            # A rid names one node of one search (``node_rid``), and a search never sends a node again once its
            # request was dropped (a cancelled search stops, a timed-out node fails); only a new search under the
            # same search id does. It is sent once the old request's abort loop is over, so no late abort of the
            # old request can stop it.
            await asyncio.wait({pending})
        self.inflight.add(req.rid)
        t0 = time.monotonic()
        r = await self._post_generate(req.rid, key, body, headers)
        self.inflight.discard(req.rid)
        if _busy(r):
            raise WorkerBusy(
                f"generate: worker busy, HTTP {r.status_code}: {r.text[:ERROR_BODY_CHARS]}",
                request=r.request,
                response=r,
            )
        if r.status_code >= 400 and "abort" in r.text.lower():
            return GenResult(rid=req.rid, text="", output_ids=[], finish_reason="abort")
        if r.status_code in LOST_STATUS or (r.status_code >= 500 and ROUTER_ERROR_HEADER in r.headers):
            raise self._lose(key, f"HTTP {r.status_code}: {r.text[:200]}")
        check_status(r, "generate")
        return GenResult.from_sglang(req.rid, r.json(), time.monotonic() - t0)

    async def _post_generate(
        self, rid: str, key: Optional[str], body: Dict[str, Any], headers: Optional[Dict[str, str]]
    ) -> httpx.Response:
        """One ``POST /generate``; a cancel or a timeout aborts the request, a broken connection loses the search."""
        post = asyncio.ensure_future(self.client.post(self.base_url + "/generate", json=body, headers=headers))
        self._posts[rid] = post
        try:
            return await post  # a cancel cancels the POST too: its connection (or its wait for one) ends at once
        except asyncio.CancelledError:
            # the rid stays in flight until its abort loop ends, so a prefix abort of its search still finds it
            self._start_abort(rid, None, dropped=True)
            raise
        except httpx.TimeoutException:  # the request may still run (behind a router it does)
            self._start_abort(rid, None, dropped=True)
            raise
        except BaseException as e:
            self.inflight.discard(rid)
            if isinstance(e, (httpx.NetworkError, httpx.RemoteProtocolError)):  # the connection to it broke
                raise self._lose(key, f"{type(e).__name__}: {e}") from e
            raise
        finally:
            self._posts.pop(rid, None)

    def _lose(self, key: Optional[str], why: str) -> WorkerLost:
        msg = f"the worker of search {key} is gone ({why})" if key else f"the engine is gone ({why})"
        if key is not None:
            self.lost.setdefault(key, msg)
        return WorkerLost(msg)

    def _targets_fresh(self) -> bool:
        if self._targets is None:
            return False
        return not self._targets_expire or time.monotonic() - self._targets_at <= WORKERS_TTL_S

    async def targets(self, healthy: bool = False) -> List[str]:
        """Where aborts (and, ``healthy``: control calls) go: the workers of an sglang-router at ``base_url`` (it
        does not proxy them), with ``healthy`` only those it lists ``is_healthy`` (a worker without the field
        counts as healthy), else ``base_url`` itself. One lookup at a time (concurrent callers share it); a
        router's list, or ``base_url`` after a lookup that failed, is reused for ``WORKERS_TTL_S``; a plain server
        (``/workers`` answers 404) is asked once."""
        if not self._targets_fresh():
            async with self._targets_lock:
                if not self._targets_fresh():
                    await self._lookup_targets()
        return self._healthy if healthy else self._targets

    async def _lookup_targets(self) -> None:
        try:
            r: Optional[httpx.Response] = await self.client.get(self.base_url + "/workers", timeout=CONTROL_TIMEOUT_S)
        except httpx.HTTPError:
            r = None
        workers = parse_workers(r) if r is not None else None
        # a plain server answers 404 (no such route), or a 200 that is not a router's list: asked once; a router's
        # list, no answer or any other error answer (e.g. a router's passing 5xx) is asked again after the TTL
        self._targets_expire = r is None or workers is not None or r.status_code not in (200, 404)
        if workers is None:
            self._targets, self._healthy = [self.base_url], [self.base_url]
        else:
            self._targets = [w["url"].rstrip("/") for w in workers]
            self._healthy = [w["url"].rstrip("/") for w in workers if w.get("is_healthy", True)]
        self._targets_at = time.monotonic()

    async def capacity(self) -> Dict[str, Optional[int]]:
        """The model's context length and longest prompt (``context_len``, ``max_input_len``, as
        ``TokenizerManagerPort.capacity`` names them), asked once of the server or a router's first healthy worker:
        ``/tokenize``'s ``max_model_len`` and ``/server_info``'s ``max_req_input_len``; None where it does not say
        (then nothing is checked against it)."""
        async with self._capacity_lock:
            if self._capacity is None:
                url = await self._first_worker()
                tokenize, info = await asyncio.gather(
                    self._get_json("POST", url + "/tokenize", {"prompt": ""}),
                    self._get_json("GET", url + "/server_info"),
                )
                self._capacity = {
                    "context_len": _int_at_least(tokenize.get("max_model_len"), 1),
                    "max_input_len": _int_at_least(info.get("max_req_input_len"), 1),
                }
        return self._capacity

    async def count_tokens(self, text: str) -> Optional[int]:
        """``text``'s length in the served model's tokens (``/tokenize``, special tokens added as ``/generate``
        adds them); None when the server cannot say."""
        out = await self._get_json("POST", await self._first_worker() + "/tokenize", {"prompt": text})
        return _int_at_least(out.get("count"), 0)

    async def _first_worker(self) -> str:
        """The server, or a router's first healthy worker (its first worker when none is healthy); raises
        :class:`EngineLost` for a router that lists no worker."""
        urls = (await self.targets(healthy=True)) or (await self.targets())
        if not urls:
            raise EngineLost(f"the router at {self.base_url} lists no workers (none registered yet?)")
        return urls[0]

    async def _get_json(self, method: str, url: str, body: Optional[Dict[str, Any]] = None) -> Dict[str, Any]:
        """The JSON object ``url`` answers; ``{}`` for an error, a non-object or no answer (an older or other
        server: the caller goes on without what it asked)."""
        try:
            r = await self.client.request(method, url, json=body)
            out = r.json() if r.status_code == 200 else {}
        except (httpx.HTTPError, ValueError):
            return {}
        return out if isinstance(out, dict) else {}

    async def _post_all(self, route: str, bodies: List[Dict[str, Any]], healthy: bool = False) -> None:
        """POST each body to every target (``healthy``: every healthy one), concurrently, each waiting at most
        ``CONTROL_TIMEOUT_S``; a worker that fails or does not answer is logged and skipped."""

        async def one(url: str, body: Dict[str, Any]) -> None:
            try:  # a dead or hung worker must not keep the others from acting
                await self.client.post(url + route, json=body, timeout=CONTROL_TIMEOUT_S)
            except httpx.HTTPError as e:
                logger.info("%s to %s failed: %s", route, url, type(e).__name__)

        if self.client.is_closed:  # close() has run: nothing can be sent any more
            logger.warning("%s not sent: the client of %s is closed", route, self.base_url)
            return
        try:
            urls = await self.targets(healthy=healthy)
            await asyncio.gather(*(one(u, b) for u in urls for b in bodies))
        except RuntimeError:  # httpx's "client has been closed", if close() ran meanwhile
            if not self.client.is_closed:
                raise
            logger.warning("%s not sent: the client of %s was closed", route, self.base_url)

    async def abort(self, rid_or_prefix: str) -> None:
        # SGLang's HTTP abort only reaches rids it knows by name: expand a prefix to our in-flight rids.
        rids = [r for r in list(self.inflight) if r.startswith(rid_or_prefix)]
        await self._abort_rids(rids)
        for rid in rids:  # sent again while its POST has not returned (it may not have reached the worker yet)
            post = self._posts.get(rid)
            if post is not None and not post.done():
                self._start_abort(rid, post, dropped=False)

    def _start_abort(self, rid: str, post: Optional["asyncio.Future[httpx.Response]"], dropped: bool) -> None:
        """Run :meth:`_abort_loop` for ``rid`` in the background, one loop per rid (``close()`` ends it)."""
        running = self._aborting.get(rid)
        if running is not None:  # an explicit abort's loop (it watched the POST): the drop's own loop follows it
            if dropped:
                running.add_done_callback(lambda _: self._start_abort(rid, None, dropped=True))
            return
        task = asyncio.ensure_future(self._abort_loop(rid, post, dropped))
        self._aborting[rid] = task
        self._background.add(task)

        def done(t: "asyncio.Future[None]") -> None:
            self._background.discard(t)
            if self._aborting.get(rid) is t:
                del self._aborting[rid]

        task.add_done_callback(done)

    async def _abort_loop(self, rid: str, post: Optional["asyncio.Future[httpx.Response]"], dropped: bool) -> None:
        """Abort ``rid`` (at once if ``dropped``; an explicit abort has just sent it), and again after each of
        ``ABORT_WAITS_S`` but the last while ``post`` (its ``/generate``; None: gone) has not returned.
        ``dropped`` (nobody awaits the request any more): one abort on a plain server (the closed connection stops
        the request too), and :meth:`_drop` at the end. Failures are logged, never raised."""
        try:
            if dropped and not self.client.is_closed:
                await self._abort_rids([rid])
                if self._targets == [self.base_url]:
                    return
            for wait_s in ABORT_WAITS_S[:-1]:
                if await _returned(post, wait_s) or self.client.is_closed:
                    return
                await self._abort_rids([rid])
            if post is not None and not await _returned(post, ABORT_WAITS_S[-1]):
                logger.warning("%s has not returned %.1f s after its first abort", rid, sum(ABORT_WAITS_S))
        except Exception:
            logger.exception("aborting %s failed", rid)
        finally:
            if dropped:
                self._drop(rid)

    def _drop(self, rid: str) -> None:
        """The abort loop of a request nobody awaits is over: it leaves ``inflight``."""
        self.inflight.discard(rid)

    async def _abort_rids(self, rids: List[str]) -> None:
        if rids:
            await self._post_all("/abort_request", [{"rid": rid} for rid in rids])

    async def _spex_control(self, route: str, body: Dict[str, Any]) -> None:
        # a sglang-spex server acts on it; any other server answers 404 (or 409 without SPEX): ignored
        await self._post_all(route, [body], healthy=True)

    async def promote(self, rid: str) -> None:
        await self._spex_control("/spex/promote", {"rid": rid, "ack": False})  # queued, not waited for

    async def release(self, search_id: str) -> None:
        await self._spex_control("/spex/release", {"search_id": search_id})

    async def close(self) -> None:
        """Close the client once the abort loops are over (at most ``CLOSE_WAIT_S``; then they are cancelled)."""
        if self._background:
            _, left = await asyncio.wait(set(self._background), timeout=CLOSE_WAIT_S)
            for task in left:
                task.cancel()
            if left:
                await asyncio.wait(left)
        await self.client.aclose()


async def _returned(post: Optional["asyncio.Future[httpx.Response]"], wait_s: float) -> bool:
    """Whether ``post`` is done within ``wait_s`` (None: a POST already gone, never)."""
    if post is None:
        await asyncio.sleep(wait_s)
        return False
    done, _ = await asyncio.wait({post}, timeout=wait_s)
    return bool(done)


def _busy(r: httpx.Response) -> bool:
    """A worker's own 503 (its queue is full), not the router's (which carries ``x-smg-error-code``)."""
    return r.status_code == BUSY_STATUS and ROUTER_ERROR_HEADER not in r.headers


def _int_at_least(value: Any, minimum: int) -> Optional[int]:
    """``value`` if it is an integer (not a bool) >= ``minimum``, else None (a server's answer read as unknown)."""
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= minimum else None
