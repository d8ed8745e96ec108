"""``--dp-size 2`` on CPU: every request of a search goes to one DP rank (SGLang's ``routed_dp_rank``).

Observed from the schedulers: the per-rank loads SGLang reports (``/v1/loads``: a throttled view, published after
each prefill and every 15th decode step by default, so a poll can miss a running search, but it never shows a
request on a rank the search did not reach), the radix-cache hits of each node (a child's prompt starts with its
parent's, so on the parent's rank it hits), each rank's own batch-stats ring (``/spex/stats`` → ``batch_ranks``:
rows only on the rank that ran the work), each rank's pool report (``/spex/info`` → ``dp_ranks``) after a cancel, a
knob reaching every rank, and the per-rank ``/metrics`` series (``dp_rank`` label).
"""

from __future__ import annotations

import concurrent.futures as cf
import threading
import time
import uuid
from typing import Dict, Iterator, List

import pytest
import requests
from server_modes import TINY, start_server

from sglang_spex.serve import ServerProcess

QUESTION = "Count: one two three four five six seven eight nine ten"
STEP = {"max_tokens": 24, "stop": [], "temperature": 1.0}
POLICY = {"name": "rebase", "width": 3, "max_depth": 3}


@pytest.fixture(scope="module")
def dp_server(tiny_model) -> Iterator[ServerProcess]:
    # no SGLANG_CPU_OMP_THREADS_BIND given: the launcher binds one core range per rank itself
    args = [*TINY, tiny_model, "--tot-speculation", "--tot-k-total", "4", "--dp-size", "2", "--enable-metrics"]
    srv = start_server(args)
    yield srv
    srv.stop()


def _body(seed: int, **kw) -> dict:
    spec = {"policy": POLICY, "step": STEP, "reward": {"type": "logprob"}, "seed": seed}
    return {"spec": spec, "question": QUESTION, **kw}


def _loads(url: str) -> Dict[int, int]:
    loads = requests.get(url + "/v1/loads", params={"include": "core"}, timeout=30).json()["loads"]
    return {int(x["dp_rank"]): x["num_running_reqs"] + x["num_waiting_reqs"] for x in loads}


def _ranks(url: str) -> List[dict]:
    info = requests.get(url + "/spex/info", timeout=30).json()
    assert info["dp_ranks"] is not None and len(info["dp_ranks"]) == 2, info.get("dp_ranks")
    return [r["sched"] for r in info["dp_ranks"]]


def _ring_seqs(url: str) -> Dict[int, int]:
    """Rows written so far by each rank's batch-stats ring."""
    rings = requests.get(url + "/spex/stats", timeout=30).json()["batch_ranks"]["dp_ranks"]
    assert [r["dp_rank"] for r in rings] == [0, 1] and all(r["available"] for r in rings), rings
    return {r["dp_rank"]: r["seq"] for r in rings}


def _idle(url: str) -> List[dict]:
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if not any(_loads(url).values()):
            return [r["pool"] for r in _ranks(url)]
        time.sleep(0.2)
    raise TimeoutError("DP ranks did not go idle")


def _deep_nodes_hit_the_cache(result: dict) -> None:
    deep = [n for n in result["nodes"] if n["path"].count(".") >= 2 and n["status"] == "done"]
    assert deep, result["nodes"]
    assert all(n["cached_tokens"] > 0 for n in deep), [(n["path"], n["cached_tokens"]) for n in deep]


def _summary(res: dict) -> dict:
    """What a failed assertion shows of a search's result: its status, error and each node's status, tokens, error."""
    nodes = [(n["path"], n["status"], n["tokens"], n["error"]) for n in res["nodes"]]
    return {"status": res.get("status"), "error": res.get("error"), "nodes": nodes}


def test_one_search_runs_on_one_rank(dp_server):
    url = dp_server.url
    seen: Dict[int, int] = {0: 0, 1: 0}
    errors: List[BaseException] = []
    done = threading.Event()

    def sample() -> None:
        try:
            while not done.is_set():
                for rank, n in _loads(url).items():
                    seen[rank] = max(seen[rank], n)
                time.sleep(0.02)
        except BaseException as e:  # a dead sampler must fail the test, not leave ``seen`` at zero
            errors.append(e)

    seq0 = _ring_seqs(url)
    t = threading.Thread(target=sample)
    t.start()
    t0 = time.monotonic()
    try:
        body = _body(0, search_id=uuid.uuid4().hex)
        body["spec"]["step"] = {**STEP, "max_tokens": 96}  # seconds in all: the sampler polls while it runs
        r = requests.post(url + "/tot/search", json=body, timeout=600)
    finally:
        took = time.monotonic() - t0
        done.set()
        t.join()
    assert not errors, errors
    assert r.status_code == 200 and r.json()["status"] == "done", r.text
    seq1 = _ring_seqs(url)  # only one rank's ring has the search's steps
    rank = requests.get(url + f"/tot/search/{body['search_id']}", timeout=30).json()["dp_rank"]

    def why() -> tuple:  # read only when an assertion fails
        return rank, seen, seq0, seq1, f"{took:.2f}s", _summary(r.json()), dp_server.log_tail(30)

    assert rank in (0, 1) and seen[1 - rank] == 0, why()  # SGLang's view: the other rank never held a request of it
    assert seq1[rank] > seq0[rank] and seq1[1 - rank] == seq0[1 - rank], why()  # every batch of it ran on its rank
    _deep_nodes_hit_the_cache(r.json())


