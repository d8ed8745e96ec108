"""Server-side searches under hostile requests (review 33, findings 3 and 5), without a server.

Finding 3: a search cancelled while it waits for a slot must leave the server-wide T2 budget (``SpexWiring.budget``)
as a search that ran does; it stayed registered forever. The real ``SearchService``, ``SpexWiring`` and
``SpexContext`` over a stand-in tokenizer manager whose requests never end, one search slot.
Finding 5: a body nested too deeply for the spec parser, or holding a lone UTF-16 surrogate (``"\\ud800"``) in a
string or key, must be a 400 naming the body through the real ``/tot/search`` route, never a 500 (nor a search
whose every node fails, nor a result that cannot be answered).
"""

from __future__ import annotations

import asyncio
import functools
import json
from types import SimpleNamespace
from typing import Dict

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from sglang_spex.config import SpexConfig
from sglang_spex.srt import search_service
from sglang_spex.srt.engine_port import TokenizerManagerPort
from sglang_spex.srt.http_api import MAX_JSON_DEPTH, STATE_ATTR, BodyError, SearchBody, decode_json, error_response
from sglang_spex.srt.search_service import LIMIT_FIELDS, SearchService
from sglang_spex.tot.context import SearchContext
from sglang_spex.tot.limits import derive
from sglang_spex.tot.search_spec import SearchSpec, SearchSpecError

SPEC = {"policy": {"name": "rebase", "width": 2, "max_depth": 2}, "step": {"max_tokens": 8}}
STEP = "1 + 2 = 3. The answer is 3."


class StandInTM:
    """A stand-in TokenizerManager: each request answers at once (``hang``: never ends)."""

    def __init__(self, hang: bool = False) -> None:
        self.hang = hang
        self.server_args = SimpleNamespace(dp_size=1)
        self.tokenizer = SimpleNamespace(encode=lambda text: list(range(len(text.split()))))
        self.rid_to_state: Dict[str, object] = {}

    async def generate_request(self, obj, request):
        self.rid_to_state[obj.rid] = obj
        try:
            if self.hang:
                await asyncio.Event().wait()
        finally:
            self.rid_to_state.pop(obj.rid, None)
        yield {"text": STEP, "output_ids": [1, 2, 3], "meta_info": {"finish_reason": {"type": "stop"}}}

    def abort_request(self, rid: str) -> None:
        pass  # reaches no scheduler

    def auto_create_handle_loop(self) -> None:
        pass

    def _dispatch_to_scheduler(self, req) -> None:
        pass

    async def get_internal_state(self) -> list:
        return [{}]


def _service(tm: StandInTM, **cfg) -> SearchService:
    port = TokenizerManagerPort(tm, spex_control=False)
    svc = SearchService(lambda: port, SpexConfig(**cfg), lambda: None)
    svc._limits = derive(  # SearchService asks the engine for these once; the stand-in has no capacity to report
        {name: None for name in LIMIT_FIELDS}, context_len=4096, max_running_requests=8, kv_tokens=100_000
    )
    return svc


# ---------------------------------------------------------------- finding 3


async def _counted(finished: list, on_finish, ctx) -> None:
    finished.append(ctx.search_id)
    await on_finish(ctx)


async def test_searches_cancelled_while_queued_leave_the_t2_budget(monkeypatch):
    monkeypatch.setattr(search_service, "CANCEL_GRACE_S", 0.2)
    cancel = SearchContext.cancel

    async def quick_cancel(self, reason="cancelled", timeout=10.0):  # its requests never end: don't wait 10 s
        await cancel(self, reason, timeout=0.2)

    monkeypatch.setattr(SearchContext, "cancel", quick_cancel)
    svc = _service(StandInTM(hang=True), enabled=True, k_total=8, max_concurrent_searches=1, max_queued_searches=8)
    hs = [await svc.submit(SearchBody(spec={**SPEC, "seed": i}, question="q")) for i in range(5)]
    finished = []
    for h in hs:
        h.ctx.on_finish = functools.partial(_counted, finished, h.ctx.on_finish)
    await asyncio.sleep(0.2)
    assert [h.status for h in hs] == ["running"] + ["queued"] * 4
    assert len(svc.spex.budget.contexts) == 5
    for h in hs[1:]:
        await asyncio.wait_for(svc.cancel(h.id), 10.0)
    assert [h.status for h in hs[1:]] == ["cancelled"] * 4
    assert [c.search_id for c in svc.spex.budget.contexts] == [hs[0].id]  # old: all 5 still registered
    assert sorted(finished) == sorted(h.id for h in hs[1:])  # each reported its end (metrics, auto k_total)
    assert all(h.result.status == "cancelled" and h.result.speculation is not None for h in hs[1:])
    await asyncio.wait_for(svc.cancel(hs[0].id), 10.0)
    assert hs[0].status == "cancelled" and not svc.spex.budget.contexts  # old: 4 left for good
    assert svc.counts() == {"running": 0, "queued": 0}


