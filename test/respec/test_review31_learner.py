"""Review 31 (ReSpec learner and ``/respec/*`` under abuse): concurrent sync updates are serialised and say
``updating``; a reward or log-prob past a float's range is a 400; ``/respec/policy`` refuses stale, empty,
non-float and oversized pushes; ``/respec/drafter`` refuses a version older than the recorded one."""

from __future__ import annotations

import json
import threading
import time

import pytest
import torch
from fastapi import FastAPI
from fastapi.testclient import TestClient

from sglang_spex.respec import policy_wire, routes
from sglang_spex.respec.buffer import RolloutError, served_fields, validate_rollout
from sglang_spex.respec.hotswap import serialize_named_tensors
from sglang_spex.respec.learner import LearnerConfig, OnlineLearner

GOOD = {"prompt_ids": [1, 2, 3], "response_ids": [4, 5, 6], "reward": 1.0}
BINARY = {"content-type": policy_wire.CONTENT_TYPE}


def _sync_learner(drafter, features, publish, **kw) -> OnlineLearner:
    cfg = LearnerConfig(
        **{"mode": "sync", "variant": "unweighted", "update_interval": 1, "train_steps": 1, "micro_batch": 1, **kw}
    )
    return OnlineLearner(drafter, features.batch, cfg, publish=publish)


def _slow(features, seconds: float):
    def batch(*args, **kw):
        time.sleep(seconds)  # widens the window in which concurrent updates overlap
        return features.batch(*args, **kw)

    return batch


def _one_per_drain(lrn: OnlineLearner) -> None:
    """Each update drains one rollout (so every concurrent update has something to train on)."""
    buf = lrn.buffer

    def drain():
        with buf._lock:
            if not buf._items:
                return []
            item = buf._items.popleft()
            buf.entries -= item.entries
            return [item]

    buf.drain = drain


