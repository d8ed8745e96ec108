"""Client-side searches and the DSL after a review: a failing batch leaves nothing running, bad arguments are refused
naming them, a path ends at the model's context as server-side, and errors keep the server's reason.

Most tests are pure logic (a fake engine, ``httpx.MockTransport``, a local callback scorer); the ones marked
``server`` need the engine: the context's end of a path client- vs server-side, and the batch cancel leaving no
request or search running on the server.
"""

from __future__ import annotations

import asyncio
import functools
import gc
import json
from typing import Any, Callable, Dict, List

import httpx
import pytest
import requests
from unit.fake_port import FakePort

import sglang_spex.lang as tot
from sglang_spex.tot.callback_server import CallbackRewardServer
from sglang_spex.tot.engine import GenRequest, node_rid
from sglang_spex.tot.http_port import HttpPort
from sglang_spex.tot.limits import SearchLimits
from sglang_spex.tot.search import run_batch, run_search
from sglang_spex.tot.search_spec import SearchSpec, SearchSpecError

from .helpers import QUESTION, engine_load, wait_until

SERVER = "http://server:1"
NO_SERVER = "http://127.0.0.1:9"  # nothing listens: a test that reaches the network fails at once
BIG = {"name": "rebase", "width": 4, "max_depth": 20}
TINY = {"name": "rebase", "width": 1, "max_depth": 1}
ARITH = {"type": "verifier", "name": "arith"}


def _spec(policy: dict, **kw: Any) -> SearchSpec:
    return SearchSpec.from_dict({"policy": policy, "reward": ARITH, **kw})


def _program(policy: dict, max_tokens: int = 6) -> tot.Program:
    return (
        tot.Program()
        .policy(tot.policy(policy["name"], **{k: v for k, v in policy.items() if k != "name"}))
        .step(stop=["\n\n"], max_tokens=max_tokens, seed=3)
        .reward(tot.verifier("arith"))
        .speculation(enabled=False)
    )


class _Leftovers:
    """Tasks a call leaves behind and exceptions the loop reports (e.g. "Task exception was never retrieved")."""

    def __init__(self) -> None:
        self.loop = asyncio.get_running_loop()
        self.before = asyncio.all_tasks()
        self.reported: List[Dict[str, Any]] = []
        self.loop.set_exception_handler(lambda _loop, ctx: self.reported.append(ctx))

    async def check(self) -> None:
        await asyncio.sleep(0.1)  # a task left running would get here
        gc.collect()  # a finished task whose exception nobody retrieved reports it now
        left = asyncio.all_tasks() - self.before - {asyncio.current_task()}
        self.loop.set_exception_handler(None)
        assert not left, left
        assert not self.reported, self.reported


def _mock_port(handler: Callable[[httpx.Request], Any]) -> HttpPort:
    return HttpPort(SERVER, client=httpx.AsyncClient(transport=httpx.MockTransport(handler)))


# ---- 1. a failing search in a batch cancels its siblings before the port closes ------------------------------


async def test_a_failing_callback_cancels_the_other_searches_of_the_batch():
    port = FakePort(delay=0.02)
    leftovers = _Leftovers()

    def on_result(i: int, res: Any) -> None:
        raise RuntimeError(f"consumer of result {i} broke")

    with pytest.raises(RuntimeError, match="consumer of result 1"):
        await run_batch([_spec(BIG), _spec(TINY)], ["a", "b"], port, concurrency=2, on_result=on_result)
    await leftovers.check()  # the big search is not running on
    assert len(port.aborted) == 1 and port.aborted[0].startswith("spex:")  # its cancel aborted its requests


@pytest.mark.parametrize("references", [["1"], "12", ["1", "2", "3"]])
async def test_references_must_have_one_per_question(references):
    port = FakePort()
    with pytest.raises(SearchSpecError) as e:
        await run_batch(_spec(TINY), ["a", "b"], port, references=references)
    assert e.value.field == "references" and not port.requests  # refused before any search ran


