"""Soak: many concurrent server-side searches with cancels, disconnects, reward timeouts and malformed requests.

Bounded in time (``--minutes``) and loopback only. One tiny-model server with ``--tot-speculation``; ``--concurrency``
clients (default 64) loop until the deadline, each picking at random:

- a search that runs to its result (REBASE or rSTAR, small);
- a streamed search whose client disconnects after a random delay (the server cancels it);
- a streamed search cancelled with ``DELETE /tot/search/{id}``;
- a search whose callback reward sleeps past ``--tot-reward-timeout`` (its nodes fail by timeout);
- a malformed request (bad JSON, wrong types, over a limit): it must get a 4xx.

Samples the RSS of every server process (the launcher's process tree) every few seconds. At the end, once the
engine is idle and protections are released, compares the KV pool, protected tokens and request slots with the
start. Prints a summary and writes JSON (``--out``). Targets: RSS at the end within 5% of its value after warm-up,
0 leaked KV tokens, the server healthy.

    .venv/bin/python benchmark/bench_soak.py --minutes 10 --concurrency 64
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Dict, List

import httpx
import psutil
from overlap import stop_servers_on_sigterm

from sglang_spex.models import prepare_tiny_llama
from sglang_spex.serve import ServerProcess
from sglang_spex.tot.callback_server import CallbackRewardServer

QUESTION = "What is 12 + 7?"
STEP = {"max_tokens": 8, "stop": ["\n\n"], "temperature": 1.0}
POLICIES = [
    {"name": "rebase", "width": 4, "max_depth": 3},
    {"name": "rstar", "num_rollouts": 3, "max_depth": 3, "branch": 2},
]
MALFORMED: List[bytes] = [
    b"{",
    b"[" * 5000 + b"]" * 5000,
    json.dumps({"question": ""}).encode(),
    json.dumps({"question": QUESTION, "spec": {"policy": {"name": "rebase", "width": 10**30}}}).encode(),
    json.dumps({"question": QUESTION, "spec": {"step": {"max_tokens": "many"}}}).encode(),
    json.dumps({"question": QUESTION, "spec": {"reward": {"type": "callback", "url": "http://10.9.9.9/x"}}}).encode(),
    json.dumps({"question": "x" * (2 << 20)}).encode(),
]
ACTIONS = {"complete": 0.5, "disconnect": 0.12, "delete": 0.12, "reward_timeout": 0.1, "malformed": 0.16}


def rss_by_process(root_pid: int) -> Dict[str, int]:
    """RSS (bytes) of the launcher and every process below it, keyed by ``pid:name``."""
    try:
        root = psutil.Process(root_pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return {}
    out = {}
    for p in procs:
        try:
            out[f"{p.pid}:{p.name()}"] = p.memory_info().rss
        except psutil.NoSuchProcess:
            pass
    return out


async def pool(client: httpx.AsyncClient) -> Dict[str, int]:
    return (await client.get("/spex/stats", timeout=60)).json()["scheduler"]["pool"]


async def wait_idle(client: httpx.AsyncClient, timeout: float = 300) -> Dict[str, int]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        p = await pool(client)
        if p["running"] == 0 and p["waiting"] == 0:
            return p
        await asyncio.sleep(0.5)
    raise TimeoutError("the engine did not go idle")


class Soak:
    def __init__(self, url: str, reward_url: str, seed: int):
        self.url = url
        self.reward_url = reward_url
        self.rng = random.Random(seed)
        self.counts: Dict[str, int] = {}
        self.latency: List[float] = []
        self.errors: List[str] = []

    def count(self, key: str) -> None:
        self.counts[key] = self.counts.get(key, 0) + 1

    def body(self, stream: bool, slow_reward: bool = False) -> Dict[str, Any]:
        policy = dict(self.rng.choice(POLICIES))
        reward = {"type": "callback", "url": self.reward_url} if slow_reward else {"type": "logprob"}
        spec = {"policy": policy, "step": STEP, "reward": reward, "seed": self.rng.randrange(1 << 20)}
        return {"spec": spec, "question": QUESTION, "stream": stream}

    def record(self, status_code: int, result: Dict[str, Any] = None) -> None:
        if status_code == 429:
            self.count("rejected_429")
        elif 400 <= status_code < 500:
            self.count("refused_4xx")
        elif status_code >= 500:
            self.count("server_error_5xx")
            self.errors.append(f"{status_code}")
        elif result is not None:
            self.count(f"search_{result.get('status')}")

    async def one(self, client: httpx.AsyncClient) -> None:
        action = self.rng.choices(list(ACTIONS), weights=list(ACTIONS.values()))[0]
        self.count(f"action_{action}")
        t0 = time.monotonic()
        if action == "malformed":
            raw = self.rng.choice(MALFORMED)
            r = await client.post("/tot/search", content=raw, headers={"Content-Type": "application/json"})
            self.record(r.status_code)
            if not 400 <= r.status_code < 500:
                self.errors.append(f"malformed body answered {r.status_code}")
            return
        if action in ("complete", "reward_timeout"):
            r = await client.post("/tot/search", json=self.body(False, action == "reward_timeout"), timeout=600)
            res = r.json() if r.status_code == 200 else None
            self.record(r.status_code, res)
            if res is not None and res.get("status") == "done":
                self.latency.append(time.monotonic() - t0)
            return
        async with client.stream("POST", "/tot/search", json=self.body(True), timeout=600) as r:
            if r.status_code != 200:
                self.record(r.status_code)
                return
            sid = r.headers["X-Search-Id"]
            delay = self.rng.uniform(0.2, 3.0)
            if action == "delete":
                await asyncio.sleep(delay)
                d = await client.delete(f"/tot/search/{sid}", timeout=120)
                self.count(f"delete_{d.status_code}")
            else:
                try:  # read a little, then go away (the server must cancel the search)
                    await asyncio.wait_for(r.aread(), timeout=delay)
                    self.count("search_finished_before_disconnect")
                except asyncio.TimeoutError:
                    self.count("disconnected")

    async def client_loop(self, deadline: float) -> None:
        async with httpx.AsyncClient(base_url=self.url, timeout=600) as client:
            while time.monotonic() < deadline:
                try:
                    await self.one(client)
                except (httpx.HTTPError, ValueError) as e:
                    self.count("client_error")
                    self.errors.append(repr(e)[:200])


async def sample_rss(root_pid: int, deadline: float, every: float, out: List[Dict[str, Any]]) -> None:
    t0 = time.monotonic()
    while time.monotonic() < deadline:
        out.append({"t": round(time.monotonic() - t0, 1), "rss": rss_by_process(root_pid)})
        await asyncio.sleep(every)


def summarize_rss(samples: List[Dict[str, Any]], warmup_s: float) -> Dict[str, Any]:
    totals = [(s["t"], sum(s["rss"].values())) for s in samples if s["rss"]]
    after_warmup = next((v for t, v in totals if t >= warmup_s), totals[-1][1])
    per_process = {}
    for name in samples[0]["rss"]:
        vals = [s["rss"].get(name) for s in samples if s["rss"].get(name)]
        per_process[name] = {"start": vals[0], "max": max(vals), "end": vals[-1]}
    end = totals[-1][1]
    return {
        "total_start": totals[0][1],
        "total_after_warmup": after_warmup,
        "total_max": max(v for _, v in totals),
        "total_end": end,
        "end_vs_after_warmup": round(end / after_warmup - 1, 4),
        "per_process": per_process,
    }


async def main_async(args: argparse.Namespace) -> Dict[str, Any]:
    server = ServerProcess(
        ["--dtype", "float32", "--model-path", str(prepare_tiny_llama()), "--tot-speculation", "--tot-k-total", "8",
         "--tot-reward-timeout", str(args.reward_timeout), "--tot-max-concurrent-searches", str(args.concurrency)]
    )  # fmt: skip
    slow = None
    try:  # the server starts inside: an error or Ctrl-C anywhere after it still stops it
        server.start()
        slow = CallbackRewardServer(lambda _: 0.5, latency_s=args.reward_timeout * 2)  # slower than the timeout
        async with httpx.AsyncClient(base_url=server.url, timeout=120) as client:
            await client.post("/tot/search", json={"spec": {"policy": POLICIES[0], "step": STEP}, "question": QUESTION})
            start_pool = await wait_idle(client)
            duration = args.minutes * 60
            deadline = time.monotonic() + duration
            soak = Soak(server.url, slow.url, args.seed)
            samples: List[Dict[str, Any]] = []
            t0 = time.monotonic()
            await asyncio.gather(
                sample_rss(server.proc.pid, deadline, args.rss_every, samples),
                *(soak.client_loop(deadline) for _ in range(args.concurrency)),
            )
            wall = time.monotonic() - t0
            samples.append({"t": round(wall, 1), "rss": rss_by_process(server.proc.pid)})
            await wait_idle(client)
            await client.post("/spex/release", json={})  # protections of searches that ended (none should be left)
            end_pool = await wait_idle(client)
            healthy = (await client.get("/health_generate", timeout=120)).status_code == 200
            searches = (await client.get("/tot/searches")).json()
    finally:
        if slow is not None:
            slow.close()
        server.stop()
    lat = sorted(soak.latency)
    leaked = (start_pool["kv_available"] + start_pool["kv_evictable"]) - (
        end_pool["kv_available"] + end_pool["kv_evictable"]
    )
    rss = summarize_rss(samples, warmup_s=max(30.0, 0.1 * duration))
    out = {
        "args": vars(args),
        "wall_s": round(wall, 1),
        "counts": dict(sorted(soak.counts.items())),
        "errors": soak.errors[:20],
        "num_errors": len(soak.errors),
        "latency_s": {
            "n": len(lat),
            "p50": round(statistics.median(lat), 3) if lat else None,
            "p99": round(lat[min(len(lat) - 1, int(0.99 * len(lat)))], 3) if lat else None,
        },
        "pool_start": start_pool,
        "pool_end": end_pool,
        "leaked_kv_tokens": leaked,
        "protected_end": end_pool["kv_protected"],
        "req_slots_leaked": start_pool["req_slots_free"] - end_pool["req_slots_free"],
        "healthy": healthy,
        "searches_kept": len(searches["searches"]),
        "rss": rss,
        "rss_samples": samples,
        "targets": {
            "rss_end_within_5pct_of_after_warmup": abs(rss["end_vs_after_warmup"]) <= 0.05,
            "no_leaked_kv": leaked == 0 and end_pool["kv_protected"] == 0,
            "healthy": healthy,
            "no_5xx": soak.counts.get("server_error_5xx", 0) == 0,
        },
    }
    return out


def main() -> None:
    stop_servers_on_sigterm()  # a `timeout` or kill still stops the server this run started
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--minutes", type=float, default=10.0)
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--reward-timeout", type=float, default=2.0, help="the server's --tot-reward-timeout")
    ap.add_argument("--rss-every", type=float, default=5.0, help="seconds between RSS samples")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="benchmark/results/bench_soak.json")
    args = ap.parse_args()
    out = asyncio.run(main_async(args))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1))
    mb = 1 << 20
    r = out["rss"]
    print(f"soak {out['wall_s']} s, {args.concurrency} clients: {json.dumps(out['counts'])}")
    print(f"latency of completed searches: {out['latency_s']}")
    print(
        f"server RSS (all processes) MiB: start {r['total_start'] / mb:.0f}, after warm-up "
        f"{r['total_after_warmup'] / mb:.0f}, max {r['total_max'] / mb:.0f}, end {r['total_end'] / mb:.0f} "
        f"({100 * r['end_vs_after_warmup']:+.1f}%)"
    )
    print(
        f"leaked KV tokens {out['leaked_kv_tokens']}, protected at end {out['protected_end']}, "
        f"request slots leaked {out['req_slots_leaked']}, healthy {out['healthy']}, errors {out['num_errors']}"
    )
    print("targets:", out["targets"], "->", args.out)
    sys.exit(0 if all(out["targets"].values()) else 1)


if __name__ == "__main__":
    main()
