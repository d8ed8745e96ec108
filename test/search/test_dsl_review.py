"""The DSL without a server: policy knobs next to a PolicyConfig, the API key on both paths, numpy scalars, specs
that share nothing with the caller, and the examples' command line (``httpx.MockTransport`` stands in for the
server)."""

from __future__ import annotations

import functools
import importlib.util
import json
from pathlib import Path
from typing import Any, List, Optional, Tuple

import httpx
import numpy as np
import pytest

import sglang_spex.lang as tot
from sglang_spex.tot.result import SearchResult

SERVER = "http://server:1"
KEY = "user-key-7f3a"
EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def _program() -> tot.Program:
    return (
        tot.Program()
        .policy(tot.rebase(width=1, max_depth=1))
        .step(stop=["\n\n"], max_tokens=4, seed=3)
        .reward(tot.verifier("arith"))
        .speculation(enabled=False)
    )


# ---- policy knobs next to a PolicyConfig -------------------------------------------------------------------


def test_knobs_given_with_a_policy_config_override_its_own():
    given = tot.rebase(width=4, softmax_temperature=0.5)
    p = tot.Program().policy(given, width=8)
    assert p.to_dict()["policy"] == {"name": "rebase", "width": 8, "softmax_temperature": 0.5}
    assert p.spec().policy.params == {"width": 8, "softmax_temperature": 0.5}
    assert given.params == {"width": 4, "softmax_temperature": 0.5}  # the caller's config is untouched
    given.params["width"] = 2
    assert p.spec().policy.params["width"] == 8  # nor shared with the program


def test_knobs_given_with_a_policy_name_apply_and_a_bad_one_is_named():
    assert tot.Program().policy("rebase", width=8).to_dict()["policy"] == {"name": "rebase", "width": 8}
    assert tot.Program().policy(tot.rebase(), width=8).to_dict()["policy"] == {"name": "rebase", "width": 8}
    with pytest.raises(tot.SearchSpecError) as e:
        tot.Program().policy(tot.rebase(width=4), width=0).spec()
    assert e.value.field == "policy.width"


# ---- the API key -------------------------------------------------------------------------------------------


def _server(seen: List[Tuple[str, Optional[str]]], result: dict):
    """A server started with ``--api-key KEY``: 401 without it; ``/tot/search`` answers ``result``, ``/generate``
    one terminal step."""

    def handler(request: httpx.Request) -> httpx.Response:
        auth = request.headers.get("authorization")
        seen.append((request.url.path, auth))
        if auth != f"Bearer {KEY}":
            return httpx.Response(401, json={"error": "Unauthorized"})
        if request.url.path == "/tot/search":
            return httpx.Response(200, json=result)
        if request.url.path != "/generate":
            return httpx.Response(404)
        meta = {"finish_reason": {"type": "stop"}, "prompt_tokens": 8, "completion_tokens": 4}
        return httpx.Response(200, json={"text": "The answer is 5", "output_ids": [1] * 4, "meta_info": meta})

    return handler


@pytest.mark.parametrize("server_side", [True, False])
async def test_the_api_key_is_sent_on_both_paths(monkeypatch, server_side):
    result = SearchResult("s", "q", "rebase", "done", "5", None, None, [], [], 4, 1, 0.1).to_dict()
    seen: List[Tuple[str, Optional[str]]] = []
    transport = httpx.MockTransport(_server(seen, result))
    monkeypatch.setattr(httpx, "AsyncClient", functools.partial(httpx.AsyncClient, transport=transport))
    ep = tot.Endpoint(SERVER, server_side=server_side, api_key=KEY)
    assert KEY not in repr(ep)
    res = await _program().arun("What is 2 + 3?", ep)
    assert res.status == "done" and res.answer == "5", res
    assert ("/tot/search" if server_side else "/generate") in {path for path, _ in seen}
    assert {auth for _, auth in seen} == {f"Bearer {KEY}"}


@pytest.mark.parametrize("server_side", [True, False])
async def test_no_api_key_sends_no_authorization(monkeypatch, server_side):
    seen: List[Tuple[str, Optional[str]]] = []
    transport = httpx.MockTransport(_server(seen, {}))
    monkeypatch.setattr(httpx, "AsyncClient", functools.partial(httpx.AsyncClient, transport=transport))
    try:
        await _program().arun("What is 2 + 3?", tot.Endpoint(SERVER, server_side=server_side))
    except httpx.HTTPStatusError:
        pass  # server-side: the 401; client-side the search fails its nodes instead
    assert seen and {auth for _, auth in seen} == {None}


