"""What a client's search may not do to the server, on a real one: hold the event loop with its reference or its
answer pattern, or keep a cancel waiting (``conftest.hardened_server``: one search slot, one queue place)."""

from __future__ import annotations

import threading
import time

import pytest
import requests

from sglang_spex.tot.context import STOP_PATTERN_BUDGET

from .conftest import USER
from .helpers import ARITH, QUESTION, CallbackServer, wait_until

pytestmark = pytest.mark.server

SLOW_PATTERN = r"(.*)(.*)(.*)(.*)(.*)(.*)(.*)(.*)(?(1)(?!))"  # tries every split of a step: never matches


def _search(url: str, spec: dict, **body) -> requests.Response:
    return requests.post(
        url + "/tot/search", json={"spec": spec, "question": QUESTION, **body}, headers=USER, timeout=300
    )


def _health_during(url: str, running: threading.Event) -> list:
    """``/health`` answers (True) or times out (False) while ``running`` is set."""
    seen = []
    while running.is_set():
        try:
            seen.append(requests.get(url + "/health", timeout=20).status_code == 200)
        except requests.exceptions.Timeout:
            seen.append(False)
        time.sleep(0.2)
    return seen


def _while_searching(url: str, spec: dict, **body):
    running, out = threading.Event(), {}
    running.set()
    t = threading.Thread(target=lambda: out.update(health=_health_during(url, running)))
    t.start()
    try:
        r = _search(url, spec, **body)
    finally:
        running.clear()
        t.join(60)
    return r, out["health"]


def test_a_reference_math_verify_cannot_finish_is_judged_false_and_the_server_keeps_serving(hardened_server):
    """``9^{9^{9}}`` runs math-verify for minutes (it froze the event loop for good, SIGTERM included): the
    comparison's child is killed past its limit, the answer counts as wrong, /health answers throughout."""
    spec = {
        "policy": {"name": "rebase", "width": 2, "max_depth": 1},
        "step": {"max_tokens": 8, "stop": [], "temperature": 1.0},
        "reward": ARITH,
        "answer": {"pattern": r"(\d)"},
        "seed": 0,
    }
    answered = None
    for seed in range(8):  # a seed whose steps state a digit (the tiny model's text is random)
        r, health = _while_searching(hardened_server.url, {**spec, "seed": seed}, reference="9^{9^{9}}")
        assert r.status_code == 200, r.text
        assert all(health), health
        if r.json()["answer"] is not None:
            answered = r.json()
            break
    assert answered is not None and answered["correct"] is False, answered


def test_an_answer_pattern_that_backtracks_uses_its_budget_then_the_search_stops(spex_server):
    """16 steps of up to 48 tokens (the shared server: no per-search limits), so most steps are long enough for
    the pattern to run past its per-step timeout and use up the search's budget whatever the sampled text; the
    steps it could not read fail and the search stops there (no later step could state an answer)."""
    spec = {
        "policy": {"name": "rebase", "width": 4, "max_depth": 4},
        "step": {"max_tokens": 48, "stop": [], "temperature": 1.0},
        "reward": ARITH,
        "answer": {"pattern": SLOW_PATTERN},
        "seed": 0,
    }
    r, health = _while_searching(spex_server.url, spec)
    assert r.status_code == 200, r.text
    failures = r.json()["failures"]
    assert failures and all("answer.pattern" in f["error"] for f in failures), failures
    assert r.json()["stop_reason"] == STOP_PATTERN_BUDGET
    assert health and all(health), health


def test_cancel_a_queued_search_and_one_waiting_on_its_reward(hardened_server):
    """A queued search is cancelled at once, and one held by a reward that never answers within its grace:
    both DELETEs answer ``cancelled``, the slot and the queue place free up."""
    url = hardened_server.url
    release, entered = threading.Event(), []
    cb = CallbackServer(lambda body: entered.append(1) or (release.wait(120) and 0.5))  # hangs until released
    spec = {
        "policy": {"name": "rebase", "width": 1, "max_depth": 2},
        "step": {"max_tokens": 4, "stop": [], "temperature": 1.0},
        "reward": {"type": "callback", "url": cb.url},
        "seed": 0,
    }
    threads, ids = [], ["a" * 32, "b" * 32]
    try:
        for sid in ids:
            threads.append(threading.Thread(target=_search, args=(url, spec), kwargs={"search_id": sid}))
            threads[-1].start()
            assert wait_until(
                lambda: requests.get(f"{url}/tot/search/{sid}", headers=USER, timeout=30).status_code == 200, 60
            )
        assert wait_until(lambda: entered, timeout=60)
        status = [requests.get(f"{url}/tot/search/{s}", headers=USER, timeout=30).json()["status"] for s in ids]
        assert status == ["running", "queued"], status
        for sid in reversed(ids):  # the queued one first
            r = requests.delete(f"{url}/tot/search/{sid}", headers=USER, timeout=60)
            assert r.status_code == 200 and r.json()["status"] == "cancelled", r.text
    finally:
        release.set()
        for t in threads:
            t.join(120)
        cb.close()
    info = requests.get(url + "/spex/info", headers=USER, timeout=30).json()["searches"]
    assert info["running"] == 0 and info["queued"] == 0
