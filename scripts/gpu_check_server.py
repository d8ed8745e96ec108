"""HTTP helpers of the GPU check's stages (``scripts/gpu_check.py``) against a running server: generate and time
requests, post together, cancel, wait idle, flush the cache, settle the roofline profiler, health and tree reads."""

from __future__ import annotations

import asyncio
import statistics
import time
from typing import Any, Dict, List, Sequence

import httpx

from sglang_spex.respec.profiler import flush


def _generate(url: str, texts: List[str], n: int) -> List[dict]:
    body = {"text": texts, "sampling_params": {"temperature": 0, "max_new_tokens": n, "ignore_eos": True}}
    r = httpx.post(url + "/generate", json=body, timeout=600)
    r.raise_for_status()
    return r.json()


def _timed_generate(url: str, texts: List[str], n: int) -> float:
    t0 = time.perf_counter()
    _generate(url, texts, n)
    return time.perf_counter() - t0


async def _post_all(url: str, bodies: List[dict], timeout: float) -> List[dict]:
    """``bodies`` posted together to ``url``; each answer's JSON (a non-200 as ``{"status": "HTTP n", ...}``)."""
    rs = await _post_each(url, [("", b) for b in bodies], timeout)
    return [
        r.json() if r.status_code == 200 else {"status": f"HTTP {r.status_code}", "error": r.text[:200]} for r in rs
    ]


async def _post_each(url: str, posts: List[tuple], timeout: float) -> List[httpx.Response]:
    """``(path, body)`` posts sent together; their responses in order."""
    async with httpx.AsyncClient(timeout=timeout) as client:
        return await asyncio.gather(*(client.post(url + path, json=body) for path, body in posts))


async def _start_and_cancel(url: str, body: dict) -> float:
    """Start a long search, DELETE it once it has requests in flight; the DELETE's latency in seconds."""
    sid = body["search_id"]
    async with httpx.AsyncClient(timeout=120) as client:
        task = asyncio.create_task(client.post(url + "/tot/search", json=body))
        for _ in range(600):
            r = await client.get(f"{url}/tot/search/{sid}")
            st = r.json() if r.status_code == 200 else {}
            if st.get("status") == "running" and st.get("inflight", 0) > 0 and st.get("num_requests", 0) >= 4:
                break
            await asyncio.sleep(0.1)
        else:
            raise RuntimeError(f"search never ran: {st}")
        t0 = time.perf_counter()
        r = await client.delete(f"{url}/tot/search/{sid}")
        latency = time.perf_counter() - t0
        res = await task
        if r.status_code != 200 or res.json().get("status") != "cancelled":
            raise RuntimeError(f"cancel: HTTP {r.status_code}, search {res.json().get('status')}")
    return latency


def _wait_idle(url: str, timeout: float = 30.0) -> Dict[str, Any]:
    deadline = time.monotonic() + timeout
    while True:
        s = httpx.get(url + "/spex/stats", timeout=30).json()["scheduler"]
        if s["pool"]["running"] == 0 and s["pool"]["waiting"] == 0 and s.get("watched_cancels", 0) == 0:
            return s
        if time.monotonic() > deadline:
            raise RuntimeError(f"server not idle: {s['pool']}")
        time.sleep(0.2)


def _flush_cache(url: str, wait_s: float = 60.0) -> float:
    """Empty the radix cache before a run (:func:`sglang_spex.respec.profiler.flush`: retried while requests are in
    flight, RuntimeError after ``wait_s``); the seconds waited."""
    return flush(url, wait_s=wait_s, poll_s=0.5)


def _profile_status(url: str) -> Dict[str, Any]:
    """The roofline profiler's state (``/spex/stats`` → ``profile``: measuring, reprofile_due, reprofiles,
    k_total, measured_under_load)."""
    return httpx.get(url + "/spex/stats", timeout=60).json().get("profile") or {}


def _settle_profiler(url: str, wait_s: float) -> Dict[str, Any]:
    """Before a timed run: wait (at most ``wait_s``) until the server holds a roofline profile measured on an idle
    engine, with no sweep running and none due. Under ``--tot-k-total auto`` the server's start-up thread measures
    the roofline only after ``/health_generate`` answers (so right after start-up ``measuring`` can still be false
    with no profile yet), and a profile measured under load is re-measured in the next idle gap: either sweep fills
    the batch and would share the engine with the timed runs. ``POST /spex/profile`` waits for a sweep in progress
    or measures now (forced only to replace a profile measured under load or due again). Returns the status, the
    seconds waited and ``settled`` (False when ``wait_s`` ran out first)."""
    t0 = time.monotonic()
    st = _profile_status(url)
    for _ in range(3):
        quiet = not st.get("measuring") and not st.get("reprofile_due") and not st.get("measured_under_load")
        if st.get("k_total") is not None and quiet:
            break
        left = wait_s - (time.monotonic() - t0)
        if left < 1:
            break
        force = st.get("k_total") is not None and not st.get("measuring")
        try:
            httpx.post(url + "/spex/profile", json={"force": force}, timeout=left).raise_for_status()
        except httpx.TimeoutException:
            pass
        st = _profile_status(url)
    quiet = not st.get("measuring") and not st.get("reprofile_due") and not st.get("measured_under_load")
    settled = st.get("k_total") is not None and quiet
    return {**st, "settled": settled, "wait_s": round(time.monotonic() - t0, 1)}


def _profiler_ran(before: Dict[str, Any], after: Dict[str, Any]) -> bool:
    """Whether a roofline sweep ran during a timed run: one still running at its end, a re-profile counted, or a
    changed k_total."""
    changed = any(before.get(k) != after.get(k) for k in ("reprofiles", "k_total"))
    return bool(before.get("measuring") or after.get("measuring") or changed)


def _profile_note(prof: Dict[str, Any], ran: int) -> str:
    note = f"profiler settled in {prof['wait_s']:.0f} s (k_total {prof.get('k_total')})"
    if not prof["settled"]:
        note = f"profiler NOT settled after {prof['wait_s']:.0f} s ({_brief(prof)}): timings shared the engine"
    return note + (f", then ran during {ran} timed run(s)" if ran else ", quiet in the timed runs")


def _brief(st: Dict[str, Any]) -> str:
    keys = ("measuring", "reprofile_due", "measured_under_load", "k_total")
    return ", ".join(f"{k} {st.get(k)}" for k in keys)


def _ratio_spread(xs: Sequence[float]) -> str:
    """``median x (min-max)`` of ratios."""
    return f"{statistics.median(xs):.2f}x ({min(xs):.2f}-{max(xs):.2f})"


def _healthy(url: str) -> bool:
    try:
        return httpx.get(url + "/health_generate", timeout=10).status_code == 200
    except httpx.HTTPError:
        return False


def _tree(res: dict) -> list:
    return sorted((n["path"], n["text"]) for n in res.get("nodes", []))
