"""SPEX through real SGLang (tiny model, CPU): identical trees with T3 off, hits adopted, misses aborted."""

from __future__ import annotations

import asyncio

import pytest
import requests

from sglang_spex.config import SpexConfig
from sglang_spex.speculation.runner import context_factory
from sglang_spex.tot.http_port import HttpPort
from sglang_spex.tot.search import run_search
from sglang_spex.tot.search_spec import SearchSpec

STEP = {"max_tokens": 6, "stop": ["\n\n"], "temperature": 1.0}
POLICIES = {
    "rebase": {"name": "rebase", "width": 4, "max_depth": 3},
    "ets": {"name": "ets", "width": 3, "max_depth": 2, "embedder": "tfidf"},
    "rstar": {"name": "rstar", "num_rollouts": 4, "max_depth": 3, "branch": 2},
    "rest": {"name": "rest", "iterations": 3, "max_depth": 3, "branch": 2, "roll_forward_steps": 1, "end_gate": 2.0},
}


def make_spec(policy: dict, seed: int = 5) -> SearchSpec:
    return SearchSpec.from_dict(
        {"policy": policy, "step": STEP, "reward": {"type": "verifier", "name": "arith"}, "seed": seed}
    )


def signature(res):
    return [(n["path"], n["text"], n["reward"], n["status"]) for n in sorted(res.nodes, key=lambda n: n["path"])]


async def _run(url: str, spec: SearchSpec, cfg=None):
    port = HttpPort(url)
    try:
        kw = {} if cfg is None else {"context_factory": context_factory(cfg)}
        return await run_search(spec, "What is 12 + 7?", port, **kw)
    finally:
        await port.close()


def engine_idle(url: str) -> bool:
    load = requests.get(url + "/v1/loads", params={"include": "core"}, timeout=30).json()["loads"][0]
    return load["num_running_reqs"] + load["num_waiting_reqs"] == 0


@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_spex_equals_baseline_on_real_sglang(spex_server_in_mode, policy):
    spec = make_spec(POLICIES[policy])
    url = spex_server_in_mode.url
    base = asyncio.run(_run(url, spec))
    spx = asyncio.run(_run(url, spec, SpexConfig(enabled=True, k_total=6, components=("t1", "t2"))))
    assert base.status == spx.status == "done"
    assert signature(spx) == signature(base)
    assert spx.answer == base.answer
    acc = spx.speculation
    assert acc["hits"] + acc["cancelled"] + acc["never_used"] + acc["failed"] == acc["issued"]
    assert spx.num_requests == base.num_requests - acc["hits"]


def pool(url: str) -> dict:
    return requests.get(url + "/spex/stats", timeout=30).json()["scheduler"]["pool"]


def test_bfs_misses_are_aborted_and_freed(spex_server_in_mode):
    url = spex_server_in_mode.url
    before = pool(url)
    spec = make_spec({"name": "rebase", "width": 6, "max_depth": 3, "softmax_temperature": 0.1}, seed=11)
    res = asyncio.run(_run(url, spec, SpexConfig(enabled=True, k_total=12)))
    acc = res.speculation
    assert acc["issued"] > 0 and acc["hits"] > 0
    assert acc["cancelled"] > 0  # REBASE's early widths over-predict: misses exist and are cancelled
    assert res.num_requests == sum(1 for n in res.nodes if n["path"] != "r") - acc["hits"]  # hits not regenerated
    assert engine_idle(url)  # nothing of the search is left running in SGLang
    after = pool(url)  # KV: nothing held by requests or by the search's (released) protection
    assert after["kv_available"] + after["kv_evictable"] == before["kv_available"] + before["kv_evictable"]
    assert after["kv_protected"] == before["kv_protected"]


def test_a_client_side_baseline_search_releases_its_protected_prefixes(spex_server):
    """The scheduler protects the cached prefixes of any live search; a baseline search run client-side (no SPEX
    context) releases them when it ends, as a SPEX one does, instead of holding them for the lease's TTL."""
    url = spex_server.url
    before = requests.get(url + "/spex/stats", timeout=30).json()["scheduler"]
    res = asyncio.run(_run(url, make_spec(POLICIES["rebase"], seed=9)))
    assert res.status == "done" and engine_idle(url)
    after = requests.get(url + "/spex/stats", timeout=30).json()["scheduler"]
    assert after["protection"]["counters"].get("protected", 0) > before["protection"]["counters"].get("protected", 0)
    assert after["protection"]["searches"] <= before["protection"]["searches"], (
        before["protection"],
        after["protection"],
    )
    assert after["pool"]["kv_protected"] <= before["pool"]["kv_protected"]


def _server_search(url: str, policy: dict, speculation=None) -> dict:
    body = {"question": "What is 12 + 7?", "spec": {**make_spec(policy).to_dict(), "speculation": speculation}}
    r = requests.post(url + "/tot/search", json=body, timeout=300)
    assert r.status_code == 200, r.text
    return r.json()


def test_server_side_search_runs_spex_and_reports(spex_server):
    policy = POLICIES["rstar"]
    base = _server_search(spex_server.url, policy, {"enabled": False})
    spx = _server_search(spex_server.url, policy, {"components": ["t1", "t2"]})
    sig = lambda res: [(n["path"], n["text"], n["reward"]) for n in sorted(res["nodes"], key=lambda n: n["path"])]
    assert sig(spx) == sig(base)
    assert base["speculation"]["issued"] == 0
    acc = spx["speculation"]
    assert acc["issued"] > 0 and acc["hits"] > 0 and acc["settings"]["k_total"] == 8
    metrics = requests.get(spex_server.url + "/metrics", timeout=30).text
    line = next(ln for ln in metrics.splitlines() if ln.startswith("spex_spec_hits_total"))
    assert float(line.split()[-1]) >= acc["hits"]


def test_bad_speculation_override_is_a_400(spex_server):
    body = {"question": "q", "spec": {**make_spec(POLICIES["rstar"]).to_dict(), "speculation": {"lookahead": -1}}}
    r = requests.post(spex_server.url + "/tot/search", json=body, timeout=60)
    assert r.status_code == 400 and "speculation.lookahead" in r.text
