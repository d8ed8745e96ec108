"""Shared pieces of the search tests against a real SGLang server."""

from __future__ import annotations

import time
from typing import Callable, Optional

import requests

from sglang_spex.tot.callback_server import CallbackRewardServer

QUESTION = "What is 12 + 7?"
STEP = {"max_tokens": 6, "stop": ["\n\n"], "temperature": 1.0}
ARITH = {"type": "verifier", "name": "arith"}

SMALL_POLICIES = {
    "rebase": {"name": "rebase", "width": 3, "max_depth": 2},
    "ets": {"name": "ets", "width": 3, "max_depth": 2, "embedder": "tfidf"},
    "rstar": {"name": "rstar", "num_rollouts": 2, "max_depth": 2, "branch": 2},
    "rest": {"name": "rest", "iterations": 2, "max_depth": 2, "branch": 2, "roll_forward_steps": 1},
}


# The shared test server runs --tot-speculation; these tests check the baseline core, so each search turns
# SPEX off for itself (a per-search override the server passes to its SPEX context).
BASELINE = {"enabled": False}


def spec(policy: dict, reward: Optional[dict] = None, seed: int = 0, **kw) -> dict:
    step = {**STEP, **kw.pop("step", {})}
    return {"policy": policy, "step": step, "reward": reward or ARITH, "seed": seed, "speculation": BASELINE, **kw}


def post_search(url: str, body: dict, timeout: float = 300) -> requests.Response:
    return requests.post(url + "/tot/search", json=body, timeout=timeout)


def engine_load(url: str) -> int:
    """Requests running or waiting in SGLang's scheduler."""
    load = requests.get(url + "/v1/loads", params={"include": "core"}, timeout=30).json()["loads"][0]
    return load["num_running_reqs"] + load["num_waiting_reqs"]


def wait_until(cond: Callable[[], bool], timeout: float = 60, every: float = 0.1) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(every)
    return cond()


def tree_signature(result: dict):
    """What "same tree" means: every node's path, text and reward (rounded: rewards are text-only here)."""
    return [
        (n["path"], n["text"], None if n["reward"] is None else round(n["reward"], 6), n["status"])
        for n in sorted(result["nodes"], key=lambda n: n["path"])
    ]


def check_well_formed(res: dict, policy: str) -> None:
    assert res["status"] == "done", res.get("error")
    assert res["policy"] == policy
    for key in ("answer", "correct", "answers", "nodes", "tokens_generated", "num_requests", "wall_time", "failures"):
        assert key in res
    nodes = {n["path"]: n for n in res["nodes"]}
    assert "r" in nodes and res["num_requests"] == len(nodes) - 1 > 0
    assert res["tokens_generated"] == sum(n["tokens"] for n in nodes.values()) > 0
    for n in nodes.values():
        if n["path"] != "r":
            assert n["parent"] in nodes and n["status"] in ("done", "failed")
            # a node SPEX generated ahead (adopted) keeps its speculative request's rid
            assert n["rid"] in (f"spex:{res['search_id']}:{n['path']}:", f"spex:{res['search_id']}:{n['path']}:s")


class CallbackServer(CallbackRewardServer):
    """A client-side reward endpoint: ``score(body) -> reward`` (raise → HTTP 500)."""
