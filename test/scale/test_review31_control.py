"""Control calls that must not hang on one bad worker or DP rank (review 31, findings 1 and 3), without a server.

Finding 1: ``HttpPort``'s aborts and SPEX control calls behind a router, one listed worker hung (a socket that
accepts and never answers, as a SIGSTOPped server does) and one listed unhealthy. Finding 3: the control channel's
``get_internal_state`` round trip against a stand-in tokenizer manager one of whose DP ranks never answers (SGLang's
fan-out communicator waits for every rank), and ``/spex/info`` on it.
"""

from __future__ import annotations

import asyncio
import json
import time
from types import SimpleNamespace
from typing import List

import httpx
import pytest
from fastapi import FastAPI
from sglang.srt.managers.communicator import FanOutCommunicator

from sglang_spex.config import SpexConfig
from sglang_spex.srt import control, control_routes, routes
from sglang_spex.srt.engine_port import TokenizerManagerPort
from sglang_spex.srt.http_state import SpexHttpState, attach
from sglang_spex.tot import http_port
from sglang_spex.tot.engine import EngineLost
from sglang_spex.tot.http_port import HttpPort

ROUTER, W0, W_DOWN = "http://router:1", "http://w0:1", "http://w9:1"
CLIENT_TIMEOUT_S = 60.0  # a search client's own timeout (HttpPort's default is 600 s)


