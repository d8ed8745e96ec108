"""Cancelling searches (DELETE, client disconnect) and refusing invalid specs on the real server."""

from __future__ import annotations

import threading

import pytest
import requests

from .helpers import QUESTION, engine_load, post_search, spec, wait_until

pytestmark = pytest.mark.server

# long enough to be cancelled mid-way: 25 depths of 8 branches x 96 tokens (tens of seconds on the tiny model)
LONG = spec({"name": "rebase", "width": 8, "max_depth": 25}, step={"max_tokens": 96, "max_total_tokens": 100000})


def _status(url, sid) -> dict:
    r = requests.get(f"{url}/tot/search/{sid}", timeout=30)
    return r.json() if r.status_code == 200 else {}  # 404 until the POST has arrived


def _running(url, sid) -> bool:
    st = _status(url, sid)
    return st.get("status") == "running" and st["num_requests"] >= 6 and st["inflight"] > 0


def _assert_nothing_left(url, sid):
    st = _status(url, sid)
    assert st["status"] == "cancelled", st
    assert st["inflight"] == 0 and st["engine_requests"] == 0
    assert wait_until(lambda: engine_load(url) == 0, timeout=10), "SGLang still runs requests of the search"
    assert st["result"]["status"] == "cancelled"
    assert any(n["status"] == "cancelled" for n in st["result"]["nodes"]) or st["result"]["num_requests"] > 0


def test_cancel_by_delete(spex_server):
    url, sid = spex_server.url, "cancel-delete"
    out = {}
    t = threading.Thread(
        target=lambda: out.update(r=post_search(url, {"spec": LONG, "question": QUESTION, "search_id": sid}))
    )
    t.start()
    assert wait_until(lambda: _running(url, sid), timeout=120)
    r = requests.delete(f"{url}/tot/search/{sid}", timeout=60)
    assert r.status_code == 200 and r.json()["status"] == "cancelled" and r.json()["inflight"] == 0
    t.join(60)
    assert out["r"].status_code == 200 and out["r"].json()["status"] == "cancelled"
    _assert_nothing_left(url, sid)
    assert requests.delete(f"{url}/tot/search/nope", timeout=30).status_code == 404


def test_cancel_by_client_disconnect(spex_server):
    url, sid = spex_server.url, "cancel-disconnect"
    try:  # the client gives up after a few seconds and closes the connection
        r = requests.post(url + "/tot/search", json={"spec": LONG, "question": QUESTION, "search_id": sid}, timeout=2)
        pytest.fail(f"search finished before the client gave up: {r.status_code} {r.text[:300]}")
    except requests.exceptions.ReadTimeout:
        pass
    assert wait_until(lambda: _status(url, sid).get("status") == "cancelled", timeout=60), {
        k: v for k, v in _status(url, sid).items() if k != "result"
    }
    _assert_nothing_left(url, sid)


def test_cancel_stream_disconnect(spex_server):
    url, sid = spex_server.url, "cancel-stream"
    body = {"spec": LONG, "question": QUESTION, "search_id": sid, "stream": True}
    with requests.post(url + "/tot/search", json=body, stream=True, timeout=120) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        events = []
        for line in r.iter_lines():
            if line.startswith(b"event: "):
                events.append(line[7:].decode())
            if events.count("node") >= 5:
                break
    assert events[0] == "started"
    assert wait_until(lambda: _status(url, sid).get("status") == "cancelled", timeout=60)
    _assert_nothing_left(url, sid)


@pytest.mark.parametrize(
    "body,field",
    [
        ({"spec": spec({"name": "rebase", "width": 0}), "question": QUESTION}, "policy.width"),
        ({"spec": spec({"name": "nope"}), "question": QUESTION}, "policy.name"),
        (
            {"spec": spec({"name": "rstar", "exploration_weight": "big"}), "question": QUESTION},
            "policy.exploration_weight",
        ),
        ({"spec": spec({"name": "rest", "bogus": 1}), "question": QUESTION}, "policy.bogus"),
        ({"spec": spec({"name": "rebase"}, step={"temperature": -1}), "question": QUESTION}, "step.temperature"),
        (
            {"spec": spec({"name": "rebase"}, reward={"type": "verifier", "name": "x"}), "question": QUESTION},
            "reward.name",
        ),
        ({"spec": spec({"name": "rebase"}, reward={"type": "prm"}), "question": QUESTION}, "reward.url"),
        ({"spec": spec({"name": "rebase"}, answer={"pattern": "("}), "question": QUESTION}, "answer.pattern"),
        ({"spec": {**spec({"name": "rebase"}), "speculation": 3}, "question": QUESTION}, "speculation"),
        ({"spec": {**spec({"name": "rebase"}), "colour": 1}, "question": QUESTION}, "colour"),
        ({"spec": spec({"name": "rebase"}), "question": ""}, "question"),
        ({"spec": spec({"name": "rebase"})}, "question"),
        ({"spec": spec({"name": "rebase"}), "question": QUESTION, "search_id": "a b"}, "search_id"),
    ],
)
def test_invalid_spec_is_refused(spex_server, body, field):
    before = requests.get(spex_server.url + "/tot/searches", timeout=30).json()["searches"]
    r = post_search(spex_server.url, body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["field"] == field and r.json()["error"]["reason"]
    assert requests.get(spex_server.url + "/tot/searches", timeout=30).json()["searches"] == before  # nothing started


def test_invalid_json_is_refused(spex_server):
    r = requests.post(spex_server.url + "/tot/search", data=b"{not json", timeout=30)
    assert r.status_code == 400 and r.json()["error"]["field"] == "body"
