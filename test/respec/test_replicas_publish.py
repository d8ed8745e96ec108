"""ReplicaPublisher and the drafter version, against in-process stand-ins of SGLang's weight-update endpoints.

Pure logic (which replica got what, restore after a failed update step, the learner's record); the acceptance
test on real EAGLE3 servers is ``test_replicas.py``.
"""

from __future__ import annotations

from typing import List

import pytest
import torch
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from fastapi.testclient import TestClient

from sglang_spex.config import LearnerConfig
from sglang_spex.respec import routes
from sglang_spex.respec.hotswap import HotSwapClient, ReplicaPublisher, ReplicaPublishError
from sglang_spex.respec.learner import OnlineLearner


def replica(fail_update_at: List[int] = (), with_plugin: bool = True) -> FastAPI:
    """SGLang's session endpoints (the update of a version in ``fail_update_at`` is refused after loading
    nothing) plus, ``with_plugin``, our ``/respec/drafter``; ``app.state.served`` is the version it serves."""
    from sglang.srt.utils import MultiprocessingSerializer

    app = FastAPI()
    app.state.served, app.state.updates = None, []
    ok = {"success": True, "message": "Success"}

    @app.post("/pause_generation")
    async def pause(req: Request):
        return {"status": "ok"}

    @app.post("/continue_generation")
    async def resume(req: Request):
        return {"status": "ok"}

    @app.post("/begin_weight_update")
    async def begin(req: Request):
        return ok

    @app.post("/end_weight_update")
    async def end(req: Request):
        return ok

    @app.post("/update_weights_from_tensor")
    async def update(req: Request):
        body = await req.json()
        named = MultiprocessingSerializer.deserialize(body["serialized_named_tensors"][0])
        version = int(named[0][1].flatten()[0])  # the test tensors carry their version
        app.state.updates.append((version, body["weight_version"]))
        if version in fail_update_at:
            return JSONResponse({"success": False, "message": "rejected"}, status_code=400)
        app.state.served = version
        return ok

    if with_plugin:
        routes.install_drafter(app)
    return app


def _tensors(version: int):
    return [("fc.weight", torch.full((2, 2), float(version)))]


def _client(app: FastAPI, url: str) -> HotSwapClient:
    return HotSwapClient(url, post=TestClient(app).post)


def _dead(url: str, json: dict):
    raise ConnectionError("connection refused")


def test_every_replica_gets_the_version_and_records_it_apart_from_weight_version():
    a, b = replica(), replica(with_plugin=False)
    pub = ReplicaPublisher(clients=[_client(a, "http://a"), _client(b, "http://b")])
    out = pub(1, _tensors(1))
    assert out["failed"] == [] and [r["version"] for r in out["replicas"]] == [1, 1]
    assert a.state.served == b.state.served == 1
    assert a.state.updates == [(1, None)]  # SGLang's weight_version (the policy's) is left alone
    assert TestClient(a).get("/respec/drafter").json()["drafter_version"] == 1
    # a server without the plugin still takes the weights; its version is just not readable there
    assert [r["version_recorded"] for r in out["replicas"]] == [True, False]
    assert [s["version"] for s in pub.status()] == [1, 1]


def test_a_replica_that_rejects_keeps_its_old_drafter_and_is_reported():
    a, b = replica(), replica(fail_update_at=[2])
    pub = ReplicaPublisher(clients=[_client(a, "http://a"), _client(b, "http://b")])
    pub(1, _tensors(1))
    out = pub(2, _tensors(2))
    assert out["failed"] == ["http://b"]
    bad = out["replicas"][1]
    assert bad["step"] == "update_weights_from_tensor" and bad["version"] == 1 and bad["restored"] is True
    assert b.state.updates == [(1, None), (2, None), (1, None)] and b.state.served == 1  # version 1 pushed back
    assert a.state.served == 2 and [s["version"] for s in pub.status()] == [2, 1]
    assert TestClient(b).get("/respec/drafter").json()["drafter_version"] == 1
    pub(3, _tensors(3))  # the lagging replica takes the next version with the others
    assert a.state.served == b.state.served == 3


