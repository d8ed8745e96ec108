"""Each policy end-to-end through a real SGLang CPU server (tiny model): server-side (POST /tot/search, the
loop inside the SGLang server) and client-side (HttpPort), reproducibility, rewards and failures."""

from __future__ import annotations

import concurrent.futures as cf
import time

import pytest
import requests

from sglang_spex.tot.http_port import HttpPort
from sglang_spex.tot.search import run_batch, run_search
from sglang_spex.tot.search_spec import SearchSpec

from .helpers import (
    QUESTION,
    SMALL_POLICIES,
    CallbackServer,
    check_well_formed,
    engine_load,
    post_search,
    spec,
    tree_signature,
    wait_until,
)

pytestmark = pytest.mark.server


@pytest.mark.parametrize("policy", list(SMALL_POLICIES))
def test_policy_server_side(spex_server, policy):
    r = post_search(spex_server.url, {"spec": spec(SMALL_POLICIES[policy]), "question": QUESTION, "reference": "19"})
    assert r.status_code == 200, r.text
    res = r.json()
    check_well_formed(res, policy)
    assert res["correct"] in (True, False)
    if policy in ("rstar", "rest"):
        assert any(n["visits"] > 0 for n in res["nodes"])


@pytest.mark.parametrize("policy", list(SMALL_POLICIES))
async def test_policy_client_side(spex_server, policy):
    port = HttpPort(spex_server.url)
    try:
        res = await run_search(SearchSpec.from_dict(spec(SMALL_POLICIES[policy])), QUESTION, port, reference="19")
    finally:
        await port.close()
    check_well_formed(res.to_dict(), policy)


def test_same_seed_same_tree(spex_server):
    """Node texts and rewards are a function of (seed, path): two runs, and the client-side run, agree."""
    for policy in ("rebase", "rstar"):
        body = {"spec": spec(SMALL_POLICIES[policy], seed=1234), "question": QUESTION}
        a, b = (post_search(spex_server.url, body).json() for _ in range(2))
        assert tree_signature(a) == tree_signature(b), policy
        other = post_search(spex_server.url, {**body, "spec": spec(SMALL_POLICIES[policy], seed=99)}).json()
        assert [n["text"] for n in other["nodes"]] != [n["text"] for n in a["nodes"]]


async def test_client_side_matches_server_side_and_batches(spex_server):
    body = spec(SMALL_POLICIES["rebase"], seed=7)
    server = post_search(spex_server.url, {"spec": body, "question": QUESTION}).json()
    port = HttpPort(spex_server.url)
    try:
        results = await run_batch(SearchSpec.from_dict(body), [QUESTION, "What is 3 + 4?"], port, concurrency=2)
    finally:
        await port.close()
    assert tree_signature(results[0].to_dict()) == tree_signature(server)
    assert results[1].question == "What is 3 + 4?" and results[1].status == "done"


def test_failing_reward_marks_node_failed_and_search_completes(spex_server):
    def score(body):
        if body["path"].endswith(".1"):
            raise RuntimeError("reward model down")
        if body["path"] == "r.2":
            time.sleep(3)  # past reward_timeout
        return 0.25

    cb = CallbackServer(score)
    try:
        body = spec(
            {"name": "rebase", "width": 3, "max_depth": 2},
            reward={"type": "callback", "url": cb.url},
            reward_timeout=1.0,
        )
        res = post_search(spex_server.url, {"spec": body, "question": QUESTION}).json()
    finally:
        cb.close()
    assert res["status"] == "done"
    failed = {f["path"]: f["error"] for f in res["failures"]}
    assert "r.1" in failed and "500" in failed["r.1"]
    assert "timed out" in failed["r.2"]
    nodes = {n["path"]: n for n in res["nodes"]}
    assert nodes["r.1"]["status"] == "failed" and nodes["r.0"]["status"] == "done"
    assert nodes["r.0"]["reward"] == 0.25 and any(p.startswith("r.0.") for p in nodes)  # the search went on
    assert not any(p.startswith("r.1.") or p.startswith("r.2.") for p in nodes)  # failed nodes are not expanded
    assert engine_load(spex_server.url) == 0


def test_a_search_whose_every_node_failed_is_failed_with_the_first_error(spex_server):
    def score(body):
        raise ZeroDivisionError("the scorer broke")

    cb = CallbackServer(score)
    try:
        body = spec({"name": "rebase", "width": 3, "max_depth": 2}, reward={"type": "callback", "url": cb.url})
        res = post_search(spex_server.url, {"spec": body, "question": QUESTION}).json()
    finally:
        cb.close()
    assert res["status"] == "failed" and res["answer"] is None
    assert res["error"].startswith("every node failed; the first: r.") and "500" in res["error"], res["error"]
    assert len(res["failures"]) == 3 and engine_load(spex_server.url) == 0


def test_prm_and_logprob_rewards(spex_server):
    prm = {"type": "prm", "url": spex_server.url, "good_token": "a", "bad_token": "b"}
    for reward in (prm, {"type": "logprob"}, {**prm, "mode": "mean_logprob"}):
        res = post_search(
            spex_server.url, {"spec": spec(SMALL_POLICIES["rebase"], reward=reward), "question": QUESTION}
        ).json()
        assert res["status"] == "done" and not res["failures"], res["failures"]
        rewards = [n["reward"] for n in res["nodes"] if n["path"] != "r"]
        assert all(0.0 <= r <= 1.0 for r in rewards), rewards


def test_a_search_whose_requests_the_engine_aborts_is_failed_and_says_so(spex_server):
    """An operator's ``/abort_request`` (abort_all) ends the search's running steps: not the search's own cancel,
    so the steps say "aborted by the engine" and the search, with no step's result, is failed (not done)."""
    url = spex_server.url
    body = spec({"name": "rebase", "width": 2, "max_depth": 2}, step={"max_tokens": 400, "stop": []})
    with cf.ThreadPoolExecutor(1) as ex:
        search = ex.submit(post_search, url, {"spec": body, "question": QUESTION})
        assert wait_until(lambda: engine_load(url) > 0, timeout=60)
        while not search.done():  # each depth's steps as they reach the engine
            requests.post(url + "/abort_request", json={"abort_all": True}, timeout=30)
            time.sleep(0.1)
        res = search.result().json()
    assert res["status"] == "failed" and "aborted by the engine" in res["error"], (res["status"], res["error"])
    steps = [n for n in res["nodes"] if n["path"] != "r"]
    assert steps and all(n["status"] == "cancelled" and n["error"].startswith("aborted by the engine") for n in steps)
    assert {f["path"] for f in res["failures"]} == {n["path"] for n in steps}
    assert wait_until(lambda: engine_load(url) == 0, timeout=30)