async def test_one_spec_per_question_or_one_for_all():
    with pytest.raises(SearchSpecError) as e:
        await run_batch([_spec(TINY)], ["a", "b"], FakePort())
    assert e.value.field == "spec"


@pytest.mark.parametrize("server_side", [True, False])
def test_the_dsl_refuses_a_string_for_questions_and_short_references(server_side):
    ep = tot.Endpoint(NO_SERVER, server_side=server_side)
    with pytest.raises(SearchSpecError) as e:
        _program(TINY).run_batch("abc", ep)  # it ran three searches 'a', 'b', 'c'
    assert e.value.field == "questions" and "list" in e.value.reason
    with pytest.raises(SearchSpecError) as e:
        _program(TINY).run_batch(["a", "b"], ep, references=["1"])  # an IndexError after searches ran
    assert e.value.field == "references"


async def test_a_cancelled_request_is_aborted_before_the_port_closes():
    seen: List[str] = []

    async def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request.url.path)
        if request.url.path == "/generate":
            await asyncio.Event().wait()
        return httpx.Response(404)

    leftovers = _Leftovers()
    port = _mock_port(handler)
    req = GenRequest(prompt="q", rid=node_rid("s1", "r.0"), search_id="s1", node_path="r.0")
    task = asyncio.create_task(port.generate(req))
    await asyncio.sleep(0.05)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await port.close()  # at once: the abort of the cancelled request (sent in the background) must still go out
    assert "/abort_request" in seen
    await leftovers.check()


async def test_an_abort_after_close_is_dropped_not_raised():
    port = _mock_port(lambda r: httpx.Response(200, json={}))
    port.inflight.add(node_rid("s1", "r.0"))
    await port.close()
    await port.abort("spex:s1:")  # was RuntimeError: Cannot send a request, as the client has been closed
    await port.release("s1")


async def test_a_refused_question_cancels_the_other_server_side_searches(monkeypatch):
    """The DSL's server-side batch: the server refuses one question (400) while another search runs; that search's
    request is cancelled (the server cancels a search whose client went away) before the error is raised."""
    cancelled = asyncio.Event()

    async def handler(request: httpx.Request) -> httpx.Response:
        if json.loads(request.content)["question"] == "refused":
            await asyncio.sleep(0.05)
            return httpx.Response(400, json={"error": {"field": "question", "reason": "too long"}})
        try:
            await asyncio.Event().wait()
        finally:
            cancelled.set()

    monkeypatch.setattr(
        httpx, "AsyncClient", functools.partial(httpx.AsyncClient, transport=httpx.MockTransport(handler))
    )
    leftovers = _Leftovers()
    with pytest.raises(SearchSpecError) as e:
        await _program(TINY).arun_batch(["runs", "refused"], tot.Endpoint(SERVER), concurrency=2)
    assert e.value.field == "question" and cancelled.is_set()
    await leftovers.check()


# ---- 2. concurrency -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("concurrency", [0, -1, 1.5, True])
@pytest.mark.parametrize("server_side", [True, False])
async def test_concurrency_must_be_a_positive_integer(concurrency, server_side):
    call = _program(TINY).arun_batch(["a"], tot.Endpoint(NO_SERVER, server_side=server_side), concurrency=concurrency)
    with pytest.raises(SearchSpecError) as e:
        await asyncio.wait_for(call, 5)  # 0 waited forever
    assert e.value.field == "concurrency"


async def test_run_batch_refuses_concurrency_zero():
    with pytest.raises(SearchSpecError) as e:
        await asyncio.wait_for(run_batch(_spec(TINY), ["a"], FakePort(), concurrency=0), 5)
    assert e.value.field == "concurrency"


# ---- 3. the model's context client-side ---------------------------------------------------------------------

CONTEXT, MAX_INPUT = 64, 60


