"""Helpers shared by the scheduler-hook tests."""

from __future__ import annotations

import random
import time
from typing import Any, Dict, Optional

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