async def test_a_queued_search_cancelled_twice_still_leaves_the_budget():
    """A second cancel of the search's task while its close runs (a server shutting down) does not cut the close
    short: it goes on in its own task and still takes the context out of the budget."""
    svc = _service(StandInTM(hang=True), enabled=True, k_total=8, max_concurrent_searches=1, max_queued_searches=8)
    running = await svc.submit(SearchBody(spec=SPEC, question="q"))
    queued = await svc.submit(SearchBody(spec=SPEC, question="q"))
    await asyncio.sleep(0.1)
    assert queued.status == "queued"
    queued.ctx.cancelled = True
    queued.task.cancel()
    await asyncio.sleep(0)
    queued.task.cancel()
    await asyncio.wait({queued.task}, timeout=10.0)
    assert queued.status == "cancelled"
    for _ in range(100):
        if [c.search_id for c in svc.spex.budget.contexts] == [running.id]:
            break
        await asyncio.sleep(0.02)
    assert [c.search_id for c in svc.spex.budget.contexts] == [running.id]
    running.task.cancel()
    await asyncio.wait({running.task}, timeout=20.0)


# ---------------------------------------------------------------- finding 5


@pytest.fixture
def http():
    svc = _service(StandInTM(), enabled=True, k_total=8)
    app = FastAPI()
    search_service.install(app)
    setattr(app.state, STATE_ATTR, SimpleNamespace(searches=svc, cfg=svc.cfg))
    with TestClient(app) as client:
        yield client


def _raw(text: str) -> bytes:
    """A JSON body written by hand (``\\ud800`` stays the six-character escape)."""
    return text.encode("utf-8")


def _post(http: TestClient, body: bytes):
    return http.post("/tot/search", content=body, headers={"content-type": "application/json"})


def _deep(depth: int) -> str:
    return "[" * depth + "]" * depth


SURROGATE_BODIES = {
    "prompt_template": r'{"question": "q", "spec": {"step": {"prompt_template": "\ud800{question}"}}}',
    "reference": r'{"question": "What is 1 + 2?", "reference": "\ud800", "spec": {"policy": "rebase"}}',
    "spec key": r'{"question": "q", "spec": {"\ud800": 1}}',
    "policy knob": r'{"question": "q", "spec": {"policy": {"name": "rebase", "\ud800": 1}}}',
    "stop": r'{"question": "q", "spec": {"step": {"stop": ["\udc00"]}}}',
    "question": r'{"question": "q\udfff"}',
    "a high then a high": r'{"question": "q\ud800\ud800"}',
    "a low then a high": r'{"question": "q\udc00\ud800"}',
    "top-level key": r'{"question": "q", "\ud800": 1}',
}


@pytest.mark.parametrize("case", sorted(SURROGATE_BODIES))
def test_a_lone_surrogate_is_a_400_naming_the_body(http, case):
    r = _post(http, _raw(SURROGATE_BODIES[case]))
    assert r.status_code == 400, r.text
    assert r.json()["error"]["field"] == "body" and "surrogate" in r.json()["error"]["reason"]
    assert http.get("/tot/searches").json()["searches"] == []  # nothing started


def test_a_raw_surrogate_in_the_utf8_is_a_400(http):
    """``json.loads`` of bytes takes UTF-8-encoded surrogates (``surrogatepass``) as well as escapes."""
    r = _post(http, b'{"question": "q", "reference": "\xed\xa0\x80"}')
    assert r.status_code == 400 and "surrogate" in r.json()["error"]["reason"], r.text