def _context_server(seen: List[dict]) -> Callable[[httpx.Request], httpx.Response]:
    """An engine with a 64-token context, one token per prompt character; it refuses as SGLang does."""

    def handler(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content) if request.content else {}
        if request.url.path == "/tokenize":
            return httpx.Response(200, json={"count": len(body["prompt"]), "max_model_len": CONTEXT})
        if request.url.path == "/server_info":
            return httpx.Response(200, json={"max_req_input_len": MAX_INPUT})
        if request.url.path != "/generate":
            return httpx.Response(404)
        seen.append(body)
        n, new = len(body["text"]), body["sampling_params"]["max_new_tokens"]
        if n > MAX_INPUT or n + new > CONTEXT:
            return httpx.Response(400, json={"error": {"message": f"The input ({n} tokens) is too long."}})
        meta = {"finish_reason": {"type": "length"}, "prompt_tokens": n, "completion_tokens": new}
        return httpx.Response(200, json={"text": "x" * new, "output_ids": [1] * new, "meta_info": meta})

    return handler


async def test_a_path_ends_at_the_servers_context_client_side():
    seen: List[dict] = []
    port = _mock_port(_context_server(seen))
    spec = _spec({"name": "rebase", "width": 1, "max_depth": 10}, step={"max_tokens": 8, "stop": ["\n\n"]})
    try:
        res = await run_search(spec, "q" * 20, port)
    finally:
        await port.close()
    assert res.status == "done" and not res.failures, res.failures  # every deeper node failed with HTTP 400
    deepest = max(res.nodes, key=lambda n: n["depth"])
    assert deepest["terminal"] and deepest["depth"] < 10
    assert all(len(b["text"]) + 8 <= CONTEXT for b in seen)


async def test_a_question_too_long_for_the_model_is_one_clear_error():
    seen: List[dict] = []
    port = _mock_port(_context_server(seen))
    try:
        with pytest.raises(SearchSpecError) as e:
            await run_search(_spec(TINY, step={"max_tokens": 8}), "q" * 60, port)
    finally:
        await port.close()
    assert e.value.field == "question" and "context length 64" in e.value.reason
    assert not seen  # nothing was generated


async def test_given_limits_still_learn_the_models_context():
    port = _mock_port(_context_server([]))
    try:
        with pytest.raises(SearchSpecError) as e:
            await run_search(_spec(TINY, step={"max_tokens": 8}), "q" * 60, port, limits=SearchLimits(max_width=8))
    finally:
        await port.close()
    assert e.value.field == "question"


async def test_capacity_through_a_router_asks_a_worker():
    asked: List[str] = []
    worker = "http://w0:1"

    def handler(request: httpx.Request) -> httpx.Response:
        asked.append(str(request.url))
        if str(request.url) == SERVER + "/workers":
            return httpx.Response(200, json={"workers": [{"url": worker}]})
        if str(request.url) == worker + "/tokenize":
            return httpx.Response(200, json={"count": 0, "max_model_len": 2048})
        if str(request.url) == worker + "/server_info":
            return httpx.Response(200, json={"max_req_input_len": 2042})
        return httpx.Response(404)  # the router answers neither itself

    port = _mock_port(handler)
    assert await port.capacity() == {"context_len": 2048, "max_input_len": 2042}
    n = len(asked)
    await port.capacity()
    assert len(asked) == n  # asked once
    await port.close()


async def test_capacity_of_a_server_that_cannot_say_is_unknown():
    port = _mock_port(lambda r: httpx.Response(404, json={"detail": "Not Found"}))
    assert await port.capacity() == {"context_len": None, "max_input_len": None}
    assert await port.count_tokens("q") is None
    await port.close()