def _router_port(hung: str, seen: List[httpx.Request]) -> HttpPort:
    """A port on a router listing W0 (answers), ``hung`` (listed healthy) and W_DOWN (listed unhealthy)."""
    workers = [
        {"url": W0, "is_healthy": True},
        {"url": hung, "is_healthy": True},
        {"url": W_DOWN, "is_healthy": False},
    ]

    def answer(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        if str(request.url) == ROUTER + "/workers":
            return httpx.Response(200, json={"workers": workers})
        return httpx.Response(200, json={"ok": True})

    mock = httpx.MockTransport(answer)
    mounts = {"all://router:1": mock, "all://w0:1": mock, "all://w9:1": mock}
    return HttpPort(ROUTER, client=httpx.AsyncClient(timeout=CLIENT_TIMEOUT_S, mounts=mounts))


async def test_a_hung_worker_delays_control_calls_by_the_control_timeout_only(hung_worker, monkeypatch):
    monkeypatch.setattr(http_port, "CONTROL_TIMEOUT_S", 0.5, raising=False)
    seen: List[httpx.Request] = []
    port = _router_port(hung_worker, seen)
    port.inflight.add("spex:s1:r.0:")
    for call in (port.release("s1"), port.promote("spex:s1:r.0:spec"), port.abort("spex:s1:")):
        t0 = time.monotonic()
        await asyncio.wait_for(call, 10.0)  # old: each waited the client's whole timeout (60 s) on the hung worker
        assert time.monotonic() - t0 < 5.0
    sent = sorted((r.url.host, r.url.path) for r in seen if r.url.path != "/workers")
    # the unhealthy worker got no control call, but the abort (it may hold the search's requests)
    assert sent == [
        ("w0", "/abort_request"),
        ("w0", "/spex/promote"),
        ("w0", "/spex/release"),
        ("w9", "/abort_request"),
    ]
    await port.client.aclose()


async def test_aborts_still_reach_every_listed_worker_healthy_or_not(monkeypatch):
    seen: List[httpx.Request] = []
    workers = [{"url": W0, "is_healthy": True}, {"url": W_DOWN, "is_healthy": False}]

    def answer(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        if request.url.path == "/workers":
            return httpx.Response(200, json={"workers": workers})
        return httpx.Response(200, json={})

    port = HttpPort(ROUTER, client=httpx.AsyncClient(transport=httpx.MockTransport(answer)))
    port.inflight.add("spex:s1:r.0:")
    await port.abort("spex:s1:")
    await port.release("s1")
    aborts = sorted(str(r.url) for r in seen if r.url.path == "/abort_request")
    assert aborts == [W0 + "/abort_request", W_DOWN + "/abort_request"]  # the holder may be the one marked down
    assert [str(r.url) for r in seen if r.url.path == "/spex/release"] == [W0 + "/spex/release"]
    assert all(json.loads(r.content) == {"rid": "spex:s1:r.0:"} for r in seen if r.url.path == "/abort_request")


# ---------------------------------------------------------------- finding 3: a DP rank that never answers


class StandInTokenizerManager:
    """What the control channel uses of SGLang's TokenizerManager; ``answering`` of ``dp_size`` ranks answer a
    state request (through SGLang's own fan-out communicator, which waits for every rank)."""

    def __init__(self, dp_size: int = 2, answering: int = 1):
        self.server_args = SimpleNamespace(dp_size=dp_size)
        self.sent: list = []
        self.answering = answering
        self.comm = FanOutCommunicator(self._send, dp_size)

    def auto_create_handle_loop(self) -> None:
        pass

    def _dispatch_to_scheduler(self, req) -> None:
        self.sent.append(req)

    def _send(self, req) -> None:
        loop = asyncio.get_running_loop()
        for rank in range(self.answering):
            reply = SimpleNamespace(internal_state={"spex": {"sched": {"dp_rank": rank}}})
            loop.call_soon(self.comm.handle_recv, reply)

    async def get_internal_state(self) -> list:
        return [r.internal_state for r in await self.comm(object())]


async def test_a_control_command_returns_when_a_rank_never_answers(monkeypatch):
    monkeypatch.setattr(control, "SCHEDULER_TIMEOUT_S", 0.3, raising=False)
    tm = StandInTokenizerManager(dp_size=2, answering=1)
    req = control.SpexControlReq(op="release", search_id="s1")
    t0 = time.monotonic()
    states = await asyncio.wait_for(control.send_all(tm, req), 5.0)  # old: never returned
    assert time.monotonic() - t0 < 3.0
    assert tm.sent == [req]  # the command went out all the same
    assert [s["dp_rank"] for s in states] == [0, 1] and all("error" in s for s in states)
    # the abandoned round trip leaves SGLang's communicator usable: the next one is bounded too, and a full
    # answer still comes through once every rank answers
    assert "error" in (await asyncio.wait_for(control.send(tm, req), 5.0))
    tm.answering = 2
    assert await asyncio.wait_for(control.scheduler_states(tm), 5.0) == [{"dp_rank": 0}, {"dp_rank": 1}]


def _info_app(tm: StandInTokenizerManager) -> FastAPI:
    app = FastAPI()
    attach(app, SpexHttpState(SpexConfig(), lambda: SimpleNamespace(tokenizer_manager=tm)))
    app.add_api_route("/spex/info", routes.get_info, methods=["GET"])
    return app


async def test_spex_info_answers_503_when_a_rank_never_answers(monkeypatch):
    monkeypatch.setattr(control, "SCHEDULER_TIMEOUT_S", 0.3, raising=False)
    tm = StandInTokenizerManager(dp_size=2, answering=1)
    transport = httpx.ASGITransport(app=_info_app(tm))
    async with httpx.AsyncClient(transport=transport, base_url="http://spex") as client:
        r = await asyncio.wait_for(client.get("/spex/info"), 5.0)  # old: never answered
    assert r.status_code == 503
    assert r.json()["error"]["field"] == "scheduler"


async def test_a_control_post_not_acknowledged_in_time_is_a_503_naming_the_scheduler(monkeypatch):
    monkeypatch.setattr(control, "SCHEDULER_TIMEOUT_S", 0.3, raising=False)
    tm = StandInTokenizerManager(dp_size=2, answering=1)
    app = FastAPI()
    attach(app, SpexHttpState(SpexConfig(enabled=True), lambda: SimpleNamespace(tokenizer_manager=tm)))
    control_routes.install(app)
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://spex") as client:
        r = await asyncio.wait_for(client.post("/spex/cancel", json={"search_id": "s1"}), 5.0)
    assert r.status_code == 503 and r.json()["error"]["field"] == "scheduler", r.text  # old: 200 "ok": true
    assert "not acknowledged" in r.json()["error"]["reason"] and len(tm.sent) == 1  # it was sent all the same


async def test_the_engines_capacity_is_bounded_and_a_search_then_gets_a_503(monkeypatch):
    monkeypatch.setattr(control, "SCHEDULER_TIMEOUT_S", 0.3, raising=False)
    tm = StandInTokenizerManager(dp_size=2, answering=1)
    tm.context_len = 2048
    with pytest.raises(EngineLost, match="did not all answer"):
        await asyncio.wait_for(TokenizerManagerPort(tm).capacity(), 5.0)  # old: never returned
