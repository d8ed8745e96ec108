"""Reading the cluster's workers: their request logs, loads and KV pool reports."""

from __future__ import annotations

import json
import time
from collections import defaultdict
from typing import Dict, List

import requests

from sglang_spex.scale.cluster import Cluster


def log_events(log_path: str, event: str) -> List[dict]:
    """The ``event`` entries ("request.received" / "request.finished") of one worker's request log."""
    out = []
    for line in open(log_path, errors="replace"):
        if f'"event": "{event}"' not in line:
            continue
        try:
            out.append(json.loads(line[line.index("{") :]))
        except ValueError:
            continue
    return out


def received_by_worker(c: Cluster) -> Dict[str, Dict[str, List[str]]]:
    """search id -> worker url -> the rids of that search the worker received."""
    out: Dict[str, Dict[str, List[str]]] = defaultdict(lambda: defaultdict(list))
    for srv in c.servers:
        for e in log_events(srv.log_path, "request.received"):
            parts = e["rid"].split(":")
            if len(parts) == 4 and parts[0] == "spex":
                out[parts[1]][srv.url].append(e["rid"])
    return out


def finish_reasons(srv_log: str, prefix: str) -> Dict[str, str]:
    """rid -> finish reason type of the finished requests whose rid starts with ``prefix``."""
    out = {}
    for e in log_events(srv_log, "request.finished"):
        if e["rid"].startswith(prefix):
            fr = ((e.get("out") or {}).get("meta_info") or {}).get("finish_reason") or {}
            out[e["rid"]] = fr.get("type") if isinstance(fr, dict) else str(fr)
    return out


def load(url: str) -> int:
    """Requests running or waiting on one worker."""
    x = requests.get(url + "/v1/loads", params={"include": "core"}, timeout=30).json()["loads"][0]
    return x["num_running_reqs"] + x["num_waiting_reqs"]


def pool(url: str) -> dict:
    """The worker scheduler's own KV pool report (``/spex/info``)."""
    return requests.get(url + "/spex/info", timeout=30).json()["scheduler"]["sched"]["pool"]


def idle_pool(url: str, timeout: float = 120) -> dict:
    requests.post(url + "/spex/release", json={}, timeout=30)  # no prefix of a finished search stays protected
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if load(url) == 0:
            return pool(url)
        time.sleep(0.2)
    raise TimeoutError(f"{url} did not go idle")


def _settle(url: str) -> None:
    """One 1-token request: the scheduler runs another step."""
    body = {"text": "settle", "sampling_params": {"max_new_tokens": 1, "temperature": 0}}
    requests.post(url + "/generate", json=body, timeout=120)


def held_tokens(p: dict) -> int:
    """KV tokens neither free nor evictable: held by a request or a protected prefix."""
    return p["kv_total"] - p["kv_available"] - p["kv_evictable"]


def settled_pool(url: str, tries: int = 4) -> dict:
    """The idle pool once it holds no KV, or after ``tries`` looks, with one 1-token request before each look so
    the scheduler runs another step. Right after a worker goes idle its pool has been read one token short, before
    an earlier test's check (CI, once) and after a cancel (once); the next step gave the token back both times. Only
    a shortfall that persists over further steps fails the caller's check."""
    for _ in range(tries):
        _settle(url)
        pool_now = idle_pool(url)
        if held_tokens(pool_now) == 0:
            break
    return pool_now
