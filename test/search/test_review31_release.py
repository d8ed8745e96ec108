"""A search's end must not wait on a hung worker or a dead DP rank (review 31, findings 1 and 3), without a server.

Finding 1: a client-side search through a router stand-in, one listed worker hung (a socket that accepts and never
answers, as a SIGSTOPped server does) that does not hold the search; and any port whose release never answers.
Finding 3: a server-side search (``SearchService`` over ``TokenizerManagerPort``) on a stand-in tokenizer manager
whose DP rank 1 is dead: its requests never end and the control channel's state round trip never completes; a
cancel (a client that went away) must still finish the search and free its slot.
"""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace
from typing import Dict

import httpx

from sglang_spex.config import SpexConfig
from sglang_spex.srt import control, search_service
from sglang_spex.srt.engine_port import TokenizerManagerPort
from sglang_spex.srt.http_api import SearchBody
from sglang_spex.srt.search_service import LIMIT_FIELDS, SearchService
from sglang_spex.tot import context, http_port
from sglang_spex.tot.context import SearchContext
from sglang_spex.tot.engine import EnginePort, GenRequest, GenResult
from sglang_spex.tot.http_port import HttpPort
from sglang_spex.tot.limits import derive
from sglang_spex.tot.search import run_search
from sglang_spex.tot.search_spec import SearchSpec

SPEC = {"policy": {"name": "rebase", "width": 2, "max_depth": 2}, "reward": {"type": "verifier", "name": "arith"}}
STEP = "1 + 2 = 3. The answer is 3."
ROUTER, W0 = "http://router:1", "http://w0:1"


class NeverReleased(EnginePort):
    """Answers every request at once; its release never returns (a control call nobody answers)."""

    async def generate(self, req: GenRequest) -> GenResult:
        return GenResult(rid=req.rid, text=STEP, output_ids=[1, 2, 3], finish_reason="stop", completion_tokens=3)

    async def abort(self, rid_or_prefix: str) -> None:
        pass

    async def release(self, search_id: str) -> None:
        await asyncio.Event().wait()


async def test_a_release_that_never_answers_does_not_hold_the_result(monkeypatch, caplog):
    monkeypatch.setattr(context, "RELEASE_TIMEOUT_S", 0.3, raising=False)
    spec = SearchSpec.from_dict({**SPEC, "seed": 1})
    res = await asyncio.wait_for(run_search(spec, "q", NeverReleased(), search_id="s1"), 10.0)  # old: never
    assert res.status == "done"
    assert "releasing search s1" in caplog.text


async def test_a_client_side_search_is_not_held_by_a_hung_worker_it_does_not_use(hung_worker, monkeypatch):
    monkeypatch.setattr(http_port, "CONTROL_TIMEOUT_S", 0.5, raising=False)
    workers = [{"url": W0, "is_healthy": True}, {"url": hung_worker, "is_healthy": True}]
    answers: Dict[str, dict] = {
        "/workers": {"workers": workers},
        "/tokenize": {"count": 3, "max_model_len": 4096},
        "/server_info": {"max_req_input_len": 4000},
        "/generate": {"text": STEP, "output_ids": [1, 2, 3], "meta_info": {"finish_reason": {"type": "stop"}}},
    }
    mock = httpx.MockTransport(lambda r: httpx.Response(200, json=answers.get(r.url.path, {})))
    client = httpx.AsyncClient(timeout=60.0, mounts={"all://router:1": mock, "all://w0:1": mock})
    port = HttpPort(ROUTER, client=client)
    spec = SearchSpec.from_dict({**SPEC, "seed": 2})
    t0 = time.monotonic()
    res = await asyncio.wait_for(run_search(spec, "q", port), 20.0)  # old: the release waited 60 s on it
    assert res.status == "done" and time.monotonic() - t0 < 10.0
    await port.close()


# ---------------------------------------------------------------- finding 3


class DeadRankTokenizerManager:
    """A stand-in TokenizerManager under ``--dp-size 2`` with rank 1 dead: generate requests never end (SGLang's
    DP controller wedges) and a state round trip never completes (rank 1 never answers)."""

    def __init__(self) -> None:
        self.server_args = SimpleNamespace(dp_size=2)
        self.tokenizer = SimpleNamespace(encode=lambda text: list(range(len(text.split()))))
        self.rid_to_state: Dict[str, object] = {}
        self.sent: list = []

    async def generate_request(self, obj, request):
        self.rid_to_state[obj.rid] = obj
        await asyncio.Event().wait()
        yield {}

    def abort_request(self, rid: str) -> None:
        pass  # reaches no scheduler

    def auto_create_handle_loop(self) -> None:
        pass

    def _dispatch_to_scheduler(self, req) -> None:
        self.sent.append(req)

    async def get_internal_state(self) -> list:
        await asyncio.Event().wait()
        return []


async def test_a_cancelled_search_frees_its_slot_when_a_rank_never_answers(monkeypatch):
    monkeypatch.setattr(control, "SCHEDULER_TIMEOUT_S", 0.5, raising=False)
    monkeypatch.setattr(search_service, "CANCEL_GRACE_S", 0.2)
    cancel = SearchContext.cancel

    async def quick_cancel(self, reason="cancelled", timeout=10.0):  # its requests never end: don't wait 10 s
        await cancel(self, reason, timeout=0.2)

    monkeypatch.setattr(SearchContext, "cancel", quick_cancel)
    tm = DeadRankTokenizerManager()
    port = TokenizerManagerPort(tm, spex_control=True)
    svc = SearchService(lambda: port, SpexConfig(), lambda: None)
    svc._limits = derive(  # SearchService asks the engine for these once; the stand-in has no capacity to report
        {name: None for name in LIMIT_FIELDS}, context_len=4096, max_running_requests=8, kv_tokens=100_000
    )
    h = await svc.submit(SearchBody(spec={**SPEC, "seed": 3}, question="q"))
    for _ in range(100):
        if h.status == search_service.RUNNING and tm.rid_to_state:
            break
        await asyncio.sleep(0.02)
    assert h.status == search_service.RUNNING
    await asyncio.wait_for(svc.cancel(h.id, "client disconnected"), 20.0)  # old: never returned
    assert h.status == "cancelled" and svc.counts() == {"running": 0, "queued": 0}
    assert [r.op for r in tm.sent] == ["release"]  # the release was sent; only its acknowledgement is missing
