"""2 tiny servers + sglang-router (manual policy): client-side searches through the router URL.

Observed from the workers (their request logs, loads and KV pool reports): each search's requests all land on
one worker, a cancel through the front aborts them on that worker and gives its KV back, and a worker killed
mid-search fails its search fast while the router keeps serving the others. The kill test runs last (the module
shares one cluster).
"""

from __future__ import annotations

import asyncio
import time

import pytest
import requests

from sglang_spex.config import SpexConfig
from sglang_spex.speculation.runner import context_factory
from sglang_spex.tot.http_port import HttpPort
from sglang_spex.tot.search import run_batch, run_search
from sglang_spex.tot.search_spec import SearchSpec

from .helpers import finish_reasons, held_tokens, load, received_by_worker, settled_pool

pytestmark = pytest.mark.server  # the cluster fixture starts real servers

STEP = {"max_tokens": 8, "stop": [], "temperature": 1.0}
LONG_STEP = {"max_tokens": 1200, "stop": [], "temperature": 1.0}
QUESTIONS = [f"Count: {i} one two three four five six seven" for i in range(4)]


def _spec(policy: dict, step: dict = STEP, seed: int = 0) -> SearchSpec:
    return SearchSpec.from_dict({"policy": policy, "step": step, "reward": {"type": "logprob"}, "seed": seed})


REBASE = {"name": "rebase", "width": 3, "max_depth": 3}
RSTAR = {"name": "rstar", "num_rollouts": 3, "max_depth": 3, "branch": 2}


async def _batch(url: str, spec: SearchSpec, questions):
    port = HttpPort(url)
    try:
        return await run_batch(spec, questions, port, concurrency=len(questions))
    finally:
        await port.close()


@pytest.mark.parametrize("policy", [REBASE, RSTAR], ids=["rebase", "rstar"])
def test_each_search_stays_on_one_worker(cluster, policy):
    results = asyncio.run(_batch(cluster.url, _spec(policy), QUESTIONS))
    seen = received_by_worker(cluster)
    holders = set()
    for res in results:
        assert res.status == "done" and not res.failures, (res.error, res.failures)
        by_worker = seen[res.search_id]
        assert len(by_worker) == 1, {u: len(r) for u, r in by_worker.items()}  # one worker got them all
        (holder, rids), = by_worker.items()  # fmt: skip
        assert len(rids) == res.num_requests
        holders.add(holder)
        deep = [n for n in res.to_dict()["nodes"] if n["path"].count(".") >= 2 and n["status"] == "done"]
        assert deep and all(n["cached_tokens"] > 0 for n in deep), [(n["path"], n["cached_tokens"]) for n in deep]
    assert holders == set(cluster.worker_urls)  # concurrent searches spread over both workers


def test_speculative_requests_stay_speculative_through_the_router(cluster):
    """sglang-router drops ``custom_params``: the worker reads the role from the rid (``...:s``), so its scheduler
    still ranks, caps and counts the search's speculative requests as speculative (its batch-stats rows)."""
    since = {u: requests.get(u + "/spex/stats", timeout=60).json()["batch"]["seq"] for u in cluster.worker_urls}

    async def main():
        port = HttpPort(cluster.url)
        try:
            factory = context_factory(SpexConfig(enabled=True, k_total=8))
            return await run_search(_spec(RSTAR, seed=11), QUESTIONS[0], port, context_factory=factory)
        finally:
            await port.close()

    res = asyncio.run(main())
    assert res.status == "done" and res.speculation["issued"] > 0, res.speculation
    (holder, rids), = received_by_worker(cluster)[res.search_id].items()  # fmt: skip
    assert any(r.endswith(":s") for r in rids) and any(r.endswith(":") for r in rids)
    hist = requests.get(holder + "/spex/stats", params={"history_since": since[holder]}, timeout=60).json()
    rows = hist["batch"]["history"]["rows"]
    assert rows and max(row["n_spec"] for row in rows) > 0  # the holder's scheduler saw them as speculative


