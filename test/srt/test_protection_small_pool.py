"""Prefix protection on a KV pool too small for a search's next step must give way, not stall the scheduler.

A review found that a server-side search on a 700-token pool hung the whole server: its nodes' prefixes were
locked, each waiting expansion needed its uncached prompt plus its reserved output (SGLang's admission charges
``max_new_tokens``), and protection's estimate of the need counted the prompt only, so it never yielded. Nothing
ran again until the search's client went away; every other request timed out with it.
"""

from __future__ import annotations

import concurrent.futures as cf
import time
from types import SimpleNamespace

import pytest
import requests
from server_modes import FANOUT_SEARCH, TINY, start_server

from sglang_spex.adapters import scheduler as sa
from sglang_spex.srt import prefix_protection as pp

POOL_TOKENS = 700
SEARCH = FANOUT_SEARCH
SEARCH_TIMEOUT_S = 60  # the search alone takes a few seconds (4 s on a plain server); the hang never ends
PROBE = {"text": "hello", "sampling_params": {"max_new_tokens": 4}}


@pytest.fixture(scope="module")
def tiny_pool_server(tiny_model):
    args = [*TINY, tiny_model, "--tot-speculation", "--tot-k-total", "8", "--max-total-tokens", str(POOL_TOKENS)]
    srv = start_server(args)
    yield srv
    srv.stop()


@pytest.mark.server
def test_search_on_a_small_pool_does_not_stall_the_scheduler(tiny_pool_server):
    url = tiny_pool_server.url
    with cf.ThreadPoolExecutor(1) as ex:
        search = ex.submit(requests.post, url + "/tot/search", json=SEARCH, timeout=SEARCH_TIMEOUT_S)
        time.sleep(3)  # the search's first step has finished (its nodes are protected), the next is queued
        t0 = time.monotonic()
        probe = requests.post(url + "/generate", json=PROBE, timeout=SEARCH_TIMEOUT_S)
        probe_s = time.monotonic() - t0
        try:
            out = search.result()
        except requests.exceptions.Timeout:
            stats = requests.get(url + "/spex/stats", timeout=10).json()["scheduler"]
            pytest.fail(f"the search stalled: pool {stats['pool']}, protection {stats['protection']}")
    assert probe.status_code == 200 and probe_s < 30, (probe.status_code, probe_s, probe.text[:300])
    assert out.status_code == 200, out.text[:500]
    stats = requests.get(url + "/spex/stats", timeout=10).json()["scheduler"]
    print(f"probe answered in {probe_s:.1f}s; protection {stats['protection']}")


