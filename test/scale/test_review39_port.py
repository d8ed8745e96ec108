"""HttpPort and the client-side search's inputs (review 39, findings 1-5), against pure-Python stand-ins.

The router stand-in hands a ``/generate`` to its worker after a hop; the worker, as SGLang's
``TokenizerManager.abort_request`` does, ignores an abort for a rid it does not hold yet.
"""

from __future__ import annotations

import asyncio
import json
from typing import Dict, List, Optional

import httpx
import pytest

from sglang_spex.srt.http_api import SearchBody
from sglang_spex.tot import http_port
from sglang_spex.tot.context import SearchContext
from sglang_spex.tot.engine import EngineLost, GenRequest, node_rid
from sglang_spex.tot.http_port import HttpPort
from sglang_spex.tot.search import run_search
from sglang_spex.tot.search_spec import SearchSpec
from sglang_spex.tot.validation import SearchSpecError

ROUTER, W0 = "http://router:1", "http://w0:1"
HOP_S, GEN_S = 0.03, 0.6  # the router's hop to the worker; a request's run on it unless aborted
OK = {"text": "x", "output_ids": [1], "meta_info": {"finish_reason": {"type": "length"}, "prompt_tokens": 3}}
ABORTED = {"text": "", "output_ids": [], "meta_info": {"finish_reason": {"type": "abort"}, "prompt_tokens": 3}}


class RouterModel:
    """A router (``GET /workers`` lists W0) in front of one worker; records every request it sees."""

    def __init__(self, generate_s: float = GEN_S) -> None:
        self.generate_s = generate_s
        self.registered: Dict[str, asyncio.Event] = {}
        self.outcome: Dict[str, str] = {}
        self.ignored: List[str] = []
        self.seen: List[httpx.Request] = []

    async def _worker(self, rid: str, generate_s: float) -> dict:
        await asyncio.sleep(HOP_S)
        ev = self.registered[rid] = asyncio.Event()
        try:
            await asyncio.wait_for(ev.wait(), generate_s)
        except asyncio.TimeoutError:
            self.outcome[rid] = "ran to completion"
            return OK
        finally:
            del self.registered[rid]
        self.outcome[rid] = "aborted"
        return ABORTED

    async def handler(self, request: httpx.Request) -> httpx.Response:
        self.seen.append(request)
        url = str(request.url)
        if url == ROUTER + "/workers":
            return httpx.Response(200, json={"workers": [{"url": W0, "is_healthy": True}]})
        if url == ROUTER + "/generate":
            rid = json.loads(request.content)["rid"]
            worker = asyncio.get_running_loop().create_task(self._worker(rid, self.generate_s))
            return httpx.Response(200, json=await asyncio.shield(worker))  # a client's cancel does not stop it
        if url == W0 + "/abort_request":
            rid = json.loads(request.content)["rid"]
            if rid in self.registered:
                self.registered[rid].set()
            else:
                self.ignored.append(rid)
            return httpx.Response(200, json={})
        return httpx.Response(404)

    def port(self) -> HttpPort:
        return HttpPort(ROUTER, client=httpx.AsyncClient(transport=httpx.MockTransport(self.handler)))

    def paths(self, path: str) -> List[str]:
        return [str(r.url) for r in self.seen if r.url.path == path]

    async def outcome_of(self, rid: str) -> Optional[str]:
        for _ in range(100):
            if rid in self.outcome:
                break
            await asyncio.sleep(0.02)
        return self.outcome.get(rid)


def _req(search: str = "s1", path: str = "r.0") -> GenRequest:
    return GenRequest(prompt="q", rid=node_rid(search, path), search_id=search, node_path=path, max_new_tokens=9)


async def _cancel_in_flight(port: HttpPort, req) -> None:
    """Start ``req`` once the worker list is known (as in a running search) and cancel it 5 ms later, while it is
    still on its way through the router."""
    await port.targets()
    task = asyncio.create_task(port.generate(req))
    await asyncio.sleep(0.005)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task


# ---- finding 1: an abort that beats its /generate through the router --------------------------------------


