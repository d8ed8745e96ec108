"""The server survives any request: per-search limits, body size, backpressure, admin scope, reward allowlist.

All against one real server started with every hardening flag set small (``conftest.hardened_server``).
"""

from __future__ import annotations

import socket
import threading
import time

import pytest
import requests
from transformers import AutoTokenizer

from .conftest import ADMIN, CONTEXT_LEN, LIMITS, USER
from .helpers import ARITH, QUESTION, CallbackServer, wait_until

STEP = {"max_tokens": 4, "stop": ["\n\n"], "temperature": 1.0}


def _spec(policy: dict, step: dict = None, reward: dict = None) -> dict:
    return {"policy": policy, "step": {**STEP, **(step or {})}, "reward": reward or ARITH, "seed": 0}


def _post(url: str, body: dict, headers=USER, timeout: float = 300) -> requests.Response:
    return requests.post(url + "/tot/search", json=body, headers=headers, timeout=timeout)


def _scheduler(url: str) -> dict:
    r = requests.get(url + "/spex/stats", headers=USER, timeout=30)
    assert r.status_code == 200, r.text
    return r.json()["scheduler"]


def _refused(r: requests.Response, field: str, status: int = 400) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["field"] == field and err["reason"], err
    return err


# (limit, spec just under or at it, spec just over it, the field the 400 names)
LIMIT_CASES = [
    ("max_width", {"name": "rebase", "width": 4, "max_depth": 1}, {"name": "rebase", "width": 5, "max_depth": 1},
     "policy.width"),
    ("max_width", {"name": "rstar", "num_rollouts": 1, "max_depth": 1, "branch": 4},
     {"name": "rstar", "num_rollouts": 1, "max_depth": 1, "branch": 5}, "policy.branch"),
    ("max_depth", {"name": "rebase", "width": 1, "max_depth": 3}, {"name": "rebase", "width": 1, "max_depth": 4},
     "policy.max_depth"),
    ("max_iterations", {"name": "rstar", "num_rollouts": 3, "max_depth": 1, "branch": 2},
     {"name": "rstar", "num_rollouts": 4, "max_depth": 1, "branch": 2}, "policy.num_rollouts"),
    # REST: iterations × (branch + roll_forward_steps × roll_branch) nodes at most: 12 vs 13
    ("max_nodes", {"name": "rest", "iterations": 1, "max_depth": 2, "branch": 3, "roll_forward_steps": 3,
                   "roll_branch": 3},
     {"name": "rest", "iterations": 1, "max_depth": 2, "branch": 3, "roll_forward_steps": 5, "roll_branch": 2},
     "policy"),
]  # fmt: skip


@pytest.mark.parametrize("limit, under, over, field", LIMIT_CASES, ids=[f"{c[0]}-{c[3]}" for c in LIMIT_CASES])
def test_policy_limit_just_under_runs_just_over_is_400(hardened_server, limit, under, over, field):
    url = hardened_server.url
    err = _refused(_post(url, {"spec": _spec(over), "question": QUESTION}), field)
    assert str(LIMITS[limit]) in err["reason"] and f"--tot-{limit.replace('_', '-')}" in err["reason"], err
    r = _post(url, {"spec": _spec(under), "question": QUESTION})
    assert r.status_code == 200, r.text
    assert r.json()["status"] == "done" and r.json()["num_requests"] >= 1


def test_step_token_limits(hardened_server):
    url = hardened_server.url
    width1 = {"name": "rebase", "width": 1, "max_depth": 1}
    _refused(_post(url, {"spec": _spec(width1, {"max_tokens": 17}), "question": QUESTION}), "step.max_tokens")
    assert _post(url, {"spec": _spec(width1, {"max_tokens": 16}), "question": QUESTION}).json()["status"] == "done"
    # a search's worst case: 12 nodes × 8 tokens = 96 (the limit) runs; × 9 = 108 is refused
    w4d3 = {"name": "rebase", "width": 4, "max_depth": 3}
    err = _refused(_post(url, {"spec": _spec(w4d3, {"max_tokens": 9}), "question": QUESTION}), "step.max_tokens")
    assert "--tot-max-search-tokens" in err["reason"]
    r = _post(url, {"spec": _spec(w4d3, {"max_tokens": 8}), "question": QUESTION})
    assert r.status_code == 200 and r.json()["status"] == "done", r.text


