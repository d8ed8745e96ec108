"""The real half of the calibration (``bench_calibration.py``): measured pairs of runs on a live SGLang server.

Each *pair* (one policy × concurrency: baseline and SPEX) is measured as close together as possible:

1. the load: ``os.getloadavg()`` and the CPU other processes used (``/proc/stat`` minus this process and the
   server's process tree), so a reader can see whether the machine was quiet;
2. a fresh ``cpu-measured`` profile right before the pair: the server's own (``POST /spex/profile``, client
   wall-time differences) and, used by the simulator, one from the scheduler's per-step times (stats ring), which
   a busy host disturbs less (:func:`engine_probe`);
3. the per-request latency outside the engine, from the scheduler's per-step stats ring (``GET /spex/stats``):
   for sequential requests on an idle engine, ``request_s`` = first scheduled step − send time and
   ``response_s`` = receive time − end of the last step (client and server share the host clock);
4. the two runs, in alternating order (baseline first in even pairs), each with: wall time, the client
   process's CPU time per engine request (``cpu_s`` of :class:`~sglang_spex.sim.client.ClientOverhead`), and
   the engine's busy time split into decode / prefill steps, its idle time and its mean decode batch.
"""

from __future__ import annotations

import asyncio
import os
import random
import statistics
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple

import bench_tot
import numpy as np
import psutil
import requests
from sched_trace import stats_history

from sglang_spex.profile.cache import Profile
from sglang_spex.tot.engine import GenRequest, GenResult
from sglang_spex.tot.http_port import HttpPort
from sglang_spex.tot.search import SearchResult
from sglang_spex.tot.search_spec import SearchSpec

MODES = {"baseline": None, "spex_sched": dict(components=("t1", "t2"), early_stop=False)}
DECODE, PREFILL = 2, 1  # batch_stats modes
_PROBE_WORDS = "alpha beta gamma delta omega sigma kappa lambda theta zeta one two three plus equals so".split()


class CountingPort(HttpPort):
    """HttpPort that counts the requests it sends (primary and speculative)."""

    def __init__(self, base_url: str):
        super().__init__(base_url)
        self.requests = 0

    async def generate(self, req: GenRequest) -> GenResult:
        self.requests += 1
        return await super().generate(req)


def measure_profile(url: str, repeats: int = 2) -> Profile:
    """A fresh profile from the server (``POST /spex/profile``, forced)."""
    body = {"force": True, "batch_sizes": [1, 2, 4, 8, 16, 32], "repeats": repeats}
    r = requests.post(url + "/spex/profile", json=body, timeout=900)
    r.raise_for_status()
    d = r.json()
    d.pop("summary", None)
    return Profile.from_dict(d)


def engine_probe(
    url: str,
    server_profile: Profile,
    prompt_words: int = 60,
    new_tokens: int = 24,
    batch_sizes: Tuple[int, ...] = (1, 2, 4, 8, 12, 16, 24, 32),
) -> Profile:
    """The ``cpu-measured`` profile from the scheduler's own step times (stats ring) instead of client wall-time
    differences: for each batch size B, B fresh prompts of ~``prompt_words`` words in one ``/generate`` call
    (``ignore_eos``); decode step time at B = the median ``step_s`` of its decode steps, and a least-squares fit of
    total prefill seconds = overhead · passes + prompt tokens / rate gives the prefill cost. The context slope
    comes from ``server_profile`` (the probe's context is already search-like, so it only corrects deviations)."""
    times, ptoks, prefill = [], [], []
    for b in batch_sizes:
        nonce = uuid.uuid4().hex[:8]
        rng = random.Random(nonce)
        texts = [f"{nonce} {i}: " + " ".join(rng.choice(_PROBE_WORDS) for _ in range(prompt_words)) for i in range(b)]
        sp = {"max_new_tokens": new_tokens, "temperature": 0.8, "ignore_eos": True}
        seq0 = stats_seq(url)
        r = requests.post(url + "/generate", json={"text": texts, "sampling_params": sp}, timeout=300)
        r.raise_for_status()
        n_prompt = sum(int(o["meta_info"]["prompt_tokens"]) for o in r.json())
        time.sleep(0.05)
        rows = stats_rows(url, seq0)
        steps = [x["step_s"] for x in rows if x["mode"] == DECODE and x["batch_size"] == b and x["step_s"] is not None]
        if not steps:
            raise RuntimeError(f"engine probe: no decode steps at batch {b}")
        times.append(statistics.median(steps))
        ptoks.append(n_prompt / b)
        passes = [x["step_s"] for x in rows if x["mode"] == PREFILL]
        if passes and None not in passes:  # the B prompts may arrive in several prefill passes
            prefill.append((len(passes), n_prompt, sum(passes)))
    kw: Dict[str, Any] = {"ctx_coef": server_profile.ctx_coef}
    if len(prefill) >= 3:  # total prefill seconds = overhead · passes + tokens / rate, least squares
        a = np.array([[n, tok] for n, tok, _ in prefill], dtype=float)
        (overhead, per_token), *_ = np.linalg.lstsq(a, np.array([t for *_, t in prefill]), rcond=None)
        if per_token > 0:
            kw.update(prefill_tok_s=1.0 / per_token, prefill_overhead_s=max(float(overhead), 0.0))
    if "prefill_tok_s" not in kw:
        kw.update(prefill_tok_s=server_profile.prefill_tok_s, prefill_overhead_s=server_profile.prefill_overhead_s)
    ctx = statistics.mean(ptoks) + new_tokens / 2
    meta = {"method": "stats-ring engine probe", "prefill_passes": prefill, "prompt_tokens": ptoks}
    return Profile.from_points(server_profile.key, batch_sizes, times, int(round(ctx)), meta=meta, **kw)