async def test_client_side_limit_errors_do_not_name_a_servers_flags():
    with pytest.raises(SearchSpecError) as e:
        await run_search(_spec({"name": "rebase", "width": 300, "max_depth": 2}), "q", FakePort())
    assert e.value.field == "policy.width"
    assert "client-side" in e.value.reason and "--tot-" not in e.value.reason and "server" not in e.value.reason
    prm = {"type": "prm", "url": "http://prm.example:8000"}
    with pytest.raises(SearchSpecError) as e:
        await run_search(SearchSpec.from_dict({"reward": prm}), "q", FakePort())
    assert e.value.field == "reward.url" and "client-side" in e.value.reason and "--tot-" not in e.value.reason


async def test_a_generate_error_keeps_sglangs_reason():
    reason = "Requested token count exceeds the model's maximum context length of 2048 tokens."
    port = _mock_port(lambda r: httpx.Response(400, json={"error": {"message": reason}}))
    req = GenRequest(prompt="q", rid=node_rid("s1", "r.0"), search_id="s1", node_path="r.0")
    with pytest.raises(httpx.HTTPStatusError) as e:
        await port.generate(req)
    assert reason in str(e.value)
    await port.close()


# ---- 4. DSL arguments ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", [["rebase"], 5, None])
def test_a_policy_name_that_is_not_a_string_is_named(name):
    with pytest.raises(SearchSpecError) as e:
        tot.Program().policy(tot.policy(name)).to_json()  # TypeError: unhashable type: 'list'
    assert e.value.field == "policy.name"


def test_an_unknown_prm_option_is_named():
    with pytest.raises(SearchSpecError) as e:
        tot.prm("http://127.0.0.1:1", foo=1)
    assert e.value.field == "reward.foo"
    assert tot.prm("http://127.0.0.1:1", mode="mean_logprob").mode == "mean_logprob"


def test_a_reward_is_a_reward_config_or_its_name():
    assert tot.Program().reward("logprob").spec().reward.type == "logprob"
    assert tot.Program().reward("verifier:arith").spec().reward.name == "arith"
    with pytest.raises(SearchSpecError) as e:
        tot.Program().reward(5)
    assert e.value.field == "reward"
    with pytest.raises(SearchSpecError) as e:
        tot.Program().reward("nonsense").spec()
    assert e.value.field == "reward.type"


@pytest.mark.parametrize("server_side", [True, False])
def test_an_unknown_keyword_is_refused_the_same_way_on_both_sides(server_side):
    with pytest.raises(TypeError, match="unknown keyword 'foo'") as e:
        _program(TINY).run_batch(["a"], tot.Endpoint(NO_SERVER, server_side=server_side), foo=1)
    assert "arun_batch" in str(e.value)


def test_a_client_side_keyword_is_refused_server_side():
    with pytest.raises(TypeError, match="only client-side"):
        _program(TINY).run_batch(["a"], tot.Endpoint(NO_SERVER), limits=None)


@pytest.mark.parametrize("question", [None, 5, "", "\udc80", "ok \ud800 no"])
@pytest.mark.parametrize("server_side", [True, False])
def test_a_question_must_be_non_empty_valid_text(question, server_side):
    with pytest.raises(SearchSpecError) as e:
        _program(TINY).run(question, tot.Endpoint(NO_SERVER, server_side=server_side))
    assert e.value.field == "question"
    with pytest.raises(SearchSpecError) as e:
        _program(TINY).run_batch(["fine", question], tot.Endpoint(NO_SERVER, server_side=server_side))
    assert e.value.field == "questions[1]"


@pytest.mark.parametrize("question", [None, "", "\udc80"])
async def test_run_search_refuses_a_bad_question(question):
    port = FakePort()
    with pytest.raises(SearchSpecError) as e:
        await run_search(_spec(TINY), question, port)
    assert e.value.field == "question" and not port.requests


# ---- 5. speculation overrides client-side --------------------------------------------------------------------