def test_prompt_longer_than_the_context_is_400(hardened_server, tiny_model):
    url = hardened_server.url
    policy, step = {"name": "rebase", "width": 1, "max_depth": 1}, {"max_tokens": 4}
    assert _post(url, {"spec": _spec(policy, step), "question": QUESTION}).status_code == 200  # limits resolved
    limits = requests.get(url + "/spex/info", headers=USER, timeout=30).json()["searches"]["limits"]
    assert limits["context_len"] == CONTEXT_LEN and limits["max_width"] == LIMITS["max_width"]
    longest = min(limits["max_input_len"], CONTEXT_LEN - step["max_tokens"])  # what SGLang itself accepts
    tok = AutoTokenizer.from_pretrained(tiny_model)
    words = ["seven"] * CONTEXT_LEN

    def prompt_len(n: int) -> int:
        return len(tok.encode(" ".join(words[:n]) + "\n"))  # the default prompt template

    n_fit = max(n for n in range(1, CONTEXT_LEN) if prompt_len(n) <= longest)
    r = _post(url, {"spec": _spec(policy, step), "question": " ".join(words[:n_fit])})
    assert r.status_code == 200 and r.json()["status"] == "done", r.text
    assert not r.json()["failures"], r.json()["failures"]  # SGLang accepted it: our check is no stricter than its own
    err = _refused(_post(url, {"spec": _spec(policy, step), "question": " ".join(words[: n_fit + 1])}), "question")
    assert str(CONTEXT_LEN) in err["reason"]


def test_body_over_the_size_limit_is_413(hardened_server):
    url = hardened_server.url
    before = _scheduler(url)["budget"]
    r = _post(url, {"spec": {}, "question": "x" * 70000})
    _refused(r, "body", 413)
    r = _post(url, {"spec": {}, "question": "x" * 65000})  # just under 65536 bytes: read, then judged on its fields
    assert r.status_code == 400 and r.json()["error"]["field"] != "body", r.text
    r = requests.post(url + "/spex/budget", data=b"{" + b" " * 70000 + b"}", headers=ADMIN, timeout=30)
    _refused(r, "body", 413)
    assert _scheduler(url)["budget"] == before