async def test_a_cancel_during_the_router_hop_still_aborts_the_request():
    """Old: the one abort reached the worker before the request (ignored), and the request ran to the end."""
    router = RouterModel()
    port = router.port()
    req = _req()
    await _cancel_in_flight(port, req)
    assert await router.outcome_of(req.rid) == "aborted"
    assert router.ignored  # the first abort did come too early
    await port.close()
    assert not port.inflight and not port._background and not port._aborting


async def test_an_explicit_abort_during_the_router_hop_is_sent_again():
    """SPEX cancels a speculative request with ``port.abort(rid)`` while it is awaited: the same race."""
    router = RouterModel()
    port = router.port()
    await port.targets()
    req = _req()
    task = asyncio.create_task(port.generate(req))
    await asyncio.sleep(0.005)
    await port.abort(req.rid)
    res = await asyncio.wait_for(task, 5.0)
    assert res.aborted and router.outcome[req.rid] == "aborted"
    await port.close()
    assert not port.inflight and not port._background


async def test_a_late_abort_cannot_stop_a_new_request_with_the_same_rid(monkeypatch):
    """A search id used again sends the same rids: the new request waits until the old one's aborts are sent."""
    monkeypatch.setattr(http_port, "ABORT_WAITS_S", (0.05, 0.05, 0.05, 0.1), raising=False)
    router = RouterModel(generate_s=30.0)
    port = router.port()
    await port.targets()
    req = _req()
    first = asyncio.create_task(port.generate(req))
    await asyncio.sleep(0.005)
    first.cancel()
    with pytest.raises(asyncio.CancelledError):
        await first
    router.generate_s = 0.05  # the new request runs briefly and ends (the old one would run 30 s)
    res = await asyncio.wait_for(port.generate(req), 5.0)
    kinds = [r.url.path for r in router.seen if r.url.path in ("/generate", "/abort_request")]
    last_generate = len(kinds) - 1 - kinds[::-1].index("/generate")
    assert "/abort_request" not in kinds[last_generate:]  # every abort of the old request came before it
    assert kinds.count("/abort_request") >= 2 and res.text == "x"
    await port.close()


class DeafWorker:
    """A router in front of W0, whose ``/generate`` runs until W0 hears an abort (else ``generate_s``, then ends);
    W0 hears only the ``hears``-th abort. Logs each abort and each returned ``/generate`` in order."""

    def __init__(self, hears: int, generate_s: float) -> None:
        self.hears, self.generate_s = hears, generate_s
        self.stop = asyncio.Event()
        self.log: List[str] = []

    async def handler(self, request: httpx.Request) -> httpx.Response:
        if str(request.url) == ROUTER + "/workers":
            return httpx.Response(200, json={"workers": [{"url": W0, "is_healthy": True}]})
        if str(request.url) == ROUTER + "/generate":
            try:
                await asyncio.wait_for(self.stop.wait(), self.generate_s)
                body = ABORTED
            except asyncio.TimeoutError:
                body = OK
            self.log.append("generate")
            return httpx.Response(200, json=body)
        if str(request.url) == W0 + "/abort_request":
            self.log.append("abort")
            if self.log.count("abort") >= self.hears:
                self.stop.set()
            return httpx.Response(200, json={})
        return httpx.Response(404)

    def port(self) -> HttpPort:
        return HttpPort(ROUTER, client=httpx.AsyncClient(transport=httpx.MockTransport(self.handler)))


async def test_a_cancelled_request_behind_a_router_is_aborted_once_per_abort_wait(monkeypatch):
    """Its POST is gone, so whether it reached the worker is unknown: the abort is sent at once and after each of
    ``ABORT_WAITS_S`` but the last, ``len(ABORT_WAITS_S)`` times in all."""
    monkeypatch.setattr(http_port, "ABORT_WAITS_S", (0.01, 0.01, 0.01, 0.01))
    worker = DeafWorker(hears=99, generate_s=30.0)
    port = worker.port()
    await _cancel_in_flight(port, _req())
    await port.close()  # waits for the abort loop
    assert worker.log == ["abort"] * len(http_port.ABORT_WAITS_S)


