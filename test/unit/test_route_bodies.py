"""Request bodies of the plugin's routes (pydantic, ``srt/http_api.py``): bad or unknown fields give the one
error shape, without a server."""

from __future__ import annotations

import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from fastapi.testclient import TestClient

from sglang_spex.srt.http_api import (
    BodyError,
    BudgetBody,
    CancelBody,
    KnobsBody,
    PolicyBody,
    ProfileBody,
    PromoteBody,
    ProtectBody,
    ReleaseBody,
    RolloutsBody,
    SearchBody,
    json_body,
    parse_body,
    query_number,
)

SEARCH = {"spec": {"policy": {"name": "rebase"}}, "question": "What is 2 + 2?"}


@pytest.mark.parametrize(
    "model, raw, field",
    [
        (BudgetBody, {"k_total": "lots"}, "k_total"),  # an unknown field is named before the missing "k"
        (BudgetBody, {"k": "lots"}, "k"),
        (BudgetBody, {"k": -1}, "k"),
        (BudgetBody, {"k": True}, "k"),
        (BudgetBody, {"k": 2.5}, "k"),
        (BudgetBody, {"k": 10**400}, "k"),  # past any count (float() of it overflowed: a 500, not a 400)
        (KnobsBody, {"knee": 10**400}, "knee"),
        (BudgetBody, {}, "k"),
        (BudgetBody, [1, 2], "body"),
        (CancelBody, {}, "body"),
        (CancelBody, {"search_id": 3}, "search_id"),
        (CancelBody, {"search_id": "s", "rid": "x"}, "rid"),
        (PromoteBody, {}, "rid"),
        (PromoteBody, {"rid": ""}, "rid"),
        (ProtectBody, {"search_id": ""}, "search_id"),
        (ReleaseBody, {"node_prefix": "r.0"}, "body"),
        (ReleaseBody, {"search_id": None}, "search_id"),
        (KnobsBody, {}, "body"),
        (KnobsBody, {"immediate_cancel": 1}, "immediate_cancel"),
        (KnobsBody, {"protect_max_fraction": 1.5}, "protect_max_fraction"),
        (KnobsBody, {"protect_ttl_s": "10"}, "protect_ttl_s"),
        (KnobsBody, {"protect_ttl_s": float("nan")}, "protect_ttl_s"),
        (KnobsBody, {"ttl": 1.0}, "ttl"),
        (ProfileBody, {"batch_sizes": [1, 0, 4]}, "batch_sizes[1]"),
        (ProfileBody, {"batch_sizes": []}, "batch_sizes"),
        (ProfileBody, {"batch_sizes": [3]}, "batch_sizes"),  # one point is no curve (was a 500)
        (ProfileBody, {"batch_sizes": [2, 2]}, "batch_sizes"),  # nor two of one size (was a one-point profile)
        (CancelBody, {"search_id": "x" * 257}, "search_id"),  # the scheduler keeps cancelled ids for a minute
        (CancelBody, {"rid_prefix": "x" * 257}, "rid_prefix"),
        (PromoteBody, {"rid": "x" * 257}, "rid"),
        (ProtectBody, {"search_id": "x" * 257}, "search_id"),
        (ReleaseBody, {"search_id": "s", "node_prefix": "x" * 257}, "node_prefix"),
        (KnobsBody, {"protect_max_fraction": 1.0}, "protect_max_fraction"),  # protection may not take the pool
        (KnobsBody, {"protect_ttl_s": 1e308}, "protect_ttl_s"),
        (KnobsBody, {"knee": 0}, "knee"),  # -1 (none) or a batch size
        (ProfileBody, {"batch_sizes": "1,2"}, "batch_sizes"),
        (ProfileBody, {"repeats": 0}, "repeats"),
        (ProfileBody, {"force": "yes"}, "force"),
        (ProfileBody, {"batch": [1]}, "batch"),
        (SearchBody, {"spec": {}}, "question"),
        (SearchBody, {**SEARCH, "question": "   "}, "question"),
        (SearchBody, {**SEARCH, "reference": [1]}, "reference"),
        (SearchBody, {**SEARCH, "reference": True}, "reference"),
        (SearchBody, {**SEARCH, "stream": "yes"}, "stream"),
        (SearchBody, {**SEARCH, "search_id": "a b"}, "search_id"),
        (SearchBody, {**SEARCH, "search_id": "x" * 65}, "search_id"),
        (SearchBody, {**SEARCH, "spec": 3}, "spec"),
        (SearchBody, {**SEARCH, "colour": 1}, "colour"),
        (RolloutsBody, {}, "rollouts"),
        (RolloutsBody, {"rollouts": {"a": 1}}, "rollouts"),
        (RolloutsBody, {"rollouts": [], "x": 1}, "x"),
        (PolicyBody, {"version": "1", "serialized_named_tensors": ["a"]}, "version"),
        (PolicyBody, {"version": 1, "serialized_named_tensors": ["a", "b"]}, "serialized_named_tensors"),
        (PolicyBody, {"version": 1, "serialized_named_tensors": [3]}, "serialized_named_tensors[0]"),
    ],
)
def test_bad_body_names_the_field(model, raw, field):
    with pytest.raises(BodyError) as e:
        parse_body(model, raw)
    assert e.value.field == field and e.value.reason
    assert e.value.to_dict() == {"field": field, "reason": e.value.reason}


