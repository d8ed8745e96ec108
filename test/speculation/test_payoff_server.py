"""The pay-off gate on a real SGLang server (tiny model, server-side searches): the scheduler publishes its live
decode-step line, server-side searches gate on it, and the search stays the baseline's with the gate on or off."""

from __future__ import annotations

import pytest
import requests
from search.helpers import post_search, tree_signature

pytestmark = pytest.mark.server

QUESTION = "What is 12 + 7?"


def body(speculation: dict, seed: int = 21) -> dict:
    return {
        "spec": {
            "policy": {"name": "rebase", "width": 6, "max_depth": 3},
            "step": {"max_tokens": 8, "stop": ["\n\n"], "temperature": 1.0},
            "reward": {"type": "verifier", "name": "arith"},
            "seed": seed,
            "speculation": speculation,
        },
        "question": QUESTION,
    }


def search(url: str, speculation: dict) -> dict:
    r = post_search(url, body(speculation))
    assert r.status_code == 200, r.text
    return r.json()


def test_gate_reads_the_schedulers_step_line_and_keeps_the_tree(spex_server):
    url = spex_server.url
    base = search(url, {"enabled": False})
    spex = {"enabled": True, "components": ["t1", "t2"], "early_stop": False, "payoff_gate": True}
    for _ in range(6):  # each search adds decode steps at several batch sizes until the scheduler has a fit
        gated = search(url, spex)
        if gated["speculation"]["step_line"] is not None:
            break
    counters = requests.get(url + "/spex/stats", timeout=30).json()["batch"]["counters"]
    assert counters["curve_a_s"] > 0 and counters["curve_b_s"] >= 0  # the line the scheduler fitted
    acc = gated["speculation"]
    a, b = acc["step_line"]
    assert a > 0 and b >= 0  # the gate used it
    assert 0.0 <= acc["min_use"] < 1.0
    assert tree_signature(gated) == tree_signature(base)
    assert acc["hits"] + acc["cancelled"] + acc["never_used"] + acc["failed"] == acc["issued"]
    off = search(url, {**spex, "payoff_gate": False})  # also the server's default
    assert off["speculation"]["min_use"] == 0.0
    assert tree_signature(off) == tree_signature(base)


def test_bad_payoff_gate_override_is_a_400_naming_the_field(spex_server):
    r = post_search(spex_server.url, body({"enabled": True, "payoff_gate": "yes"}))
    assert r.status_code == 400 and "speculation.payoff_gate" in r.text