async def test_an_explicit_abort_is_sent_again_until_the_last_wait_and_never_after_its_post_returned(monkeypatch):
    """A worker that hears only the last scheduled abort still ends the request aborted; then no abort follows."""
    monkeypatch.setattr(http_port, "ABORT_WAITS_S", (0.01, 0.01, 0.01, 0.05))
    worker = DeafWorker(hears=len(http_port.ABORT_WAITS_S), generate_s=1.0)
    port = worker.port()
    await port.targets()
    req = _req()
    task = asyncio.create_task(port.generate(req))
    await asyncio.sleep(0.005)
    await port.abort(req.rid)
    res = await asyncio.wait_for(task, 5.0)
    await port.close()
    assert res.aborted and worker.log == ["abort"] * len(http_port.ABORT_WAITS_S) + ["generate"]


async def test_close_ends_the_abort_loops_it_does_not_wait_out(monkeypatch):
    monkeypatch.setattr(http_port, "CLOSE_WAIT_S", 0.2)
    router = RouterModel(generate_s=30.0)
    port = router.port()
    await _cancel_in_flight(port, _req())
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    await port.close()
    assert loop.time() - t0 < 2.0
    assert not port._background and not port._aborting and not port.inflight


# ---- finding 2: a /generate the client timed out on -------------------------------------------------------


async def test_a_timed_out_generate_is_aborted_not_lost(monkeypatch):
    """Old: the timeout was re-raised with no abort, and behind the router the worker ran the request on."""
    monkeypatch.setattr(http_port, "ABORT_WAITS_S", (0.01, 0.01, 0.01, 0.01), raising=False)
    seen: List[httpx.Request] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        if str(request.url) == ROUTER + "/workers":
            return httpx.Response(200, json={"workers": [{"url": W0, "is_healthy": True}]})
        if request.url.path == "/generate":
            raise httpx.ReadTimeout("timed out", request=request)
        return httpx.Response(200, json={})

    port = HttpPort(ROUTER, client=httpx.AsyncClient(transport=httpx.MockTransport(handler)))
    req = _req()
    with pytest.raises(httpx.ReadTimeout):
        await port.generate(req)
    await port.close()
    aborts = [r for r in seen if r.url.path == "/abort_request"]
    assert aborts and {str(r.url) for r in aborts} == {W0 + "/abort_request"}
    assert all(json.loads(r.content) == {"rid": req.rid} for r in aborts)
    assert not port.lost and not port.inflight


# ---- finding 3: the search id, checked client-side by the server's rule -----------------------------------

BAD_IDS = ["a:b", "søk", "", "x" * 65, "bad\nid", "bad\n", "\nbad", "with space", 5]
GOOD_IDS = ["s1", "A-b_9", "x" * 64]


@pytest.mark.parametrize("sid", BAD_IDS + GOOD_IDS)
def test_the_client_takes_a_search_id_exactly_when_the_server_does(sid):
    try:
        SearchBody(question="q", search_id=sid)
        server_ok = True
    except ValueError:  # pydantic's ValidationError
        server_ok = False
    try:
        SearchContext(SearchSpec(), "q", HttpPort(ROUTER), search_id=sid)
        client_ok = True
    except SearchSpecError as e:
        assert e.field == "search_id" and "\n" not in str(e)
        client_ok = False
    assert client_ok == server_ok == (sid in GOOD_IDS)


@pytest.mark.parametrize("sid", ["a:b", "søk"])
async def test_run_search_refuses_a_bad_search_id_before_any_request(sid):
    """Old: ``a:b`` ran (its rids unparsable for the worker, its cancel-prefix shared with search ``a``), ``søk``
    failed every node with a UnicodeEncodeError."""
    seen: List[httpx.Request] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        return httpx.Response(404)

    port = HttpPort(ROUTER, client=httpx.AsyncClient(transport=httpx.MockTransport(handler)))
    with pytest.raises(SearchSpecError) as err:
        await run_search(SearchSpec(), "What is 2 + 3?", port, search_id=sid)
    assert err.value.field == "search_id" and not seen
    await port.close()


# ---- findings 4 and 5: the router's worker list -----------------------------------------------------------