def test_a_dead_replica_is_reported_and_the_others_update():
    a = replica()
    pub = ReplicaPublisher(clients=[_client(a, "http://a"), HotSwapClient("http://dead", post=_dead)])
    out = pub(1, _tensors(1))
    assert out["failed"] == ["http://dead"] and out["replicas"][1]["step"] == "connect"
    assert out["replicas"][1]["version"] is None and a.state.served == 1


def test_no_replica_taking_the_version_raises_with_each_outcome():
    pub = ReplicaPublisher(clients=[HotSwapClient("http://x", post=_dead), HotSwapClient("http://y", post=_dead)])
    with pytest.raises(ReplicaPublishError) as e:
        pub(1, _tensors(1))
    assert [r.url for r in e.value.results] == ["http://x", "http://y"] and e.value.restored


def _learner(drafter, features, publish) -> OnlineLearner:
    cfg = LearnerConfig(train_steps=2, micro_batch=2, kd_steps=2, lr=1e-3, variant="unweighted", mode="sync")
    return OnlineLearner(drafter, features.batch, cfg, publish=publish)


def _rollouts(seqs):
    return [{"prompt_ids": list(p), "response_ids": list(r), "reward": 1.0} for p, r in seqs[:3]]


def test_learner_records_replicas_and_rolls_back_only_when_none_took_it(tiny_drafter, tiny_features, tiny_seqs):
    a = replica()
    pub = ReplicaPublisher(clients=[_client(a, "http://a"), HotSwapClient("http://dead", post=_dead)])
    lrn = _learner(tiny_drafter, tiny_features, pub)
    lrn.submit(_rollouts(tiny_seqs))
    rec = lrn.history[-1]
    assert rec.outcome == "published" and lrn.version == 1 and rec.reason == "replicas_failed: http://dead"
    assert [r["ok"] for r in rec.replicas] == [True, False]
    assert [s["version"] for s in lrn.state()["replicas"]] == [1, None]

    calls = []
    dead = ReplicaPublisher(
        clients=[HotSwapClient("http://dead", post=lambda u, json: calls.append(u) or _dead(u, json))]
    )
    lrn2 = _learner(tiny_drafter, tiny_features, dead)
    lrn2.submit(_rollouts(tiny_seqs))
    rec = lrn2.history[-1]
    assert rec.outcome == "rolled_back" and rec.reason.startswith("publish_failed") and lrn2.version == 0
    assert len(calls) == 1 and rec.replicas[0]["step"] == "connect"  # the learner did not push the old one again


def test_policy_pushes_still_tag_sglangs_weight_version():
    a = replica()
    HotSwapClient("http://a", post=TestClient(a).post, selector="target", version_prefix="policy-").push(4, _tensors(4))
    assert a.state.updates == [(4, "policy-4")]
    assert TestClient(a).get("/respec/drafter").json()["drafter_version"] is None  # a policy push is no drafter


def test_drafter_route_validates_its_body():
    app = FastAPI()
    routes.install_drafter(app)
    routes.install_drafter(app)  # once
    http = TestClient(app)
    assert http.post("/respec/drafter", json={"version": "x"}).status_code == 400
    assert http.post("/respec/drafter", json={"version": 1, "extra": 1}).json()["error"]["field"] == "extra"
    assert routes.drafter_version(app) is None
    assert http.post("/respec/drafter", json={"version": 5}).status_code == 200 and routes.drafter_version(app) == 5


@pytest.mark.parametrize("version", ["-1", str(2**63), "1" + "0" * 400, "1.5", '"1"', "true", "null"])
def test_a_drafter_version_out_of_range_is_400_and_changes_nothing(version):
    client = TestClient(replica())
    assert client.post("/respec/drafter", json={"version": 7}).status_code == 200
    r = client.post(
        "/respec/drafter", content=f'{{"version": {version}}}', headers={"content-type": "application/json"}
    )
    assert r.status_code == 400 and r.json()["error"]["field"] == "version"
    assert client.get("/respec/drafter").json()["drafter_version"] == 7