def _non_loopback_ip() -> str:
    """An address of this host that is not loopback (a UDP "connect" sends nothing)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("10.255.255.255", 1))
            ip = s.getsockname()[0]
        except OSError:
            ip = ""
    if not ip or ip.startswith("127."):
        pytest.fail("this host has no non-loopback IPv4 address to test the reward allowlist with")
    return ip


@pytest.mark.parametrize("rtype", ["callback", "prm"])
def test_reward_url_off_the_allowlist_is_400_and_never_contacted(hardened_server, rtype):
    listener = socket.socket()
    listener.bind(("0.0.0.0", 0))
    listener.listen(8)
    listener.settimeout(0.2)
    port, accepted = listener.getsockname()[1], []

    def accept() -> None:
        deadline = time.monotonic() + 3
        while time.monotonic() < deadline:
            try:
                accepted.append(listener.accept()[0])
            except OSError:
                pass

    t = threading.Thread(target=accept)
    t.start()
    try:
        reward = {"type": rtype, "url": f"http://{_non_loopback_ip()}:{port}/score"}
        err = _refused(
            _post(
                hardened_server.url,
                {"spec": _spec({"name": "rebase", "width": 1, "max_depth": 1}, reward=reward), "question": QUESTION},
            ),
            "reward.url",
        )
        assert "--tot-reward-hosts" in err["reason"]
        t.join()
        assert accepted == []  # no connection was attempted
    finally:
        listener.close()
        for c in accepted:
            c.close()


def test_callback_on_loopback_is_allowed(hardened_server):
    cb = CallbackServer(lambda body: 0.5)
    try:
        spec = _spec({"name": "rebase", "width": 2, "max_depth": 1}, reward={"type": "callback", "url": cb.url})
        r = _post(hardened_server.url, {"spec": spec, "question": QUESTION})
        assert r.status_code == 200 and r.json()["status"] == "done", r.text
        assert cb.calls >= 2
    finally:
        cb.close()


ADMIN_ROUTES = [
    ("/spex/budget", {"k": 3}),
    ("/spex/knobs", {"protect_ttl_s": 7.0}),
    ("/spex/cancel", {"rid_prefix": "spex:nobody:"}),
    ("/spex/promote", {"rid": "spex:nobody:r.0:"}),
    ("/spex/protect", {"search_id": "nobody"}),
    ("/spex/release", {}),
    ("/spex/profile", {"batch_sizes": [1, 2], "repeats": 1}),
]  # /respec/* (installed only with --respec-learner): test/unit/test_admin_scope.py


def test_admin_routes_refuse_the_user_key_and_change_nothing(hardened_server):
    url = hardened_server.url
    before = _scheduler(url)
    for route, body in ADMIN_ROUTES:
        for headers in (USER, {}):
            r = requests.post(url + route, json=body, headers=headers, timeout=30)
            assert r.status_code == 401, (route, headers, r.status_code, r.text)
    for headers in (USER, {}):
        assert requests.get(url + "/tot/searches", headers=headers, timeout=30).status_code == 401
    after = _scheduler(url)
    for key in ("budget", "immediate_cancel", "protection"):
        assert after.get(key) == before.get(key), key
    # SGLang's own admin route answers the user key the same way
    assert requests.post(url + "/flush_cache", headers=USER, timeout=30).status_code == 401


def test_admin_key_opens_the_admin_routes(hardened_server):
    url = hardened_server.url
    before = _scheduler(url)["budget"]
    try:
        r = requests.post(url + "/spex/budget", json={"k": 3}, headers=ADMIN, timeout=30)
        assert r.status_code == 200 and r.json()["scheduler"]["budget"] == 3, r.text
        assert _scheduler(url)["budget"] == 3
        r = requests.get(url + "/tot/searches", headers=ADMIN, timeout=30)
        assert r.status_code == 200 and "searches" in r.json()
    finally:
        requests.post(url + "/spex/budget", json={"k": before}, headers=ADMIN, timeout=30)
    # a route without admin scope keeps SGLang's normal level: the user key, not the admin key
    assert requests.get(url + "/spex/info", headers=USER, timeout=30).status_code == 200
    assert requests.get(url + "/spex/info", headers=ADMIN, timeout=30).status_code == 401


def _slow_search(url: str, cb: CallbackServer, headers=USER) -> requests.Response:
    spec = _spec({"name": "rebase", "width": 2, "max_depth": 2}, reward={"type": "callback", "url": cb.url})
    return requests.post(
        url + "/tot/search", json={"spec": spec, "question": QUESTION, "stream": True}, headers=headers,
        stream=True, timeout=300,
    )  # fmt: skip


def test_searches_are_the_callers_and_a_full_queue_is_429(hardened_server):
    url = hardened_server.url
    cb = CallbackServer(lambda body: time.sleep(1.5) or 0.5)  # every node waits on its reward
    streams = []
    try:
        streams = [_slow_search(url, cb) for _ in range(2)]  # one running, one queued (1 slot, 1 place)
        ids = [s.headers["X-Search-Id"] for s in streams]
        assert all(len(i) == 32 and int(i, 16) >= 0 for i in ids) and ids[0] != ids[1]  # 128 random bits each
        assert wait_until(lambda: cb.calls >= 1, timeout=60)
        r = _post(url, {"spec": _spec({"name": "rebase", "width": 1, "max_depth": 1}), "question": QUESTION})
        assert r.status_code == 429, r.text
        assert int(r.headers["Retry-After"]) >= 1 and r.json()["error"]["field"] == "search"
        # another caller cannot list them, and without the id cannot reach them; reusing an id is refused
        assert requests.get(url + "/tot/searches", headers=USER, timeout=30).status_code == 401
        guess = "0" * 32
        assert requests.delete(url + f"/tot/search/{guess}", headers=USER, timeout=30).status_code == 404
        small = _spec({"name": "rebase", "width": 1, "max_depth": 1})
        hijack = _post(url, {"spec": small, "question": QUESTION, "search_id": ids[0]})
        _refused(hijack, "search_id", 409)
        assert requests.get(url + f"/tot/search/{ids[0]}", headers=USER, timeout=30).json()["status"] == "running"
        # the caller holding the id cancels its own search
        r = requests.delete(url + f"/tot/search/{ids[1]}", headers=USER, timeout=60)
        assert r.status_code == 200 and r.json()["status"] == "cancelled", r.text
    finally:
        for s in streams:
            s.close()  # a disconnected stream cancels its search
        cb.close()
    assert wait_until(lambda: _scheduler(url)["pool"]["running"] == 0 and _scheduler(url)["pool"]["waiting"] == 0, 60)
    # a disconnected stream's search ends once its reward returns or its cancel's grace (2 s) passes
    searches = lambda: requests.get(url + "/spex/info", headers=USER, timeout=30).json()["searches"]  # noqa: E731
    assert wait_until(lambda: searches()["running"] == 0 and searches()["queued"] == 0, 60), searches()
    assert searches()["rejected"] >= 1