def _wait_running(url: str, sid: str) -> None:
    """Until the search runs with requests in SGLang (a search submitted next sees it unfinished on its rank: the
    pinning counts those). Not ``/v1/loads``: that view is throttled and can miss a whole search on a busy host."""
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        state = requests.get(url + f"/tot/search/{sid}", timeout=30).json()
        assert state["status"] in ("queued", "running"), state  # it must still run: its steps are long
        if state["status"] == "running" and state["engine_requests"] > 0:
            return
        time.sleep(0.05)
    raise TimeoutError(f"search {sid} never had a request in the engine")


def test_concurrent_searches_spread_over_both_ranks(dp_server):
    url = dp_server.url
    seq0 = _ring_seqs(url)
    ids: List[str] = []
    streams = []
    ranks = []
    for seed in (1, 2):  # the second is submitted while the first runs (its steps are long)
        body = _body(seed, stream=True)
        body["spec"]["step"] = {**STEP, "max_tokens": 96}
        s = requests.post(url + "/tot/search", json=body, stream=True, timeout=600)
        assert s.status_code == 200, s.text
        streams.append(s)
        ids.append(s.headers["X-Search-Id"])
        ranks.append(requests.get(url + f"/tot/search/{ids[-1]}", timeout=30).json()["dp_rank"])
        if seed == 1:
            _wait_running(url, ids[0])
    assert sorted(ranks) == [0, 1], (ranks, dp_server.log_tail(30))
    with cf.ThreadPoolExecutor(2) as ex:
        list(ex.map(lambda s: s.content, streams))  # both run to their result
    for i in ids:
        res = requests.get(url + f"/tot/search/{i}", timeout=30).json()["result"]
        assert res["status"] == "done", res.get("error")
        _deep_nodes_hit_the_cache(res)
    seq1 = _ring_seqs(url)
    assert all(seq1[r] > seq0[r] for r in (0, 1)), (seq0, seq1)  # per-rank rows on both rings


def test_each_rank_reports_its_own_state_stats_and_metrics(dp_server):
    url = dp_server.url
    stats = requests.get(url + "/spex/stats", timeout=30).json()
    assert [s["dp_rank"] for s in stats["dp_ranks"]] == [0, 1] and stats["scheduler"]["dp_rank"] == 0
    rings = stats["batch_ranks"]
    agg = rings["aggregate"]
    assert agg["ranks"] == 2
    assert agg["latest"]["kv_total"] == sum(r["latest"]["kv_total"] for r in rings["dp_ranks"]) > 0
    info = requests.get(url + "/spex/info", timeout=30).json()
    assert [r["dp_rank"] for r in info["dp_ranks"]] == [0, 1]
    assert [r["sched"]["dp_rank"] for r in info["dp_ranks"]] == [0, 1]
    assert len({r["pid"] for r in info["dp_ranks"]}) == 2  # two scheduler processes
    assert all(r["batch"] is not None and r["batch"]["kv_total"] > 0 for r in info["dp_ranks"])
    # a knob reaches every rank; the reply has each rank's state after it was applied
    ttl = info["dp_ranks"][0]["sched"]["protection"]["ttl_s"]
    r = requests.post(url + "/spex/knobs", json={"protect_ttl_s": ttl + 7.0}, timeout=60).json()
    try:
        assert [s["dp_rank"] for s in r["dp_ranks"]] == [0, 1]
        assert [s["protection"]["ttl_s"] for s in r["dp_ranks"]] == [ttl + 7.0, ttl + 7.0]
    finally:
        requests.post(url + "/spex/knobs", json={"protect_ttl_s": ttl}, timeout=60)
    metrics = requests.get(url + "/metrics", timeout=60).text
    for rank in (0, 1):  # each rank's scheduler exported its own series
        line = next((ln for ln in metrics.splitlines() if ln.startswith("spex_rank_kv_total")
                     and f'dp_rank="{rank}"' in ln), None)  # fmt: skip
        assert line is not None, [ln for ln in metrics.splitlines() if ln.startswith("spex_rank_")]


def test_cancel_frees_kv_on_the_rank_holding_the_search(dp_server):
    url = dp_server.url
    start = _idle(url)
    body = _body(3, stream=True)
    body["spec"]["step"] = {**STEP, "max_tokens": 400}
    s = requests.post(url + "/tot/search", json=body, stream=True, timeout=600)
    sid = s.headers["X-Search-Id"]
    rank = requests.get(url + f"/tot/search/{sid}", timeout=30).json()["dp_rank"]
    _wait_running(url, sid)
    assert _loads(url)[1 - rank] == 0  # SGLang's view: the other rank holds nothing of it
    r = requests.delete(url + f"/tot/search/{sid}", timeout=120)
    assert r.status_code == 200 and r.json()["status"] == "cancelled", r.text
    s.close()
    requests.post(url + "/spex/release", json={}, timeout=30)
    end = _idle(url)
    for a, b in zip(start, end):  # every rank's pool: nothing held beyond what the radix cache may evict
        assert a["kv_available"] + a["kv_evictable"] == b["kv_available"] + b["kv_evictable"]
        assert a["req_slots_free"] == b["req_slots_free"] and b["kv_protected"] == 0
