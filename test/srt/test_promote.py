"""A speculative request the search starts waiting on is raised to primary rank inside the scheduler."""

from __future__ import annotations

import threading
import time

import pytest
import requests


def _promoted(url: str) -> int:
    return requests.get(url + "/spex/stats", timeout=30).json()["scheduler"]["counters"].get("promoted", 0)


@pytest.mark.parametrize("ack", [True, False], ids=["ack", "queued"])
def test_promote_running_speculative_request(spex_server_in_mode, ack):
    """``ack`` (default): the answer carries the scheduler state after the promote; ``ack`` false (what the
    search ports send): answered once queued, and the scheduler applies it in order all the same."""
    url, rid = spex_server_in_mode.url, f"spex:promo{int(ack)}:r.0:"
    body = {
        "text": "Step 1: add the numbers.",
        "rid": rid,
        "sampling_params": {
            "max_new_tokens": 1500,
            "temperature": 0,
            "ignore_eos": True,
            "custom_params": {"spex_role": "spec", "spex_search": "promo1", "spex_node": "r.0"},
        },
    }
    out = {}
    t = threading.Thread(target=lambda: out.update(requests.post(url + "/generate", json=body, timeout=300).json()))
    t.start()
    before = _promoted(url)
    deadline = time.monotonic() + 60
    while requests.get(url + "/spex/stats", timeout=30).json()["scheduler"]["pool"]["running"] == 0:
        assert time.monotonic() < deadline, "the speculative request never started"
        time.sleep(0.05)
    r = requests.post(url + "/spex/promote", json={"rid": rid, "ack": ack}, timeout=30)
    assert r.status_code == 200, r.text
    if ack:
        after = r.json()["scheduler"]["counters"].get("promoted", 0)
    else:
        assert r.json()["scheduler"] is None
        deadline = time.monotonic() + 30
        while (after := _promoted(url)) == before and time.monotonic() < deadline:
            time.sleep(0.05)
    requests.post(url + "/abort_request", json={"rid": rid}, timeout=30)
    t.join(timeout=120)
    assert after == before + 1
    assert requests.post(url + "/spex/promote", json={}, timeout=30).status_code == 400