def stats_seq(url: str) -> int:
    return int(requests.get(url + "/spex/stats", timeout=30).json()["batch"]["seq"])


def stats_rows(url: str, since: int) -> List[Dict[str, Any]]:
    """The batch-stats rows of the steps that ran a batch since ``since`` (read page by page; idle rows left out)."""
    hist = stats_history(url, since)["batch"]["history"]
    if hist["lost"]:
        raise RuntimeError(f"stats ring overran by {hist['lost']} rows: the run is too long for it")
    return [r for r in hist["rows"] if r["batch_size"]]


def engine_summary(rows: List[Dict[str, Any]], wall: float, profile: Optional[Profile] = None) -> Dict[str, Any]:
    """Busy time by step kind, idle time and mean decode batch from stats rows. A step followed by idle has no
    recorded duration (``step_s`` None); it is charged the median duration of its kind. With ``profile``:
    ``decode_vs_profile`` = the decode steps' seconds over what the profile predicts for their batch sizes
    (above 1: the engine ran slower during the run than when it was profiled)."""
    out: Dict[str, Any] = {}
    busy = 0.0
    for name, mode in (("decode", DECODE), ("prefill", PREFILL)):
        sel = [r for r in rows if r["mode"] == mode]
        known = [r["step_s"] for r in sel if r["step_s"] is not None]
        med = statistics.median(known) if known else 0.0
        t = sum(known) + med * (len(sel) - len(known))
        out[f"{name}_s"], out[f"{name}_steps"] = round(t, 3), len(sel)
        busy += t
    dec = [r for r in rows if r["mode"] == DECODE]
    out["mean_decode_batch"] = round(statistics.mean(r["batch_size"] for r in dec), 2) if dec else 0.0
    out["busy_s"] = round(busy, 3)
    out["idle_s"] = round(max(wall - busy, 0.0), 3)
    out["idle_periods"] = sum(1 for r in rows if r["step_s"] is None)
    timed = [r for r in dec if r["step_s"] is not None]
    if profile is not None and timed:
        predicted = sum(profile.predict(int(r["batch_size"])) for r in timed)
        out["decode_vs_profile"] = round(sum(r["step_s"] for r in timed) / predicted, 3)
    return out


class CpuMeter:
    """CPU used on the host during a window, split into ours (client + server tree) and everyone else's."""

    def __init__(self, server_pid: Optional[int] = None):
        self.server_pid = server_pid

    def _ours(self) -> float:
        procs = [psutil.Process()]
        if self.server_pid is not None:
            try:
                root = psutil.Process(self.server_pid)
                procs += [root, *root.children(recursive=True)]
            except psutil.NoSuchProcess:
                pass
        total = 0.0
        for p in procs:
            try:
                t = p.cpu_times()
                total += t.user + t.system
            except psutil.NoSuchProcess:
                pass
        return total

    @staticmethod
    def _busy() -> float:
        t = psutil.cpu_times()
        return sum(t) - t.idle - getattr(t, "iowait", 0.0)

    def start(self) -> None:
        self.t0, self.busy0, self.ours0 = time.monotonic(), self._busy(), self._ours()

    def stop(self) -> Dict[str, float]:
        wall = max(time.monotonic() - self.t0, 1e-9)
        busy, ours = self._busy() - self.busy0, self._ours() - self.ours0
        return {
            "host_cores_busy": round(busy / wall, 2),
            "our_cores_busy": round(ours / wall, 2),
            "other_cores_busy": round(max(busy - ours, 0.0) / wall, 2),
        }


def load_average() -> List[float]:
    return [round(x, 2) for x in os.getloadavg()]