# ---- numpy scalars -----------------------------------------------------------------------------------------


def test_numpy_scalars_become_python_numbers():
    p = (
        tot.Program()
        .policy(tot.rebase(width=np.int64(8), softmax_temperature=np.float32(0.5)), max_depth=np.int32(4))
        .step(max_tokens=np.int64(16), temperature=np.float32(0.75), seed=np.uint8(5), top_p=np.float16(0.5))
        .reward("logprob", timeout=np.float64(3.0))
        .priority(np.int64(2))
        .speculation(lookahead=np.int16(3))
    )
    spec = p.spec()  # was TypeError: Object of type int64 is not JSON serializable
    assert spec.policy.params == {"width": 8, "softmax_temperature": 0.5, "max_depth": 4}
    assert (spec.step.max_tokens, spec.step.temperature, spec.step.top_p) == (16, 0.75, 0.5)
    assert (spec.seed, spec.reward_timeout, spec.priority, spec.speculation) == (5, 3.0, 2, {"lookahead": 3})
    for value in (*spec.policy.params.values(), spec.step.max_tokens, spec.step.temperature, spec.seed):
        assert type(value) in (int, float)
    assert json.loads(p.to_json())["policy"]["width"] == 8
    data = {"policy": {"name": "rebase", "width": np.int64(2)}, "step": {"max_tokens": np.int64(3)}}
    assert tot.Program.from_json(data).spec().policy.params == {"width": 2}


def test_a_value_json_cannot_hold_is_named_not_a_type_error():
    with pytest.raises(tot.SearchSpecError) as e:
        tot.Program().policy(tot.rebase(width=object())).spec()
    assert e.value.field == "policy.width"
    with pytest.raises(tot.SearchSpecError) as e:
        tot.Program().step(temperature=np.array([0.5, 0.7])).spec()
    assert e.value.field == "step.temperature"


# ---- specs share nothing with the caller -------------------------------------------------------------------


def test_to_dict_and_from_json_copy_the_caller_s_dicts():
    p = tot.Program().policy(tot.rebase(width=4)).speculation(enabled=False)
    d = p.to_dict()
    d["speculation"]["enabled"] = True
    d["policy"]["width"] = 2
    assert p.to_dict()["speculation"] == {"enabled": False} and p.to_dict()["policy"]["width"] == 4
    spec = p.spec()
    spec.to_dict()["speculation"]["lookahead"] = 3
    assert spec.speculation == {"enabled": False}
    cfg = {"enabled": False}
    data = {"speculation": cfg, "step": {"stop": ["\n"]}}
    q = tot.Program.from_json(data)
    cfg["lookahead"] = 3
    data["step"]["stop"].append("x")
    assert q.to_dict()["speculation"] == {"enabled": False} and q.to_dict()["step"]["stop"] == ["\n"]
    direct = tot.SearchSpec.from_dict(data)
    cfg["more"] = 1
    data["step"]["stop"].append("y")
    assert direct.speculation == {"enabled": False, "lookahead": 3} and direct.step.stop == ["\n", "x"]


# ---- the examples' command line ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def common() -> Any:
    spec = importlib.util.spec_from_file_location("examples_common", EXAMPLES / "_common.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _run_example(common: Any, monkeypatch: Any, *argv: str) -> List[Tuple[List[str], Any]]:
    """Run the examples' ``main`` with ``argv``; the program's ``run_batch`` only records its calls."""
    calls: List[Tuple[List[str], Any]] = []
    program = _program()
    program.run_batch = lambda questions, backend, **kw: calls.append((questions, backend)) or []
    monkeypatch.setattr("sys.argv", ["example", *argv])
    common.main(program, "doc")
    return calls


@pytest.mark.parametrize("n", ["0", "-1", "x"])
def test_examples_refuse_fewer_than_one_question(common, monkeypatch, capsys, n):
    with pytest.raises(SystemExit) as e:
        _run_example(common, monkeypatch, "-n", n)  # -n 0 and -1 searched nothing and exited 0
    assert e.value.code == 2 and "-n" in capsys.readouterr().err


def test_examples_take_a_question_count_and_an_api_key(common, monkeypatch):
    [(questions, backend)] = _run_example(common, monkeypatch, "-n", "2", "--api-key", KEY, "--client-side")
    assert len(questions) == 2 and backend.api_key == KEY and not backend.server_side
    [(_, backend)] = _run_example(common, monkeypatch)
    assert backend.api_key is None and backend.server_side
