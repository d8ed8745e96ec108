"""Helpers shared by the scheduler-hook tests."""

from __future__ import annotations

import random
import time
from typing import Any, Dict, List, Optional

import requests


def words(n: int, seed: int) -> str:
    rng = random.Random(seed)
    vocab = ["alpha", "beta", "gamma", "delta", "node", "step", "sum", "tree", "leaf", "root", "seven", "nine"]
    return " ".join(rng.choice(vocab) + str(rng.randint(0, 99)) for _ in range(n))


def body(text: str, n: int, rid: Optional[str] = None, role: Optional[str] = None, **extra) -> Dict[str, Any]:
    sp: Dict[str, Any] = {"max_new_tokens": n, "temperature": 0, "ignore_eos": True}
    out: Dict[str, Any] = {"text": text, "sampling_params": sp, **extra}
    if rid:
        out["rid"] = rid
        parts = rid.split(":")
        if role:
            sp["custom_params"] = {"spex_role": role, "spex_search": parts[1], "spex_node": parts[2]}
    return out


def sched(url: str) -> Dict[str, Any]:
    return requests.get(url + "/spex/stats").json()["scheduler"]


def post(url: str, path: str, payload: Dict[str, Any]) -> Dict[str, Any]:
    r = requests.post(url + path, json=payload, timeout=60)
    r.raise_for_status()
    return r.json()


def wait_idle(url: str, timeout: float = 60.0) -> Dict[str, Any]:
    deadline = time.monotonic() + timeout
    while True:
        s = sched(url)
        if s["pool"]["running"] == 0 and s["pool"]["waiting"] == 0 and s["watched_cancels"] == 0:
            return s
        if time.monotonic() > deadline:
            raise TimeoutError(f"server not idle: {s['pool']}")
        time.sleep(0.2)


def wait_running(url: str, n: int, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while sched(url)["pool"]["running"] < n:
        if time.monotonic() > deadline:
            raise TimeoutError(f"fewer than {n} requests running")
        time.sleep(0.05)


def step_seq(url: str) -> int:
    """The batch-stats sequence number of the next scheduler step (a ``since`` for :func:`step_rows`)."""
    return requests.get(url + "/spex/stats", timeout=60).json()["batch"]["seq"]


def step_rows(url: str, since: int) -> List[Dict[str, float]]:
    """The scheduler's batch-stats rows of every step since ``since`` (none lost, none skipped), read page by page
    (an answer holds at most ``batch_stats.HISTORY_PAGE`` rows) up to the ring's ``seq`` at the first read."""
    rows: List[Dict[str, float]] = []
    cursor, end = since, None
    while end is None or cursor < end:
        params = {"history_since": cursor}
        hist = requests.get(url + "/spex/stats", params=params, timeout=60).json()["batch"]["history"]
        assert hist["lost"] == 0
        end = hist["seq"] if end is None else end
        rows += hist["rows"]
        if not hist["rows"]:
            break
        cursor = hist["next"]
    assert [r["step"] for r in rows] == list(range(since, since + len(rows)))  # every step was recorded
    return rows


def wait_spec_step(url: str, since: int, n: int, fill_room: bool = True, timeout: float = 60.0) -> None:
    """Until a step since ``since`` ran ``n`` speculative requests, or (``fill_room``) as many as the gate's room
    allowed: the knee in force may be the live one, below ``n`` on a loaded host. Tests wait on these rows, not on
    "n running", which the prefill allowance and the live knee can keep from ever being seen (CI, more than once)."""

    def done(r: Dict[str, float]) -> bool:
        return r["spec_total"] >= n or (fill_room and 0 < r["spec_room"] <= r["spec_total"])

    deadline = time.monotonic() + timeout
    while not any(done(r) for r in step_rows(url, since)):
        if time.monotonic() > deadline:
            raise TimeoutError(
                f"no step ran {n} speculative requests"
                + (" or filled the gate's room" * fill_room)
                + "; "
                + _gate_trace(url, since)
            )
        time.sleep(0.05)


def _gate_trace(url: str, since: int) -> str:
    """What the scheduler did since ``since`` (a timeout's message): the gate's fields of the last rows, its state
    now and its counters."""
    keys = (
        "step",
        "mode",
        "batch_size",
        "n_spec",
        "spec_total",
        "spec_room",
        "knee",
        "budget",
        "waiting",
        "waiting_spec",
        "spec_held",
        "decode_protected",
        "primary_live",
    )
    rows = step_rows(url, since)
    s = sched(url)
    return (
        f"{len(rows)} steps, last: {[{k: r[k] for k in keys} for r in rows[-6:]]}; pool {s['pool']}; "
        f"budget {s['budget']}, knee {s['knee']}, live knee {s['live_knee']}, gate {s['gate']}; "
        f"counters {s['counters']}"
    )
