"""``POST /respec/rollouts`` under hostile JSON (review 33, finding 5): a lone UTF-16 surrogate in a key or string,
or nesting past ``MAX_JSON_DEPTH``, is a 400 naming the body (a surrogate key echoed in the buffer's error made the
answer itself fail: a 500), and the buffer is unchanged."""

from __future__ import annotations

import json

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from sglang_spex.respec import routes
from sglang_spex.respec.learner import LearnerConfig, OnlineLearner
from sglang_spex.tot.validation import MAX_JSON_DEPTH

GOOD = {"prompt_ids": [1, 2, 3], "response_ids": [4, 5, 6], "reward": 1.0}
GOOD_JSON = json.dumps(GOOD)


@pytest.fixture
def client(tiny_drafter, tiny_features):
    lrn = OnlineLearner(tiny_drafter, tiny_features.batch, LearnerConfig(variant="frozen", mode="sync"))
    app = FastAPI()
    routes.install(app, lrn)
    return TestClient(app)


@pytest.mark.parametrize(
    "body, reason",
    [
        ('{"rollouts": [%s, {"prompt_ids": [1], "response_ids": [2], "reward": 1.0, "\\ud800": 1}]}', "surrogate"),
        ('{"rollouts": [%s], "\\udc00": 1}', "surrogate"),
        ('{"rollouts": [%s, {"prompt_ids": [1], "response_ids": [2], "reward": 1.0, "x": "a\\ud800"}]}', "surrogate"),
        ('{"rollouts": [%s, {"prompt_ids": [1], "response_ids": ' + "[" * 600 + "]" * 600 + ', "reward": 1}]}', "deep"),
    ],
    ids=["rollout key", "top-level key", "string", "nested 600 deep"],
)
def test_hostile_json_is_a_400_naming_the_body_buffer_unchanged(client, body, reason):
    r = client.post("/respec/rollouts", content=body % GOOD_JSON, headers={"content-type": "application/json"})
    assert r.status_code == 400, r.text  # old: a surrogate key → 500
    err = r.json()["error"]
    assert err["field"] == "body" and reason in err["reason"], err
    state = client.get("/respec/state").json()
    assert state["buffer_size"] == 0 and state["rollouts_received"] == 0


def test_many_rollouts_are_no_deep_nesting(client):
    """More brackets than ``MAX_JSON_DEPTH`` side by side is no nesting: every rollout is taken."""
    r = client.post("/respec/rollouts", json={"rollouts": [GOOD] * (2 * MAX_JSON_DEPTH)})
    assert r.status_code == 200, r.text
    assert client.get("/respec/state").json()["rollouts_received"] == 2 * MAX_JSON_DEPTH