@pytest.mark.parametrize("first", [503, 401, 429])
async def test_a_failed_workers_lookup_is_asked_again_and_only_a_404_means_a_plain_server(monkeypatch, first):
    """Old: one 503 from ``GET /workers`` made the router a plain server for good (aborts and control to it). Any
    error answer but a 404 (a 401 from a router whose ``/workers`` needs a key, a 429) is asked again too."""
    monkeypatch.setattr(http_port, "WORKERS_TTL_S", 0.0)
    answers = [first, 200]
    seen: List[httpx.Request] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        if request.url.path == "/workers":
            code = answers.pop(0) if answers else 200
            body = {"workers": [{"url": W0, "is_healthy": True}]} if code == 200 else {"error": "busy"}
            return httpx.Response(code, json=body)
        return httpx.Response(404 if str(request.url).startswith(ROUTER) else 200, json={})

    port = HttpPort(ROUTER, client=httpx.AsyncClient(transport=httpx.MockTransport(handler)))
    assert await port.targets() == [ROUTER]  # not known yet: the router itself meanwhile
    await asyncio.sleep(0.01)
    assert await port.targets() == [W0]
    await port.release("s1")
    assert [str(r.url) for r in seen if r.url.path == "/spex/release"] == [W0 + "/spex/release"]
    await port.close()

    plain: List[httpx.Request] = []
    server = HttpPort(
        "http://server:1",
        client=httpx.AsyncClient(transport=httpx.MockTransport(lambda r: plain.append(r) or httpx.Response(404))),
    )
    for _ in range(3):
        assert await server.targets() == ["http://server:1"]
    assert sum(r.url.path == "/workers" for r in plain) == 1  # no /workers route: a plain server, asked once
    await server.close()


async def test_a_router_listing_no_workers_fails_in_one_line():
    """Old: ``capacity()`` (run by every client-side search first) raised a bare IndexError."""

    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/workers":
            return httpx.Response(200, json={"workers": []})
        return httpx.Response(200, json={})

    port = HttpPort(ROUTER, client=httpx.AsyncClient(transport=httpx.MockTransport(handler)))
    with pytest.raises(EngineLost, match="lists no workers") as err:
        await port.capacity()
    assert ROUTER in str(err.value) and "\n" not in str(err.value)
    with pytest.raises(EngineLost, match="lists no workers"):
        await run_search(SearchSpec(), "What is 2 + 3?", port)
    await port.close()


# ---- diff review: a cancel frees the request's connection at once -------------------------------------------


class PoolTransport(httpx.AsyncBaseTransport):
    """A pool of ``size`` connections, one held while a request is handled (as httpcore holds it until read)."""

    def __init__(self, handler, size: int) -> None:
        self.handler, self.sem = handler, asyncio.Semaphore(size)

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        await asyncio.wait_for(self.sem.acquire(), 1.0)  # httpx's pool timeout, shortened
        try:
            resp = await self.handler(request)
            await resp.aread()
            return resp
        finally:
            self.sem.release()


async def test_a_cancel_frees_its_connection_so_a_full_pools_aborts_go_out():
    """With every pool connection held by a request, cancelling them all must still abort them all. The first version
    of the abort loops kept a cancelled request's POST open, so every abort waited for the pool and failed."""
    router = RouterModel(generate_s=5.0)
    port = HttpPort(ROUTER, client=httpx.AsyncClient(transport=PoolTransport(router.handler, size=2)))
    await port.targets()
    reqs = [_req(path=f"r.{i}") for i in range(2)]
    tasks = [asyncio.create_task(port.generate(r)) for r in reqs]
    await asyncio.sleep(0.2)  # both run on the worker; the pool is full
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    assert [await router.outcome_of(r.rid) for r in reqs] == ["aborted", "aborted"]
    await port.close()


async def test_a_request_cancelled_while_it_waits_for_a_connection_is_never_sent():
    router = RouterModel(generate_s=0.4)
    port = HttpPort(ROUTER, client=httpx.AsyncClient(transport=PoolTransport(router.handler, size=1)))
    await port.targets()
    first, second = _req(path="r.0"), _req(path="r.1")
    running = asyncio.create_task(port.generate(first))  # holds the one connection
    await asyncio.sleep(0.05)
    waiting = asyncio.create_task(port.generate(second))
    await asyncio.sleep(0.05)
    waiting.cancel()
    await asyncio.gather(running, waiting, return_exceptions=True)
    await asyncio.sleep(0.3)
    sent = [json.loads(r.content)["rid"] for r in router.seen if r.url.path == "/generate"]
    assert sent == [first.rid]  # the first version sent it once a connection freed, and it ran to the end
    await port.close()