async def test_client_side_speculation_overrides_are_checked_as_a_servers():
    with pytest.raises(SearchSpecError) as e:
        await run_search(_spec(TINY, speculation={"bogus": 1}), "q", FakePort())
    assert e.value.field == "speculation.bogus"
    with pytest.raises(SearchSpecError) as e:
        await run_batch(_spec(TINY, speculation={"lookahead": -1}), ["q"], FakePort())
    assert e.value.field == "speculation.lookahead"
    res = await run_search(_spec(TINY, speculation={"enabled": False, "lookahead": 2}), "q", FakePort())
    assert res.status == "done"


# ---- 6. a callback scorer's error -------------------------------------------------------------------------------


async def test_a_callback_scorers_error_reaches_the_nodes_failure():
    def score(body: dict) -> float:
        return 1 / 0

    with CallbackRewardServer(score) as cb:
        spec = SearchSpec.from_dict({"policy": TINY, "reward": {"type": "callback", "url": cb.url}})
        res = await run_search(spec, "q", FakePort())
    assert res.failures and all("ZeroDivisionError" in f["error"] for f in res.failures), res.failures


# ---- live: the engine -----------------------------------------------------------------------------------------

LONG = "a" * 2000  # the tiny Llama's context is 2048 tokens, one per 'a': a path reaches it after two steps


def _deep_program() -> tot.Program:
    return _program({"name": "rebase", "width": 2, "max_depth": 6}, max_tokens=16)


@pytest.mark.server
def test_live_a_path_ends_at_the_context_client_side_as_server_side(spex_server):
    server = _deep_program().run(LONG, tot.Endpoint(spex_server.url))
    client = _deep_program().run(LONG, tot.Endpoint(spex_server.url, server_side=False))
    for res in (server, client):
        assert res.status == "done" and not res.failures, res.failures  # client-side: HTTP 400 below depth 2
        assert max(n["depth"] for n in res.nodes) < 6
    assert [(n["path"], n["text"], n["terminal"]) for n in client.nodes] == [
        (n["path"], n["text"], n["terminal"]) for n in server.nodes
    ]
    for side in (True, False):  # a question past the context: one error naming it, on both sides
        with pytest.raises(SearchSpecError) as e:
            _deep_program().run("a" * 2100, tot.Endpoint(spex_server.url, server_side=side))
        assert e.value.field == "question"


def _running_searches(url: str) -> int:
    return requests.get(url + "/tot/searches", timeout=30).json()["running"]


@pytest.mark.server
async def test_live_a_failing_client_side_batch_leaves_nothing_running(spex_server):
    leftovers = _Leftovers()
    big = _program({"name": "rstar", "num_rollouts": 30, "max_depth": 8, "branch": 4}, max_tokens=64).spec()
    tiny = _program(TINY).spec()

    def on_result(i: int, res: Any) -> None:
        if i == 1:
            raise RuntimeError("consumer broke")

    port = HttpPort(spex_server.url)
    try:
        with pytest.raises(RuntimeError, match="consumer broke"):
            await run_batch([big, tiny], [QUESTION, QUESTION], port, concurrency=2, on_result=on_result)
        await leftovers.check()  # the big search was cancelled, not left running on the open port
        assert await asyncio.to_thread(wait_until, lambda: engine_load(spex_server.url) == 0, 10)  # its requests too
    finally:
        await port.close()


@pytest.mark.server
async def test_live_a_failing_server_side_batch_leaves_no_search_running(spex_server):
    leftovers = _Leftovers()
    big = _program({"name": "rstar", "num_rollouts": 30, "max_depth": 8, "branch": 4}, max_tokens=64)
    with pytest.raises(SearchSpecError) as e:  # the server refuses the second question (too long) at once
        await big.arun_batch([QUESTION, "a" * 2100], tot.Endpoint(spex_server.url), concurrency=2)
    assert e.value.field == "question"
    await leftovers.check()
    url = spex_server.url
    assert await asyncio.to_thread(wait_until, lambda: _running_searches(url) == 0 and engine_load(url) == 0, 10)