def test_unknown_field_reason_lists_the_fields():
    with pytest.raises(BodyError) as e:
        parse_body(BudgetBody, {"k_total": "lots"})
    assert "unknown field" in e.value.reason and "'k'" in e.value.reason


def test_good_bodies():
    assert parse_body(BudgetBody, {"k": 3}).k == 3 and parse_body(BudgetBody, {"k": None}).k is None
    assert parse_body(CancelBody, {"rid_prefix": "spex:s:"}).search_id == ""
    assert parse_body(KnobsBody, {"immediate_cancel": True, "protect_ttl_s": 5}).values() == {
        "immediate_cancel": 1.0,
        "protect_ttl_s": 5.0,
    }
    assert parse_body(ProfileBody, {}).spec_fields() == {} and parse_body(ProfileBody, {}).force is True
    prof = parse_body(ProfileBody, {"batch_sizes": [1, 2], "short_tokens": 2, "force": False})
    assert prof.spec_fields() == {"batch_sizes": (1, 2), "short_tokens": 2} and prof.force is False
    s = parse_body(SearchBody, {**SEARCH, "reference": 4, "stream": True, "search_id": "a-1_B"})
    assert (s.reference, s.stream, s.search_id, s.spec) == ("4", True, "a-1_B", SEARCH["spec"])
    assert parse_body(SearchBody, {"question": "q"}).spec == {}
    assert parse_body(PolicyBody, {"version": 2, "serialized_named_tensors": ["eA=="]}).version == 2


@pytest.fixture
def app_client():
    app = FastAPI()

    @json_body(BudgetBody)
    async def handler(request: Request, body: BudgetBody):
        return JSONResponse({"ok": True, "k": body.k})

    @json_body(ProfileBody, optional=True)
    async def optional(request: Request, body: ProfileBody):
        return JSONResponse({"force": body.force})

    app.add_api_route("/budget", handler, methods=["POST"])
    app.add_api_route("/profile", optional, methods=["POST"])
    return TestClient(app)


def test_json_body_answers_the_error_shape(app_client):
    r = app_client.post("/budget", json={"k_total": "lots"})
    assert r.status_code == 400
    assert r.json()["error"]["field"] == "k_total" and r.json()["error"]["reason"]
    r = app_client.post("/budget", content=b"{not json", headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["field"] == "body"
    assert r.json()["error"]["reason"].startswith("invalid JSON: Expecting property name")  # the reason that applies
    r = app_client.post(
        "/budget", content=b'{"k": 1' + b"0" * 5000 + b"}", headers={"content-type": "application/json"}
    )
    reason = r.json()["error"]["reason"]
    assert r.status_code == 400 and reason.startswith("a number out of range:") and "digits" in reason  # says why
    r = app_client.post("/budget", content=b"[" * 100000 + b"]" * 100000, headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["reason"] == "JSON nested too deeply (at most 64 levels)"
    r = app_client.post("/budget")  # an empty body is not a budget
    assert r.status_code == 400 and r.json()["error"]["field"] == "body"
    assert app_client.post("/budget", json={"k": 4}).json() == {"ok": True, "k": 4}
    assert app_client.post("/profile").json() == {"force": True}  # the body is optional here
    assert app_client.post("/profile", json={"force": False}).json() == {"force": False}


@pytest.mark.parametrize(
    "raw, field",
    [(b'{"k": 1, "k": 2}', "k"), (b'{"spec": {"policy": {"name": "a", "name": "b"}}, "question": "q"}', "name")],
)
def test_a_key_given_twice_is_refused_naming_it(app_client, raw, field):
    r = app_client.post("/budget", content=raw, headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["field"] == field
    assert "twice" in r.json()["error"]["reason"]


@pytest.mark.parametrize(
    "text, kind, expected",
    [(None, int, None), ("7", int, 7), (" -3 ", int, -3), ("2.5", float, 2.5), ("1e3", float, 1000.0)],
)
def test_query_numbers_parse(text, kind, expected):
    assert query_number(text, "q", kind) == expected


@pytest.mark.parametrize(
    "text, kind", [("abc", int), ("1.5", int), ("9" * 30, int), ("nan", float), ("-inf", float), ("1" * 40, float)]
)
def test_bad_query_numbers_name_the_parameter(text, kind):
    with pytest.raises(BodyError) as e:
        query_number(text, "q", kind)
    assert e.value.field == "q" and e.value.status_code == 400