def measure_latency(url: str, prompt: str, n: int = 8, new_tokens: int = 8) -> Dict[str, Any]:
    """Per-request latency outside the engine, from sequential requests on an idle engine (module docstring)."""
    req_s, resp_s, prompt_tokens = [], [], []
    for i in range(n):
        seq0 = stats_seq(url)
        body = {"text": f"{prompt} {i}", "sampling_params": {"max_new_tokens": new_tokens, "temperature": 0.0}}
        t_send = time.time()
        r = requests.post(url + "/generate", json=body, timeout=120)
        t_recv = time.time()
        r.raise_for_status()
        prompt_tokens.append(int(r.json().get("meta_info", {}).get("prompt_tokens", 0)))
        time.sleep(0.05)  # let the scheduler publish its idle step
        rows = [r for r in stats_rows(url, seq0) if r["mode"] in (DECODE, PREFILL)]
        if not rows:
            continue
        known = [r["step_s"] for r in rows if r["step_s"] is not None]
        last = rows[-1]["step_s"] if rows[-1]["step_s"] is not None else (statistics.median(known) if known else 0)
        req_s.append(rows[0]["time"] - t_send)
        resp_s.append(t_recv - (rows[-1]["time"] + last))
    if not req_s:
        raise RuntimeError("no stats rows for the latency probe: is the server running with --tot-speculation?")
    return {
        "request_s": round(max(statistics.median(req_s), 0.0), 4),
        "response_s": round(max(statistics.median(resp_s), 0.0), 4),
        "request_s_all": [round(x, 4) for x in req_s],
        "response_s_all": [round(x, 4) for x in resp_s],
        "prompt_tokens": int(statistics.median(prompt_tokens)),  # the search's question prompt, tokenized
    }


@dataclass
class RealRun:
    """One measured run: its results (trees) and what was measured around it."""

    results: List[SearchResult]
    wall_s: float
    client_cpu_s: float
    requests: int
    engine: Dict[str, Any]
    cpu: Dict[str, float]
    load: List[float]
    extra: Dict[str, Any] = field(default_factory=dict)

    @property
    def q_per_min(self) -> float:
        return 60.0 * len(self.results) / self.wall_s

    @property
    def cpu_s_per_request(self) -> float:
        return self.client_cpu_s / max(self.requests, 1)

    def to_dict(self) -> Dict[str, Any]:
        return {
            "wall_s": round(self.wall_s, 3),
            "q_per_min": round(self.q_per_min, 3),
            "client_cpu_s": round(self.client_cpu_s, 3),
            "requests": self.requests,
            "client_cpu_s_per_request": round(self.cpu_s_per_request, 5),
            "engine": self.engine,
            "cpu": self.cpu,
            "load_before": self.load,
            **self.extra,
        }


def run_measured(
    url: str,
    spec: SearchSpec,
    questions,
    concurrency: int,
    mode: Optional[dict],
    k_total: int,
    server_pid: Optional[int] = None,
    profile: Optional[Profile] = None,
) -> RealRun:
    """One real batch (``bench_tot.run_real``: radix cache flushed first) with the meters around it."""
    load = load_average()
    port = CountingPort(url)
    seq0 = stats_seq(url)
    meter = CpuMeter(server_pid)
    meter.start()
    c0 = time.process_time()
    results, wall = asyncio.run(bench_tot.run_real(url, spec, questions, concurrency, mode, k_total, port=port))
    client_cpu = time.process_time() - c0
    cpu = meter.stop()
    time.sleep(0.05)
    engine = engine_summary(stats_rows(url, seq0), wall, profile)
    return RealRun(results, wall, client_cpu, port.requests, engine, cpu, load)


def measure_pair(
    url: str,
    spec: SearchSpec,
    questions,
    concurrency: int,
    k_total: int,
    pair_index: int,
    profile_repeats: int = 2,
    server_pid: Optional[int] = None,
) -> Tuple[Profile, Dict[str, Any], Dict[str, RealRun]]:
    """Profiles (the server's and the stats-ring probe's, which keeps the server's under ``meta``), latency probe,
    then baseline and SPEX in alternating order (baseline first in even pairs)."""
    load = load_average()
    server_profile = measure_profile(url, profile_repeats)
    profile = engine_probe(url, server_profile)
    profile.meta["server_profile"] = server_profile.to_dict()
    latency = measure_latency(url, bench_tot.PROMPT.format(question=questions[0].text))
    latency["load_before_pair"] = load
    order = list(MODES) if pair_index % 2 == 0 else list(reversed(MODES))
    runs = {}
    for i, mode in enumerate(order):
        run = run_measured(url, spec, questions, concurrency, MODES[mode], k_total, server_pid, profile)
        run.extra["position_in_pair"] = i
        runs[mode] = run
    return profile, latency, runs