def test_cancel_frees_kv_on_the_holding_worker(cluster):
    start = {u: settled_pool(u) for u in cluster.worker_urls}
    spec = _spec({"name": "rebase", "width": 3, "max_depth": 2}, LONG_STEP, seed=7)

    async def main():
        port = HttpPort(cluster.url)
        task = asyncio.create_task(run_search(spec, "Count: one two three", port, search_id="cancelme"))
        deadline = time.monotonic() + 120
        busy = []
        while not busy and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
            busy = [u for u in cluster.worker_urls if await asyncio.to_thread(load, u) > 0]
        assert len(busy) == 1, busy
        running = set(port.inflight)
        task.cancel()  # the front cancels the search: its requests are aborted where they run
        with pytest.raises(asyncio.CancelledError):
            await task
        await port.close()
        return busy[0], running

    holder, running = asyncio.run(main())
    seen = received_by_worker(cluster)["cancelme"]
    assert set(seen) == {holder}
    reasons = finish_reasons(next(s.log_path for s in cluster.servers if s.url == holder), "spex:cancelme:")
    ended = [reasons.get(rid) for rid in running]
    # Stopped by the cancel: none ran on to its 1200-token limit. A step may still end on EOS between the snapshot
    # and the abort reaching the scheduler (temperature 1, random weights), so one natural stop is not a failure.
    assert "abort" in ended and set(ended) <= {"abort", "stop"}, (running, reasons)
    for url in cluster.worker_urls:
        a, b = start[url], settled_pool(url)
        assert held_tokens(a) == held_tokens(b) == 0, (url, a, b)  # every token of the search is free or evictable
        assert a["req_slots_free"] == b["req_slots_free"] and b["kv_protected"] == 0, (url, a, b)


def test_killed_worker_fails_its_search_and_the_router_serves_others(cluster):
    # width 4: four of the victim's requests are in flight on the killed worker, enough failures to open the
    # router's circuit breaker, past which a retry would have moved them to the other worker (retries are off)
    spec = _spec({"name": "rebase", "width": 4, "max_depth": 3}, {**LONG_STEP, "max_tokens": 400}, seed=3)

    async def main():
        port = HttpPort(cluster.url)
        tasks = {
            sid: asyncio.create_task(run_search(spec, f"Count: {sid} one two", port, search_id=sid))
            for sid in ("victim", "bystander")
        }
        deadline = time.monotonic() + 120
        where = {}
        while len(where) < 2 and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
            where = {sid: set(w) for sid, w in received_by_worker(cluster).items() if sid in tasks}
        assert len(where) == 2 and where["victim"] != where["bystander"], where
        victim_worker = next(iter(where["victim"]))
        cluster.kill(cluster.worker_urls.index(victim_worker))
        done = await asyncio.wait_for(asyncio.gather(*tasks.values()), timeout=300)  # no hang
        survivors = set(cluster.worker_urls) - {victim_worker}
        deadline = time.monotonic() + 60  # the router's health check drops the dead worker (3 misses, 2 s apart)
        while await asyncio.to_thread(cluster.router.healthy_workers) != survivors and time.monotonic() < deadline:
            await asyncio.sleep(0.5)
        after = await run_search(spec, "Count: after the kill", port, search_id="after")
        await port.close()
        return victim_worker, dict(zip(tasks, done)), after

    victim_worker, res, after = asyncio.run(main())
    victim, bystander = res["victim"], res["bystander"]
    assert victim.status == "failed" and "WorkerLost" in victim.error, (victim.status, victim.error)
    assert victim.failures and victim.answers == []  # its failed nodes are reported, nothing was answered
    assert all("WorkerLost" in f["error"] for f in victim.failures), victim.failures
    seen = received_by_worker(cluster)
    assert set(seen["victim"]) == {victim_worker}  # nothing of it moved to the other worker's cold cache
    assert bystander.status == "done" and not bystander.failures, bystander.failures
    assert after.status == "done" and not after.failures, after.failures  # the router routes around the dead one
    assert victim_worker not in set(seen["after"])
