"""/respec routes on a FastAPI app, and the hot-swap client against a fake SGLang weight-update API that
deserialises with SGLang's own MultiprocessingSerializer."""

from __future__ import annotations

import json

import pytest
from fastapi import FastAPI, Request
from fastapi.testclient import TestClient

from sglang_spex.respec import rollout_wire, routes
from sglang_spex.respec.hotswap import HotSwapClient, HotSwapError
from sglang_spex.respec.learner import LearnerConfig, OnlineLearner

GOOD = {"prompt_ids": [1, 2, 3], "response_ids": [4, 5, 6], "reward": 1.0}


@pytest.fixture
def client(tiny_drafter, tiny_features):
    lrn = OnlineLearner(tiny_drafter, tiny_features.batch, LearnerConfig(variant="frozen", mode="sync"))
    app = FastAPI()
    routes.install(app, lrn)
    return TestClient(app), lrn


@pytest.mark.parametrize(
    "body, field",
    [
        ("not json", "body"),
        ("[1, 2]", "body"),
        (json.dumps({"rollouts": [GOOD], "x": 1}), "x"),
        (json.dumps({}), "rollouts"),
        (json.dumps({"rollouts": {"a": 1}}), "rollouts"),
        (json.dumps({"rollouts": [GOOD, {**GOOD, "oops": 1}]}), "rollouts[1].oops"),
        ('{"rollouts": [{"prompt_ids": [1], "response_ids": [2], "reward": NaN}]}', "rollouts[0].reward"),
        (json.dumps({"rollouts": [{**GOOD, "response_ids": [[1, 2]]}]}), "rollouts[0].response_ids[0]"),
        (json.dumps({"rollouts": [{**GOOD, "target_logprobs": [-1.0]}]}), "rollouts[0].target_logprobs"),
    ],
)
def test_bad_payload_400_buffer_unchanged(client, body, field):
    http, lrn = client
    r0 = http.post("/respec/rollouts", json={"rollouts": [GOOD]})
    assert r0.status_code == 200, (r0.text, [getattr(x, "path", None) for x in http.app.routes])
    r = http.post("/respec/rollouts", content=body, headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["field"] == field
    state = http.get("/respec/state").json()
    assert state["buffer_size"] == 1 and state["rollouts_received"] == 1


def test_a_rollout_past_the_context_is_400_buffer_unchanged(client, tiny_target):
    """A rollout longer than the model's context (the learner's bound) is refused with the field named."""
    http, lrn = client
    ctx = tiny_target.config.max_position_embeddings
    assert lrn.buffer.max_len == ctx
    long = {**GOOD, "prompt_ids": [1] * (ctx - 2)}  # + 3 response tokens: one past the context
    r = http.post("/respec/rollouts", json={"rollouts": [GOOD, long]})
    assert r.status_code == 400 and r.json()["error"]["field"] == "rollouts[1].response_ids", r.text
    assert http.get("/respec/state").json()["buffer_size"] == 0


def test_good_payload_and_state(client):
    http, _ = client
    r = http.post("/respec/rollouts", json={"rollouts": [GOOD, {**GOOD, "target_logprobs": [-0.1, -0.2, -0.3]}]})
    assert r.status_code == 200 and r.json()["accepted"] == 2
    state = http.get("/respec/state").json()
    assert state["version"] == 0 and state["buffer_size"] == 2 and state["variant"] == "frozen"


def test_a_binary_body_is_the_same_rollouts_and_checked_against_the_learners_bounds(client, tiny_target):
    """``Content-Type: application/octet-stream`` (``rollout_wire``): stored like JSON; a token outside the
    model's vocabulary, a rollout past its context or a body that is not safetensors is a 400 naming the field
    and stores nothing; ``more`` parts are one step."""
    http, lrn = client
    binary = {"content-type": rollout_wire.CONTENT_TYPE}
    vocab, ctx = lrn.buffer.vocab_size, lrn.buffer.max_len
    assert vocab == tiny_target.config.vocab_size and ctx == tiny_target.config.max_position_embeddings
    bad = [
        ([GOOD, {**GOOD, "response_ids": [4, vocab, 6]}], "rollouts[1].response_ids[1]"),
        ([{**GOOD, "prompt_ids": [1] * (ctx - 2)}], "rollouts[0].response_ids"),
    ]
    for step, field in bad:
        r = http.post("/respec/rollouts", content=rollout_wire.encode(step), headers=binary)
        assert r.status_code == 400 and r.json()["error"]["field"] == field, r.text
    r = http.post("/respec/rollouts", content=json.dumps({"rollouts": [GOOD]}), headers=binary)
    assert r.status_code == 400 and r.json()["error"]["field"] == "body", r.text
    assert http.get("/respec/state").json()["buffer_size"] == 0
    top = {**GOOD, "target_top_logprobs": [[[4, -0.1]], [[5, -0.2], [9, -3.0]], [[6, -0.3]]]}
    for more in (True, False):
        r = http.post("/respec/rollouts", content=rollout_wire.encode([GOOD, top], more=more), headers=binary)
        assert r.status_code == 200 and r.json()["accepted"] == 2, r.text
    state = http.get("/respec/state").json()
    assert state["buffer_size"] == 4 and state["steps"] == 1
    stored = lrn.buffer.snapshot()[-1].target_top_logprobs
    assert stored.ids.tolist() == [[4, -1], [5, 9], [6, -1]]


def test_install_from_env_is_inert_without_flag(monkeypatch):
    monkeypatch.delenv(routes.ENV_VAR, raising=False)
    app = FastAPI()
    assert routes.install_from_env(app) is None
    assert not [r for r in app.routes if getattr(r, "path", "").startswith("/respec")]


def fake_sglang(fail_update: bool = False):
    """The three 0.5.23 endpoints with SGLang's session rules; payloads go through SGLang's deserializer."""
    from sglang.srt.utils import MultiprocessingSerializer

    app = FastAPI()
    app.state.session = None
    app.state.log = []

    @app.post("/pause_generation")
    async def pause(req: Request):
        app.state.log.append(("pause", await req.json()))
        return {"message": "Generation paused successfully.", "status": "ok"}

    @app.post("/continue_generation")
    async def resume(req: Request):
        app.state.log.append(("continue", await req.json()))
        return {"message": "Generation continued successfully.", "status": "ok"}

    @app.post("/begin_weight_update")
    async def begin(req: Request):
        body = await req.json()
        app.state.log.append(("begin", body))
        if app.state.session is not None:
            return {"success": False, "message": "a weight-update session is already open"}
        app.state.session = body["selector"]
        return {"success": True, "message": "Success"}

    @app.post("/update_weights_from_tensor")
    async def update(req: Request):
        body = await req.json()
        named = MultiprocessingSerializer.deserialize(body["serialized_named_tensors"][0])
        app.state.log.append(("update", {**body, "serialized_named_tensors": named}))
        if app.state.session is None:
            return {"success": False, "message": "must run between begin and end"}
        if fail_update:
            from fastapi.responses import JSONResponse

            return JSONResponse({"success": False, "message": "boom"}, status_code=400)
        return {"success": True, "message": "Success"}

    @app.post("/end_weight_update")
    async def end(req: Request):
        app.state.log.append(("end", await req.json()))
        ok = app.state.session is not None
        app.state.session = None
        return {"success": ok, "message": "Success" if ok else "no session"}

    return app


def test_hot_swap_session(tiny_drafter):
    app = fake_sglang()
    http = TestClient(app)
    swap = HotSwapClient("http://testserver", post=http.post)
    tensors = tiny_drafter.hot_swap_tensors()
    swap.push(3, tensors)
    steps = [s for s, _ in app.state.log]
    assert steps == ["pause", "begin", "update", "end", "continue"] and app.state.session is None
    assert app.state.log[0][1] == {"mode": "in_place"}
    assert app.state.log[1][1] == {"selector": "draft"}
    body = app.state.log[2][1]
    assert body["selector"] == "draft" and body["weight_version"] is None and body["flush_cache"] is False
    got = body["serialized_named_tensors"]
    assert [n for n, _ in got] == [n for n, _ in tensors]
    assert all(a.equal(b) for (_, a), (_, b) in zip(got, tensors))
    assert swap.pushed_versions == [3]


def test_hot_swap_failure_still_ends_session(tiny_drafter):
    app = fake_sglang(fail_update=True)
    swap = HotSwapClient("http://testserver", post=TestClient(app).post)
    with pytest.raises(HotSwapError) as e:
        swap.push(1, tiny_drafter.hot_swap_tensors())
    assert e.value.step == "update_weights_from_tensor"
    steps = [s for s, _ in app.state.log]
    assert steps == ["pause", "begin", "update", "end", "continue"] and app.state.session is None


def test_a_body_over_max_post_bytes_is_413_and_parts_count_one_step(tiny_drafter, tiny_features):
    """The learner's own body limit (``max_post_bytes``) answers 413 naming it and stores nothing; parts posted
    with ``more`` are stored without counting a step, and the step's last part counts it once."""
    lrn = OnlineLearner(tiny_drafter, tiny_features.batch, LearnerConfig(variant="frozen", max_post_bytes=2048))
    app = FastAPI()
    routes.install(app, lrn)
    http = TestClient(app)
    r = http.post("/respec/rollouts", json={"rollouts": [GOOD] * 60})
    assert r.status_code == 413 and "learner.max_post_bytes" in r.json()["error"]["reason"], r.text
    assert (lrn.buffer.total_added, lrn.steps) == (0, 0)
    for more in (True, True, False):
        r = http.post("/respec/rollouts", json={"rollouts": [GOOD] * 10, "more": more})
        assert r.status_code == 200 and r.json()["accepted"] == 10
        assert lrn.steps == (0 if more else 1)
    state = http.get("/respec/state").json()
    assert state["rollouts_received"] == 30 and state["steps"] == 1 and state["max_post_bytes"] == 2048