@pytest.mark.parametrize(
    "field, head, tail",  # the body around the deep value: the body's object, spec and so on hold it
    [
        ("speculation", '{"question": "q", "spec": {"speculation": ', "}}"),
        ("policy.x", '{"question": "q", "spec": {"policy": {"name": "rebase", "x": ', "}}}"),
        ("reward.url", '{"question": "q", "spec": {"reward": {"url": ', "}}}"),
    ],
)
@pytest.mark.parametrize("depth", [MAX_JSON_DEPTH, MAX_JSON_DEPTH + 1, 600, 950])
def test_deep_nesting_in_the_spec_is_a_400_naming_the_body(http, field, head, tail, depth):
    r = _post(http, _raw(head + _deep(depth - len(tail)) + tail))
    assert r.status_code == 400, r.text  # old: RecursionError → 500 (600, 950)
    err = r.json()["error"]
    if depth > MAX_JSON_DEPTH:
        assert err == {"field": "body", "reason": f"JSON nested more than {MAX_JSON_DEPTH} levels deep"}
    else:  # at the limit: the spec's own check answers
        assert err["field"] == field and err["reason"], err


def test_valid_unicode_still_runs(http):
    """A surrogate pair escape is one character past the BMP, not a lone surrogate; the search runs to its end."""
    head = r'{"question": "What is 1 + 2? \ud83d\ude00 é", "reference": "3 \ud83d\ude00", "spec": '
    r = _post(http, _raw(head + json.dumps(SPEC) + "}"))
    assert r.status_code == 200, r.text
    assert r.json()["question"] == "What is 1 + 2? \U0001f600 é" and r.json()["status"] == "done"
    sid = r.json()["search_id"]
    assert http.get(f"/tot/search/{sid}").status_code == 200


@pytest.mark.parametrize(
    "raw",
    [
        b'{"a": "\\\\ud800"}',  # an escaped backslash and "ud800": six plain characters
        '{"a": "\U0001f600", "b": ["é", {"ü": "\\ud83d\\ude00"}]}'.encode(),
        json.dumps({"rollouts": [{"prompt_ids": [1, 2], "response_ids": [3], "reward": 1.0}] * 200}).encode(),
        json.dumps({"x": "[" * 1000}).encode(),  # brackets inside a string are no nesting
        _raw(_deep(MAX_JSON_DEPTH)),
        '{"a": "\\ud800\\udc00"}'.encode("utf-16"),  # a pair, in a UTF-16 body
    ],
    ids=["escaped backslash", "pairs and accents", "many rollouts", "brackets in a string", "at the limit", "utf-16"],
)
def test_decode_json_takes_what_is_valid(raw):
    assert decode_json(raw) == json.loads(raw)


@pytest.mark.parametrize(
    "raw, reason",
    [
        (_raw(_deep(MAX_JSON_DEPTH + 1)), "levels deep"),
        (json.dumps({"a": [[1]] * 40, "c": json.loads(_deep(MAX_JSON_DEPTH))}).encode(), "levels deep"),
        ('{"a": "\\ud800"}'.encode("utf-16"), "surrogate"),
        ('{"a": "\\ud800"}'.encode("utf-8-sig"), "surrogate"),
        (b'{"a": 1, "\\udc00": 2}', "surrogate"),
    ],
    ids=["one too deep", "deep beside shallow", "utf-16", "utf-8 with a BOM", "a key"],
)
def test_decode_json_refuses_nesting_and_lone_surrogates(raw, reason):
    with pytest.raises(BodyError) as e:
        decode_json(raw)
    assert e.value.field == "body" and reason in e.value.reason and e.value.status_code == 400


def test_a_duplicate_key_with_a_surrogate_is_answered():
    with pytest.raises(BodyError) as e:
        decode_json(b'{"\\ud800": 1, "\\ud800": 2}')
    r = error_response(e.value.field, e.value.reason)
    assert r.status_code == 400 and json.loads(r.body)["error"]["field"] == "\\ud800"


def test_error_response_escapes_what_utf8_cannot_encode():
    r = error_response("spec.\ud800", "unknown field \udc00; é")
    assert json.loads(r.body) == {"error": {"field": "spec.\\ud800", "reason": "unknown field \\udc00; é"}}


def test_the_spec_parser_refuses_nesting_too_deep_for_it():
    """In process (no body limit): a spec nested past what ``copy.deepcopy`` survives is a SearchSpecError."""
    deep: list = []
    for _ in range(5000):
        deep = [deep]
    with pytest.raises(SearchSpecError) as e:
        SearchSpec.from_dict({"speculation": deep})
    assert e.value.field == "spec"