# -- finding 2: sync updates one at a time ------------------------------------------------------------------------
def test_concurrent_sync_updates_publish_increasing_versions_and_keep_the_published_drafter(
    tiny_drafter, tiny_features, tiny_seqs
):
    published = []
    lrn = _sync_learner(tiny_drafter, tiny_features, lambda v, t: published.append((v, [x.clone() for _, x in t])))
    lrn.features = _slow(tiny_features, 0.2)
    _one_per_drain(lrn)
    start = threading.Barrier(4)
    answers = []

    def post(i):
        p, r = tiny_seqs[i]
        start.wait()
        answers.append(lrn.submit([{"prompt_ids": list(p), "response_ids": list(r), "reward": 1.0}]))

    threads = [threading.Thread(target=post, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert [v for v, _ in published] == [1, 2, 3, 4]
    assert sorted(a["version"] for a in answers) == [1, 2, 3, 4]
    assert [(r.version_before, r.version_after, r.outcome) for r in lrn.history] == [
        (v - 1, v, "published") for v in (1, 2, 3, 4)
    ]
    version, kept = lrn.current()
    assert version == 4
    assert all(torch.equal(a, b) for (_, a), b in zip(kept.hot_swap_tensors(), published[-1][1]))


# -- finding 6: ``updating`` in sync mode -------------------------------------------------------------------------
def test_a_sync_update_says_updating_while_it_runs(tiny_drafter, tiny_features, tiny_seqs):
    seen = []
    lrn = _sync_learner(
        tiny_drafter, tiny_features, lambda v, t: seen.append((lrn.state()["updating"], lrn.wait_idle(0)))
    )
    p, r = tiny_seqs[0]
    assert lrn.state()["updating"] is False
    assert lrn.submit([{"prompt_ids": list(p), "response_ids": list(r), "reward": 1.0}])["version"] == 1
    assert seen == [(True, False)]  # during the update: updating, not idle
    assert lrn.state()["updating"] is False and lrn.wait_idle(0)


# -- finding 4: a number past a float's range ---------------------------------------------------------------------
@pytest.mark.parametrize(
    "rollout, field",
    [
        ({**GOOD, "reward": 10**400}, "reward"),
        ({**GOOD, "reward": -(10**400)}, "reward"),
        ({**GOOD, "target_logprobs": [-0.1, -(10**400), -0.2]}, "target_logprobs[1]"),
        (
            {**GOOD, "target_top_logprobs": [[[4, -0.1]], [[5, -(10**400)]], [[6, -0.3]]]},
            "target_top_logprobs[1][0][1]",
        ),
    ],
)
def test_an_integer_past_a_floats_range_is_a_rollout_error(rollout, field):
    with pytest.raises(RolloutError) as e:
        validate_rollout(rollout)
    assert e.value.field == field and "finite" in str(e.value)


def test_a_huge_integer_reward_is_400_naming_the_field_and_stores_nothing(tiny_drafter, tiny_features):
    lrn = OnlineLearner(tiny_drafter, tiny_features.batch, LearnerConfig(variant="frozen", mode="sync"))
    app = FastAPI()
    routes.install(app, lrn)
    http = TestClient(app, raise_server_exceptions=False)
    body = json.dumps({"rollouts": [GOOD, {**GOOD, "reward": 10**400}]})
    r = http.post("/respec/rollouts", content=body, headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["field"] == "rollouts[1].reward", r.text
    state = http.get("/respec/state").json()
    assert state["buffer_size"] == 0 and state["rollouts_received"] == 0 and state["steps"] == 0


def test_served_fields_leave_out_a_log_prob_past_a_floats_range():
    meta = {"output_token_logprobs": [[-(10**400), 4, None]]}
    assert served_fields(meta, 1) == {}


# -- finding 5: stale, empty and non-float policy pushes ----------------------------------------------------------
def _weights(model):
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _unchanged(model, before) -> bool:
    return all(torch.equal(before[n], p) for n, p in model.named_parameters())


def _json_push(version, named) -> dict:
    return {"version": version, "serialized_named_tensors": serialize_named_tensors(named)}


@pytest.mark.parametrize("binary", [True, False], ids=["binary", "json"])
@pytest.mark.parametrize("stale", [3, 5])
def test_a_policy_version_at_or_below_the_copys_is_409_and_changes_nothing(served, tiny_target, binary, stale):
    client, model, _ = served
    named = [(n, p.detach() + 0.5) for n, p in tiny_target.named_parameters()]
    assert client.post("/respec/policy", content=policy_wire.encode(5, named), headers=BINARY).status_code == 200
    before = _weights(model)
    older = [(n, p.detach() - 0.5) for n, p in tiny_target.named_parameters()]
    if binary:
        r = client.post("/respec/policy", content=policy_wire.encode(stale, older), headers=BINARY)
    else:
        r = client.post("/respec/policy", json=_json_push(stale, older))
    assert r.status_code == 409 and r.json()["error"]["field"] == "version", r.text
    assert str(stale) in r.json()["error"]["reason"] and "5" in r.json()["error"]["reason"]
    assert _unchanged(model, before) and client.get("/respec/state").json()["policy_version"] == 5


def test_an_empty_json_policy_push_is_400_and_keeps_the_version(served, tiny_target):
    client, model, _ = served
    named = [(n, p.detach() + 0.5) for n, p in tiny_target.named_parameters()]
    assert client.post("/respec/policy", json=_json_push(1, named)).status_code == 200
    r = client.post("/respec/policy", json=_json_push(2, []))
    assert r.status_code == 400 and r.json()["error"]["field"] == "serialized_named_tensors", r.text
    assert client.get("/respec/state").json()["policy_version"] == 1


NOT_FLOAT = {"int64": torch.int64, "bool": torch.bool, "complex": torch.complex64, "fp8": torch.float8_e4m3fn}


@pytest.mark.parametrize(
    "dtype, binary",
    [pytest.param(d, b, id=f"{k}-{'binary' if b else 'json'}") for k, d in NOT_FLOAT.items() for b in (True, False)
     if not (b and k == "complex")],  # (safetensors, the binary body's format, has no complex dtype)
)  # fmt: skip
def test_a_policy_tensor_that_is_not_float_is_400_naming_it_and_changes_nothing(served, tiny_target, dtype, binary):
    client, model, _ = served
    before = _weights(model)
    named = [(n, p.detach() + 0.5) for n, p in tiny_target.named_parameters()]
    name, t = named[-1]
    named[-1] = (name, torch.ones(t.shape).to(dtype))
    if binary:
        r = client.post("/respec/policy", content=policy_wire.encode(1, named), headers=BINARY)
    else:
        r = client.post("/respec/policy", json=_json_push(1, named))
    assert r.status_code == 400, r.text
    assert r.json()["error"]["field"] == ("body" if binary else "serialized_named_tensors")
    if binary or dtype is not torch.float8_e4m3fn:  # (SGLang's unpickler already refuses an fp8 storage)
        assert name in r.json()["error"]["reason"] and "dtype" in r.json()["error"]["reason"]
    assert _unchanged(model, before) and client.get("/respec/state").json()["policy_version"] is None


def test_a_learner_without_a_policy_copy_answers_learner(tiny_drafter, tiny_features, tiny_target):
    lrn = OnlineLearner(tiny_drafter, tiny_features.batch, LearnerConfig(variant="frozen", mode="sync"))
    app = FastAPI()
    routes.install(app, lrn)
    named = [(n, p.detach()) for n, p in tiny_target.named_parameters()]
    r = TestClient(app).post("/respec/policy", content=policy_wire.encode(1, named), headers=BINARY)
    assert r.status_code == 400 and r.json()["error"]["field"] == "learner"


def test_concurrent_policy_pushes_never_label_older_weights_with_a_newer_version(tiny_drafter, tiny_features):
    synced = []

    def slow_sync(named):
        time.sleep(0.3)
        synced.append(named[0][0])
        return len(named)

    lrn = OnlineLearner(tiny_drafter, tiny_features.batch, LearnerConfig(variant="frozen"), policy_sync=slow_sync)
    errors = []

    def push(version):
        try:
            lrn.set_policy(version, [(f"v{version}", torch.ones(1))])
        except ValueError as e:  # StalePolicyError
            errors.append(e)

    newer = threading.Thread(target=push, args=(2,))
    newer.start()
    time.sleep(0.1)  # v2's copy is under way when v1 arrives
    push(1)
    newer.join()
    assert lrn.policy_version == 2 and synced == ["v2"] and len(errors) == 1


# -- finding 9: the policy body's size bound ----------------------------------------------------------------------
def test_a_policy_body_past_what_the_copy_can_take_is_413_and_a_float64_push_fits(served, tiny_target):
    client, model, lrn = served
    state = model.state_dict()
    raw64 = 8 * sum(t.numel() for t in state.values())
    before = _weights(model)
    for headers in (BINARY, {"content-type": "application/json"}):  # 4x a float64 push as base64, and more
        r = client.post("/respec/policy", content=b"x" * (4 * raw64 * 4 // 3 + (4 << 20)), headers=headers)
        assert r.status_code == 413 and r.json()["error"]["field"] == "body", r.text
    limit = lrn.policy_max_bytes()
    full64 = [(n, t.detach().double()) for n, t in state.items()]
    assert len(json.dumps(_json_push(1, full64))) <= limit and len(policy_wire.encode(1, full64)) <= limit
    for headers in (BINARY, {"content-type": "application/json"}):
        r = client.post("/respec/policy", content=b"x" * (limit + 1), headers=headers)
        assert r.status_code == 413 and r.json()["error"]["field"] == "body", r.text
    assert _unchanged(model, before) and client.get("/respec/state").json()["policy_version"] is None
    r = client.post("/respec/policy", json=_json_push(1, full64))
    assert r.status_code == 200 and r.json()["policy_version"] == 1, r.text


# -- finding 7: ``/respec/drafter`` never goes back ---------------------------------------------------------------
def test_a_drafter_version_older_than_the_recorded_one_is_409_and_the_same_one_is_recorded_again():
    app = FastAPI()
    routes.install_drafter(app)
    http = TestClient(app)
    assert http.post("/respec/drafter", json={"version": 38}).status_code == 200
    r = http.post("/respec/drafter", json={"version": 5})
    assert r.status_code == 409 and r.json()["error"]["field"] == "version", r.text
    assert "5" in r.json()["error"]["reason"] and "38" in r.json()["error"]["reason"]
    assert routes.drafter_version(app) == 38
    assert http.post("/respec/drafter", json={"version": 38}).status_code == 200  # a publisher's restore
    assert http.post("/respec/drafter", json={"version": 39}).status_code == 200 and routes.drafter_version(app) == 39
