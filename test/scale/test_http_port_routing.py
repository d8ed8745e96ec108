"""HttpPort's routing logic against a recorded router stand-in (pure logic; the real router is in test_router.py)."""

from __future__ import annotations

import asyncio
import json
from typing import List, Tuple

import httpx
import pytest

from sglang_spex.tot.engine import GenRequest, node_rid
from sglang_spex.tot.http_port import HttpPort, WorkerBusy, WorkerLost

ROUTER = "http://router:1"
WORKERS = ["http://w0:1", "http://w1:1"]
OK = {"text": "x", "output_ids": [1], "meta_info": {"finish_reason": {"type": "length"}, "prompt_tokens": 3}}


def _port(handler) -> Tuple[HttpPort, List[httpx.Request]]:
    seen: List[httpx.Request] = []

    def record(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        if str(request.url) == ROUTER + "/workers":
            return httpx.Response(200, json={"workers": [{"url": u, "is_healthy": True} for u in WORKERS]})
        return handler(request)

    client = httpx.AsyncClient(transport=httpx.MockTransport(record))
    return HttpPort(ROUTER, client=client), seen


def _req(search: str, path: str = "r.0") -> GenRequest:
    return GenRequest(prompt="q", rid=node_rid(search, path), search_id=search, node_path=path)


async def test_every_request_of_a_search_carries_its_key():
    port, seen = _port(lambda r: httpx.Response(200, json=OK))
    await port.generate(_req("s1", "r.0"))
    await port.generate(_req("s1", "r.0.1"))
    await port.generate(GenRequest(prompt="q", rid=node_rid("s2", "r.0")))  # the key read from the rid
    assert [r.headers["x-smg-routing-key"] for r in seen] == ["s1", "s1", "s2"]
    off = HttpPort(ROUTER, client=httpx.AsyncClient(transport=httpx.MockTransport(lambda r: httpx.Response(200, json=OK))),
                   affinity=False)  # fmt: skip
    res = await off.generate(_req("s1"))
    assert res.text == "x"


async def test_aborts_and_control_go_to_every_worker_the_router_lists():
    gate = asyncio.Event()

    async def slow(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/generate":
            await gate.wait()
        return httpx.Response(200, json=OK)

    seen: List[httpx.Request] = []

    async def record(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        if str(request.url) == ROUTER + "/workers":
            return httpx.Response(200, json={"workers": [{"url": u} for u in WORKERS]})
        return await slow(request)

    port = HttpPort(ROUTER, client=httpx.AsyncClient(transport=httpx.MockTransport(record)))
    task = asyncio.create_task(port.generate(_req("s1", "r.0")))
    await asyncio.sleep(0.05)
    await port.abort("spex:s1:")
    await port.release("s1")
    aborts = sorted(str(r.url) for r in seen if r.url.path == "/abort_request")
    assert aborts == sorted(u + "/abort_request" for u in WORKERS)
    assert all(json.loads(r.content) == {"rid": "spex:s1:r.0:"} for r in seen if r.url.path == "/abort_request")
    assert sorted(str(r.url) for r in seen if r.url.path == "/spex/release") == [u + "/spex/release" for u in WORKERS]
    assert not any(str(r.url).startswith(ROUTER + "/abort") for r in seen)  # the router does not proxy it
    gate.set()
    await task


async def test_a_cancelled_generate_aborts_its_request():
    async def never(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/generate":
            await asyncio.Event().wait()
        return httpx.Response(404)

    seen: List[httpx.Request] = []

    async def record(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        return await never(request)

    port = HttpPort(ROUTER, client=httpx.AsyncClient(transport=httpx.MockTransport(record)))
    task = asyncio.create_task(port.generate(_req("s1")))
    await asyncio.sleep(0.05)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    for _ in range(50):
        if not port.inflight:
            break
        await asyncio.sleep(0.02)
    assert [json.loads(r.content) for r in seen if r.url.path == "/abort_request"] == [{"rid": "spex:s1:r.0:"}]
    assert not port.inflight  # a plain server (no /workers): the abort went to base_url itself


async def test_a_router_error_loses_the_search_and_later_requests_fail_at_once():
    def dead(request: httpx.Request) -> httpx.Response:
        if request.headers.get("x-smg-routing-key") == "victim":
            return httpx.Response(500, headers={"x-smg-error-code": "call_upstream_request_error"}, json={})
        return httpx.Response(200, json=OK)

    port, seen = _port(dead)
    with pytest.raises(WorkerLost):
        await port.generate(_req("victim", "r.0"))
    n = len(seen)
    with pytest.raises(WorkerLost):
        await port.generate(_req("victim", "r.1"))
    assert len(seen) == n  # not sent: it would land on a worker without the search's cache
    assert (await port.generate(_req("other"))).text == "x"  # other searches are untouched
    plain, _ = _port(lambda r: httpx.Response(500, json={"error": "boom"}))  # a worker's own 500 is not a loss
    with pytest.raises(httpx.HTTPStatusError):
        await plain.generate(_req("s"))
    assert not plain.lost


def test_pooled_connections_expire_before_sglang_closes_them():
    """An idle connection SGLang's uvicorn is closing (its keep-alive timeout) must never be reused: a request sent
    on it fails with a read error and the search would be taken for lost (64 concurrent client-side searches lost
    2-3 that way before the pool's expiry was set below the server's)."""
    from sglang.srt.environ import envs

    port = HttpPort("http://server:1")
    pool = port.client._transport._pool
    assert pool._keepalive_expiry < envs.SGLANG_TIMEOUT_KEEP_ALIVE.get() - 1.0
    asyncio.run(port.client.aclose())


QUEUE_FULL = {"object": "error", "message": "The request queue is full.", "type": "Service Unavailable", "code": 503}


async def test_a_workers_own_503_is_busy_not_lost_and_the_search_sends_it_again(monkeypatch):
    """SGLang's load shedding (--max-queued-requests) answers 503 from a live worker, passed through by the router
    unchanged (no x-smg-error-code): HttpPort raises WorkerBusy at once (no retry loop of its own) and the search is
    not lost; the search's back-pressure (the one retry loop, shared with the in-process port) sends a primary
    again until it is served."""
    from sglang_spex.tot import backpressure

    monkeypatch.setattr(backpressure, "QUEUE_FULL_BACKOFF_S", (0.0, 0.0, 0.0))
    answers = [503, 200]

    def flaky(request: httpx.Request) -> httpx.Response:
        code = answers.pop(0) if answers else 503
        return httpx.Response(code, json=OK if code == 200 else QUEUE_FULL)

    port, seen = _port(flaky)
    with pytest.raises(WorkerBusy) as err:  # one POST, refused: busy, not lost
        await port.generate(_req("s1", "r.0"))
    assert not isinstance(err.value, WorkerLost) and "queue is full" in str(err.value)
    assert not port.lost and not port.inflight and len(seen) == 1
    assert (await port.generate(_req("s1", "r.1"))).text == "x"  # the search's next request is sent and served
    answers[:] = [503, 503, 200]
    gate = backpressure.gate_for(port)
    assert (await gate.generate_primary(port, _req("s1", "r.2"))).text == "x"  # refused twice, then served
    assert [json.loads(r.content)["rid"] for r in seen[2:]] == ["spex:s1:r.2:"] * 3
    assert not gate.spec_ok()  # the queue was at its cap just now: speculation held
    with pytest.raises(backpressure.QueueFull):  # refused after every back-off: only this node fails
        await gate.generate_primary(port, _req("s1", "r.3"))
    assert not port.lost and not port.inflight


async def test_the_routers_own_errors_still_lose_the_search():
    for status, headers in ((503, {"x-smg-error-code": "no_available_workers"}), (502, {}), (504, {})):
        port, _ = _port(lambda r, s=status, h=headers: httpx.Response(s, headers=h, json={"error": "x"}))
        with pytest.raises(WorkerLost):
            await port.generate(_req("s1"))
        assert "s1" in port.lost, status


async def test_a_search_cancelled_while_its_refused_primary_waits_does_not_send_it_again(monkeypatch):
    """The search's back-off over a real HttpPort: cancelled during the wait (``SearchContext.cancel`` sets the flag
    the gate reads), the refused primary is not sent again and nothing of it is left in flight."""
    from sglang_spex.tot import backpressure

    monkeypatch.setattr(backpressure, "QUEUE_FULL_BACKOFF_S", (0.3, 0.3))
    port, seen = _port(lambda r: httpx.Response(503, json=QUEUE_FULL))
    cancelled = []
    task = asyncio.create_task(
        backpressure.gate_for(port).generate_primary(port, _req("s1", "r.0"), cancelled=lambda: bool(cancelled))
    )
    await asyncio.sleep(0.1)
    cancelled.append(True)
    res = await task
    assert res.aborted and not port.lost and not port.inflight
    assert sum(r.url.path == "/generate" for r in seen) == 1