# ---------------------------------------------------------------- the need estimate, on stand-ins
def _scheduler(available: int, page_size: int = 1):
    """Free + evictable KV ``available`` (split between the two), nothing protected."""
    allocator = SimpleNamespace(available_size=lambda: available // 2)
    tree = SimpleNamespace(evictable_size=lambda: available - available // 2, protected_size=lambda: 0)
    return SimpleNamespace(
        token_to_kv_pool_allocator=allocator, page_size=page_size, tree_cache=tree, max_total_num_tokens=10_000
    )


def _req(prompt: int, max_new: int, prefix: int = 0, output: int = 0):
    return SimpleNamespace(
        origin_input_ids=[1] * prompt,
        output_ids=[1] * output,
        prefix_len=prefix,
        sampling_params=SimpleNamespace(max_new_tokens=max_new),
        kv=SimpleNamespace(req_pool_idx=None),
    )


def test_admission_need_counts_reserved_output_and_overhead():
    # the review's case: ~344 uncached prompt tokens + 200 reserved output, ~389 free + evictable
    req = _req(prompt=400, max_new=200, prefix=56)
    assert sa.admission_shortfall(_scheduler(389), req) == 344 + 200 + 1 + 1 - 389  # + a page, strict <
    assert sa.admission_shortfall(_scheduler(344 + 200 + 1 + 1), req) == 0
    assert sa.admission_shortfall(_scheduler(344 + 200 + 1), req) == 1  # SGLang admits only below the budget
    # output already written is not reserved again; a never-tried request counts its whole sequence
    assert sa.admission_shortfall(_scheduler(100), _req(prompt=50, max_new=60, output=20)) == 50 + 20 + 40 + 1 + 1 - 100
    # the page reserve follows the page size; the reserve is clipped as SGLang clips it
    assert sa.admission_shortfall(_scheduler(90, page_size=16), _req(prompt=50, max_new=30)) == 50 + 30 + 16 + 1 - 90
    huge = _req(prompt=10, max_new=10**9)
    assert sa.admission_shortfall(_scheduler(0), huge) == 10 + sa.CLIP_MAX_NEW_TOKENS + 1 + 1


# ---------------------------------------------------------------- when protection yields, on a stand-in scheduler
class _Tree:
    def __init__(self):
        self.unlocked: list = []

    def unlock(self, lock):
        self.unlocked.append(lock)


def _stalled_protection(monkeypatch, shortfall):
    """Two searches holding one lock each, a primary waiting, nothing running: the stall :meth:`_stalled` sees."""
    clock = [100.0]
    monkeypatch.setattr(pp, "time", SimpleNamespace(monotonic=lambda: clock[0]))
    monkeypatch.setattr(pp.sa, "admission_shortfall", lambda scheduler, req: shortfall(scheduler))
    p = pp.PrefixProtection()
    for i, s in enumerate(("old", "young")):
        p.locks[s] = {"r": pp._Lock(lock=s, tokens=10)}
        p.last_seen[s] = float(i)
        p._num_locks += 1
        p._locked_tokens += 10
    waiting = SimpleNamespace(rid="plain", sampling_params=SimpleNamespace(custom_params=None))
    sched = SimpleNamespace(
        running_batch=None, chunked_req=None, waiting_queue=[waiting], last_batch=None, tree_cache=_Tree()
    )
    return p, sched, clock


def test_yields_the_oldest_search_until_the_waiting_request_fits(monkeypatch):
    p, sched, clock = _stalled_protection(monkeypatch, lambda s: 5 if len(s.tree_cache.unlocked) < 1 else 0)
    p._yield_to_waiting(sched)
    clock[0] += pp.YIELD_AFTER_S / 2
    p._yield_to_waiting(sched)
    assert sched.tree_cache.unlocked == []  # not before YIELD_AFTER_S
    clock[0] += pp.YIELD_AFTER_S
    p._yield_to_waiting(sched)
    assert (
        sched.tree_cache.unlocked == ["old"]
        and list(p.locks) == ["young"]
        and p.counters
        == {
            "released": 1,
            "yielded": 1,
        }
    )


def test_a_stall_the_estimate_misses_still_yields(monkeypatch):
    p, sched, clock = _stalled_protection(monkeypatch, lambda s: 0)  # the estimate says it fits; nothing runs
    p._yield_to_waiting(sched)  # the stall starts
    for _ in range(4):
        clock[0] += pp.STALL_YIELD_S / 4 - 0.01
        p._yield_to_waiting(sched)
    assert sched.tree_cache.unlocked == []
    clock[0] += 0.1
    p._yield_to_waiting(sched)
    assert sched.tree_cache.unlocked == ["old", "young"] and p.counters.get("yielded_stall") == 2  # every search
    p._yield_to_waiting(sched)
    assert sched.tree_cache.unlocked == ["old", "young"]
    sched.last_batch = None
    sched.running_batch = SimpleNamespace(reqs=[object()])  # something runs: no stall, the timer restarts
    clock[0] += pp.STALL_YIELD_S * 2
    p._yield_to_waiting(sched)
    assert sched.tree_cache.unlocked == ["old", "young"] and p._stalled_since is None


def test_a_speculative_request_at_the_head_takes_no_lock_away(monkeypatch):
    """Yielding a search's locks for a speculative request would trade the primaries' cached prefixes for work
    that may be thrown away (review): only a primary is held out."""
    from sglang_spex.tot.engine import ROLE_SPEC, node_rid

    p, sched, clock = _stalled_protection(monkeypatch, lambda s: 5)
    sched.waiting_queue[0].rid = node_rid("s9", "r.0", ROLE_SPEC)
    p._yield_to_waiting(sched)
    clock[0] += pp.STALL_YIELD_S * 2
    p._yield_to_waiting(sched)
    assert sched.tree_cache.unlocked == [] and not p.counters
