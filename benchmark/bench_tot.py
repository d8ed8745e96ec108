"""Baseline vs SPEX on the real CPU SGLang server (SmolLM2-135M), side by side in one run.

By default every search runs **server-side** (``POST /tot/search``, the product path: the search loop and SPEX
run inside the server next to the engine); ``--client-side`` drives the same searches over HTTP (``HttpPort``).

One server is started, with ``--tot-speculation``. The baseline is the same server with the per-search override
``"speculation": {"enabled": false}``: such a search runs the plain ``SearchContext`` path (no speculative
request is ever issued, nothing is ranked differently: all of its requests have the same priority), so it
is the baseline search on identical server flags, and modes can be interleaved without a second server
(the machine allows one) and without restarts between them.

For each repeat, each (policy, concurrency) cell runs every mode back to back (the order alternates between
repeats), the radix cache flushed before each run. Reported per cell: median q/min of each mode, the median and
min–max of the per-repeat SPEX/baseline q/min ratio, the same ratio of the runs' *priced schedules*
(``priced x``: every scheduler step at one step price fitted over all runs, :mod:`step_cost`; it moves only with
what was scheduled, not with the host's noise), hits/issued, wasted tokens, per-query p50/p99 completion
time. T3 (early stop, changes the search) is off unless ``--t3``, and then reported as its own mode.
Only searches that ended ``done`` count as finished queries (``/tot/search`` answers 200 for a failed one too);
each cell reports its failed searches and its *flagged* runs (a search not done, a failed node, a cache left
unflushed, batch-stats rows lost, the roofline profiler running during the run, k_total differing between runs),
and flagged runs are left out of the ratios for both modes of their repeat (:func:`tot_report.summarise`).
``--gate-mode`` adds SPEX with the pay-off gate on (``spex_gate``; speculation/payoff.py), interleaved too;
``--variant NAME=JSON`` adds SPEX with more per-search settings (server-side), e.g. ``bfs2='{"bfs_lookahead": 2}'``;
``--knob-variant NAME=JSON`` adds SPEX run with these scheduler knobs (``POST /spex/knobs``, e.g.
``share0='{"spec_prefill_share": 0}'``), the server's own values restored for every other mode.
``--reward-latency-ms MS`` (with ``--reward verifier:NAME``) scores through an emulated external PRM
(:mod:`reward_service`): the verifier's score after MS ms, so each depth waits for its rewards (the reward barrier)
while the engine's steps stay the same.

The server runs in float32 by default (``--dtype``): SGLang's CPU logits are then independent of the batch's
shape, so with T3 off SPEX and the baseline grow the *same tree* (seeded nodes, same tokens) and the ratio is pure
scheduling; every cell reports whether that held (``same tree``). In bfloat16 (the users' dtype) a node's tokens
depend on what it was batched with, so two runs of one mode already grow different trees (±10% tokens at 8
queries) and a ratio mixes scheduling with tree luck.

    .venv/bin/python benchmark/bench_tot.py --task rg:chain_sum --policies rebase-8,rebase-16,rstar-10 \
        --concurrency 1,2,4 --max-depth 4 --step-tokens 48 --repeats 3
    .venv/bin/python benchmark/bench_tot.py --quick      # smoke test (about a minute)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import time
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

import httpx
import requests
from reward_service import delayed_verifier
from sched_trace import cpu_delta, cpu_seconds, scheduler_trace, spex_stats
from step_cost import StepPrice
from tot_report import print_table, print_time_split, step_price, summarise
from tqdm import tqdm

from sglang_spex.config import SpexConfig
from sglang_spex.respec.profiler import flush
from sglang_spex.serve import ServerProcess
from sglang_spex.speculation.runner import SpecBudget, context_factory
from sglang_spex.srt.control import KNOBS
from sglang_spex.tot.http_port import HttpPort
from sglang_spex.tot.policies import PRESETS
from sglang_spex.tot.result import SearchResult
from sglang_spex.tot.rewards import reward_section
from sglang_spex.tot.search import run_batch
from sglang_spex.tot.search_spec import SearchSpec
from sglang_spex.tot.tasks import get_task
from sglang_spex.tot.tree import DONE

PROMPT = (
    "<|im_start|>system\nSolve the problem step by step, one short step per paragraph. "
    "Finish with 'The answer is N.'<|im_end|>\n<|im_start|>user\n{question}<|im_end|>\n<|im_start|>assistant\n"
)
# Client-side SPEX settings per mode (None: baseline); bench_fig10 / calib_real reuse these.
MODES = {
    "baseline": None,
    "spex_t1t2": dict(components=("t1", "t2"), early_stop=False),
    "spex_t1t2t3": dict(components=("t1", "t2", "t3"), early_stop=True),
    "spex_gate": dict(components=("t1", "t2"), early_stop=False, payoff_gate=True),
}
# Server-side: the per-search ``speculation`` override of each mode.
OVERRIDES = {
    "baseline": {"enabled": False},
    "spex_t1t2": {"enabled": True, "components": ["t1", "t2"], "early_stop": False},
    "spex_t1t2t3": {"enabled": True, "components": ["t1", "t2", "t3"], "early_stop": True},
    "spex_gate": {"enabled": True, "components": ["t1", "t2"], "early_stop": False, "payoff_gate": True},
}
QUICK = dict(policies="rebase-8", concurrency="1", questions=1, max_depth=2, step_tokens=8, repeats=1)
DEFAULTS = dict(
    policies="rebase-8,rebase-16,rstar-10", concurrency="1,2,4", questions=4, max_depth=4, step_tokens=48, repeats=3
)
SEARCH_TIMEOUT_S = 1800.0
OUT = "benchmark/results/bench_tot.json"


def build_spec(
    preset: str,
    max_depth: int,
    step_tokens: int,
    seed: int,
    task: str = "toy_add",
    speculation: Optional[dict] = None,
    reward: Union[str, Dict[str, Any]] = "logprob",
    stop: Sequence[str] = ("\n\n",),
) -> SearchSpec:
    name, knobs = PRESETS[preset]
    policy = {"name": name, **knobs, "max_depth": max_depth}
    if name == "rest":
        policy.update(iterations=3 * knobs.get("target_answers", 5))
    if name == "ets":
        policy.setdefault("embedder", "tfidf")
    d: Dict[str, Any] = {
        "policy": policy,
        "step": {
            "max_tokens": step_tokens,
            "stop": list(stop),
            "temperature": 0.8,
            "prompt_template": PROMPT,
            "max_total_tokens": max_depth * step_tokens,
        },
        "reward": reward if isinstance(reward, dict) else reward_section(reward),
        "answer": {"aggregate": "weighted"},
        "task": task,
        "seed": seed,
    }
    if speculation is not None:
        d["speculation"] = speculation
    return SearchSpec.from_dict(d)


def flush_cache(url: str, wait_s: float = 120.0) -> float:
    """Empty SGLang's radix cache so no run reuses the prefixes an earlier run (same seeds) computed; returns the
    seconds it had to wait (:func:`sglang_spex.respec.profiler.flush`). SGLang refuses while requests are still
    queued or running (an aborted speculative request may linger); after ``wait_s`` the run goes on unflushed, with a
    warning (inf: the row records it)."""
    try:
        return flush(url, wait_s=wait_s, poll_s=0.5)
    except RuntimeError as e:
        print(f"warning: {e}; running unflushed")
        return float("inf")


# ---------------------------------------------------------------- client-side (HttpPort)
async def run_real(
    url: str,
    spec: SearchSpec,
    questions,
    concurrency: int,
    mode: Optional[dict],
    k_total: int,
    port: Optional[HttpPort] = None,
):
    """One measured client-side batch (radix cache flushed first): (results, wall seconds). ``port``: an
    HttpPort to ``url`` to use (closed afterwards) instead of a fresh one."""
    flush_cache(url)
    port = port or HttpPort(url)
    kw: Dict[str, Any] = {}
    if mode is not None:
        cfg = SpexConfig(enabled=True, k_total=k_total, **mode)
        kw["context_factory"] = context_factory(cfg, SpecBudget(k_total, cfg.budget_temperature, cfg.min_share))
    t0 = time.monotonic()
    try:
        results = await run_batch(
            spec,
            [q.text for q in questions],
            port,
            concurrency=concurrency,
            references=[q.reference for q in questions],
            **kw,
        )
    finally:
        await port.close()
    return results, time.monotonic() - t0


# ---------------------------------------------------------------- server-side (POST /tot/search)
async def run_server_side(
    url: str, spec: SearchSpec, questions, concurrency: int
) -> Tuple[List[SearchResult], List[float], float]:
    """One measured server-side batch: (results, per-query seconds, wall seconds). The caller flushes the radix
    cache first (:func:`measure`: then reads the stats ring's start, so nothing before the flush is charged to the
    run). ``POST /tot/search`` answers 200 for a search that ended ``failed`` too: read each result's ``status``."""
    body_spec = spec.to_dict()
    sem = asyncio.Semaphore(concurrency)
    latencies: List[float] = [0.0] * len(questions)
    async with httpx.AsyncClient(base_url=url, timeout=SEARCH_TIMEOUT_S) as client:

        async def one(i: int) -> SearchResult:
            async with sem:
                q = questions[i]
                t = time.monotonic()
                r = await client.post(
                    "/tot/search", json={"spec": body_spec, "question": q.text, "reference": q.reference}
                )
                latencies[i] = time.monotonic() - t
            r.raise_for_status()
            return SearchResult.from_dict(r.json())

        t0 = time.monotonic()
        results = list(await asyncio.gather(*(one(i) for i in range(len(questions)))))
    return results, latencies, time.monotonic() - t0


def critical_path(result: SearchResult) -> int:
    """Tokens on the search's longest root-to-node chain: the decode steps it needs even if every node started
    the moment its parent finished (speculation's best case)."""
    return max((n["cum_tokens"] for n in result.nodes if n["status"] == DONE), default=0)


def critical_path_steps(result: SearchResult) -> int:
    """Decode steps on the search's longest root-to-node chain: each node's first token comes from its prefill
    step, so a node of ``t`` tokens needs ``t - 1`` decode steps after it, Σ (tokens − 1) along the chain. This is
    what the trace's steps that decode count (:func:`tot_report.decode_steps`), so the bound and the measured
    steps count the same thing. Nodes without ``tokens``/``parent`` (older results): ``cum_tokens - depth``."""
    by_path = {n.get("path"): n for n in result.nodes}

    def steps(n: Dict[str, Any]) -> int:
        if "tokens" not in n or "parent" not in n:
            return max(n["cum_tokens"] - n.get("depth", 0), 0)
        total, seen = 0, set()
        while n is not None and n.get("path") not in seen:
            seen.add(n.get("path"))
            total += max(int(n.get("tokens") or 0) - 1, 0)
            n = by_path.get(n["parent"]) if n.get("parent") is not None else None
        return total

    return max((steps(n) for n in result.nodes if n["status"] == DONE), default=0)


RATES = ("hit_rate",)  # per-search ratios in a search's accounting: recomputed over the run, never summed
LAST = ("min_use", "step_line")  # the pay-off gate's state: the last search's, never summed


def _summary(
    results: Sequence[SearchResult], latencies: Sequence[float], wall: float, flush_wait_s: float = 0.0
) -> Dict[str, Any]:
    acc: Dict[str, Any] = {}
    for r in results:
        for key, value in (r.speculation or {}).items():
            if key in LAST:
                acc[key] = value
            elif isinstance(value, (int, float)) and not isinstance(value, bool) and key not in RATES:
                acc[key] = acc.get(key, 0) + value
    done = [r for r in results if r.status == DONE]
    if acc:
        acc["early_stops"] = sum(bool((r.speculation or {}).get("early_stopped")) for r in results)
        acc["hit_rate"] = round(acc["hits"] / acc["issued"], 4) if acc.get("issued") else 0.0
    return {
        "wall_s": round(wall, 2),
        "q_per_min": round(len(done) / wall * 60, 3),  # finished queries only: a failed search ends early
        "searches": len(results),
        "failed_searches": len(results) - len(done),  # status other than done (cancelled, failed)
        "node_failures": sum(len(r.failures or ()) for r in results),
        "accuracy": sum(bool(r.correct) for r in results) / len(results),
        "tokens": sum(r.tokens_generated for r in results),
        "requests": sum(r.num_requests for r in results),
        "answers": [r.answer for r in results],
        "statuses": sorted({r.status for r in results}),
        "latencies_s": [round(x, 3) for x in latencies],
        "critical_path_tokens": [critical_path(r) for r in results],
        "critical_path_steps": [critical_path_steps(r) for r in results],
        "flush_wait_s": round(flush_wait_s, 2) if flush_wait_s != float("inf") else "unflushed",
        "speculation": acc or None,
    }


async def run_mode(url: str, spec: SearchSpec, questions, concurrency: int, mode: Optional[dict], k_total: int):
    """One client-side run of one mode (kept for bench_fig10 / calib_real)."""
    results, wall = await run_real(url, spec, questions, concurrency, mode, k_total)
    return _summary(results, [r.wall_time for r in results], wall)


def measure(args, url: str, policy: str, conc: int, mode: str, questions, seed: int) -> Dict[str, Any]:
    """One run of (policy, concurrency, mode) on the chosen path."""
    if args.client_side:
        spec = build_spec(policy, args.max_depth, args.step_tokens, seed, args.task, reward=args.reward, stop=args.stop)
        return asyncio.run(run_mode(url, spec, questions, conc, MODES[mode], args.k_total_client))
    spec = build_spec(
        policy,
        args.max_depth,
        args.step_tokens,
        seed,
        args.task,
        speculation=args.overrides[mode],
        reward=args.reward,
        stop=args.stop,
    )
    profile_wait_s, flushed, before = _quiet_start(url)
    cpu0 = cpu_seconds(args.server_pid)
    _set_knobs(args, url, before["scheduler"]["knobs"], mode)
    results, latencies, wall = asyncio.run(run_server_side(url, spec, questions, conc))
    row = _summary(results, latencies, wall, flushed)
    row["trace"] = {**scheduler_trace(url, before), "cpu_s": cpu_delta(cpu0, cpu_seconds(args.server_pid))}
    p0, p1 = before.get("profile") or {}, spex_stats(url).get("profile") or {}
    row["profile_wait_s"], row["k_total"] = round(profile_wait_s, 2), p1.get("k_total")
    row["reprofiled"] = profiled_during(p0, p1)
    return row


def _quiet_start(url: str, tries: int = 3) -> Tuple[float, float, Dict[str, Any]]:
    """Wait for the profiler, flush the radix cache, then read the stats ring's start (so a previous run's
    lingering requests, which the flush waits for, are not charged to this run); again while a profile sweep
    started in the meantime. Returns (seconds waited for the profiler, seconds the flush waited or inf, the
    ``/spex/stats`` answer the run's trace starts at)."""
    waited = 0.0
    for _ in range(tries):
        waited += wait_for_profiler(url)
        flushed = flush_cache(url)
        before = spex_stats(url)
        if not (before.get("profile") or {}).get("measuring"):
            break
    return waited, flushed, before


def profiled_during(p0: Dict[str, Any], p1: Dict[str, Any]) -> bool:
    """Whether the roofline profiler ran during a run, from ``/spex/stats``'s ``profile`` before and after it: a
    re-profile started (``reprofiles`` grew), a sweep was running at either end, or k_total changed."""
    return bool(
        (p1.get("reprofiles") or 0) > (p0.get("reprofiles") or 0)
        or p0.get("measuring")
        or p1.get("measuring")
        or p0.get("k_total") != p1.get("k_total")
    )


def wait_for_profiler(url: str, wait_s: float = 900.0) -> float:
    """Wait while the server measures its roofline (the start-up profile, or a drift re-profile that started in the
    idle gap before this run): a run must not share the engine with the profiler's sweep. Returns the seconds
    waited."""
    t0 = time.monotonic()
    while spex_stats(url).get("profile", {}).get("measuring") and time.monotonic() - t0 < wait_s:
        time.sleep(1.0)
    return time.monotonic() - t0


def _set_knobs(args, url: str, current: Dict[str, Any], mode: str) -> None:
    """Scheduler knobs for ``mode``: a knob variant's own, the server's launch values (``args.server_knobs``,
    read before the first run) for every other mode."""
    if not args.knob_variants:
        return
    want = args.knob_variants.get(mode) or {k: args.server_knobs[k] for v in args.knob_variants.values() for k in v}
    change = {k: v for k, v in want.items() if current.get(k) != v}
    if change:
        r = requests.post(url + "/spex/knobs", json=change, timeout=120)
        r.raise_for_status()


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--policies", help=f"comma list of presets (default {DEFAULTS['policies']})")
    ap.add_argument("--concurrency", help=f"comma list of concurrent queries (default {DEFAULTS['concurrency']})")
    ap.add_argument("--questions", type=int, help="questions per run, at least the concurrency (default 4)")
    ap.add_argument("--max-depth", type=int, help="search depth (default 4)")
    ap.add_argument("--step-tokens", type=int, help="max tokens per step (default 48)")
    ap.add_argument(
        "--stop",
        type=lambda v: json.loads(v) if v.startswith("[") else [v.encode().decode("unicode_escape")],
        default=["\n\n"],
        help='a step ends at this string (escapes allowed, e.g. "\\n"), or at any of a JSON list; default "\\n\\n"',
    )
    ap.add_argument("--repeats", type=int, help="repeats of every cell, modes interleaved (default 3)")
    ap.add_argument("--task", default="rg:chain_sum", help="toy_add or any rg:<reasoning_gym dataset>")
    ap.add_argument(
        "--reward",
        default="logprob",
        help="logprob (every node asks SGLang for logprobs, which SGLang never mixes into a decode step) "
        "or verifier:NAME (e.g. verifier:arith, a rule checker: no logprobs)",
    )
    ap.add_argument(
        "--reward-latency-ms",
        type=float,
        default=0.0,
        help="with verifier:NAME: score through an emulated external PRM that answers after this many ms (a "
        "callback reward served by this process: the reward barrier), instead of on the server",
    )
    ap.add_argument(
        "--dtype",
        default="float32",
        help="the server's --dtype: float32 (default; batch-shape-independent logits, so SPEX with T3 off grows the "
        "baseline's tree) or bfloat16 (the users' dtype; trees differ run to run)",
    )
    ap.add_argument("--k-total", default="8", help="the server's --tot-k-total (a number or auto)")
    ap.add_argument("--t3", action="store_true", help="also run SPEX with T3 early stop (changes the search)")
    ap.add_argument("--gate-mode", action="store_true", help="also run SPEX with the pay-off gate on (mode spex_gate)")
    ap.add_argument(
        "--variant",
        action="append",
        default=[],
        metavar="NAME=JSON",
        help="also run SPEX (T1+T2) with these per-search speculation settings, as mode NAME (server-side; repeat)",
    )
    ap.add_argument(
        "--knob-variant",
        action="append",
        default=[],
        metavar="NAME=JSON",
        help="also run SPEX (T1+T2) with these /spex/knobs scheduler knobs, as mode NAME (server-side; repeat)",
    )
    ap.add_argument("--client-side", action="store_true", help="drive searches over HTTP (HttpPort), not /tot/search")
    ap.add_argument("--quick", action="store_true", help="smoke-test sizes: " + json.dumps(QUICK))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--first-repeat", type=int, default=0, help="number of the first repeat (to extend an earlier run)")
    ap.add_argument("--url", help="use a running --tot-speculation server instead of starting SmolLM2")
    ap.add_argument("--server-arg", action="append", default=[], help="extra launcher flag for the server (repeat)")
    ap.add_argument("--out", default=OUT)
    ap.add_argument("--summarise", metavar="JSON", help="only print the table of an earlier (or partial) run's JSON")
    ap.add_argument(
        "--price",
        metavar="JSON[:KEY]",
        help="with --summarise: price the schedules at this step price (gpu_step_price.py's output, KEY wall or kernel,"
        " default kernel; or a bare as_dict price) instead of the run's own fitted one",
    )
    args = ap.parse_args(argv)
    for key, value in (QUICK if args.quick else DEFAULTS).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.price and not args.summarise:
        ap.error("--price prices recorded schedules: use it with --summarise RUN.json")
    if args.client_side and args.k_total == "auto":
        ap.error("--client-side needs a numeric --k-total (the client-side budget has no profile)")
    args.k_total_client = None if args.k_total == "auto" else int(args.k_total)
    args.variants, args.overrides, args.knob_variants, args.server_knobs = [], dict(OVERRIDES), {}, None
    for flag, items in (("--variant", args.variant), ("--knob-variant", args.knob_variant)):
        for item in items:
            name, _, text = item.partition("=")
            try:
                settings = json.loads(text)
            except json.JSONDecodeError as e:
                ap.error(f"{flag} {item!r}: not NAME=JSON ({e})")
            if not name or name in args.overrides or not isinstance(settings, dict) or not settings:
                ap.error(f"{flag} {item!r}: needs a new mode name and a non-empty JSON object")
            if args.client_side:
                ap.error(f"{flag} runs server-side only")
            if flag == "--variant":
                args.overrides[name] = {**OVERRIDES["spex_t1t2"], **settings}
            else:
                unknown = sorted(set(settings) - set(KNOBS))
                if unknown:
                    ap.error(f"{flag} {item!r}: unknown knob(s) {unknown}; known: {list(KNOBS)}")
                args.overrides[name] = OVERRIDES["spex_t1t2"]
                args.knob_variants[name] = settings
            args.variants.append(name)
    if args.reward_latency_ms and not args.reward.startswith("verifier:"):
        ap.error(
            "--reward-latency-ms needs --reward verifier:NAME (the emulated PRM answers with the verifier's score)"
        )
    return args


def load_price(spec: str) -> StepPrice:
    """``FILE[:KEY]``: a step price from gpu_step_price.py's JSON (``price[KEY]``, default kernel) or a bare one."""
    path, _, key = spec.partition(":")
    data = json.loads(Path(path).read_text())
    if "price" in data:
        prices = data["price"]
        key = key or ("kernel" if "kernel" in prices else "wall")
        if key not in prices:
            raise SystemExit(f"--price {spec}: no {key!r} price in {path} (has {sorted(prices)})")
        data = prices[key]
    return StepPrice.from_dict(data)


def main(argv: Optional[Sequence[str]] = None) -> Dict[str, Any]:
    from overlap import stop_servers_on_sigterm  # a sibling script's helper (benchmark/ is on the path here)

    args = parse_args(argv)
    stop_servers_on_sigterm()  # a killed run still stops the server it started
    if args.summarise:
        if not Path(args.summarise).is_file():
            raise SystemExit(f"--summarise {args.summarise}: no such file (a run writes its --out, default {OUT})")
        data = json.loads(Path(args.summarise).read_text())
        price = load_price(args.price) if args.price else None
        data["summary"] = summarise(data["rows"], price)
        if price is not None:
            print(f"schedules priced at {args.price}: {price.as_dict()}")
        print_table(data["summary"])
        print_time_split(data["summary"])
        return data
    policies = args.policies.split(",")
    concs = [int(c) for c in args.concurrency.split(",")]
    modes = ["baseline", "spex_t1t2"] + (["spex_t1t2t3"] if args.t3 else []) + (["spex_gate"] if args.gate_mode else [])
    modes += args.variants
    n_questions = max([args.questions, *concs])
    questions = get_task(args.task).questions(n_questions, split="test", seed=args.seed)
    server_args = ["--tot-speculation", "--tot-k-total", str(args.k_total), "--dtype", args.dtype, *args.server_arg]
    prm = None
    server = None if args.url else ServerProcess(server_args)
    rows: List[Dict[str, Any]] = []
    started = time.time()
    try:  # from the start on: an error or Ctrl-C anywhere below still stops the server and the PRM
        if args.reward_latency_ms:  # an external PRM, emulated: the verifier's score after a fixed latency
            prm = delayed_verifier(args.reward.split(":", 1)[1], args.reward_latency_ms / 1000.0)
            args.reward_name, args.reward = args.reward, {"type": "callback", "url": prm.url}
        if server is not None:
            server.start()
        url = args.url or server.url
        args.server_pid = server.proc.pid if server is not None else None
        if args.knob_variants:
            args.server_knobs = spex_stats(url)["scheduler"]["knobs"]  # restored for every mode but a knob variant
        warm = argparse.Namespace(**{**vars(args), "max_depth": 1, "step_tokens": 4})
        for policy in policies:  # warm-up (not measured, tiny): first-request costs must land on no mode
            for mode in modes:
                measure(warm, url, policy, 1, mode, questions[:1], args.seed + 1)
        repeats = range(args.first_repeat, args.first_repeat + args.repeats)
        runs = [(rep, p, c) for rep in repeats for p in policies for c in concs]
        bar = tqdm(total=len(runs) * len(modes), desc="bench_tot")
        for rep, policy, conc in runs:
            order = modes if rep % 2 == 0 else modes[::-1]  # interleaved, order alternating between repeats
            for mode in order:
                row = measure(args, url, policy, conc, mode, questions[: max(args.questions, conc)], args.seed)
                rows.append({"policy": policy, "concurrency": conc, "mode": mode, "repeat": rep, **row})
                write(args.out, {"meta": {"partial": True}, "summary": summarise(rows), "rows": rows})
                bar.update(1)
        bar.close()
    finally:
        if server is not None:
            server.stop()
        if prm is not None:
            prm.close()
    summary = summarise(rows)
    print_table(summary)
    print_time_split(summary)
    price = step_price(rows)
    print(f"step price (priced x): {price.as_dict() if price else '-'}")
    meta = {
        "host_cpus": os.cpu_count(),
        "load_avg_at_end": os.getloadavg(),
        "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(started)),
        "wall_s": round(time.time() - started, 1),
        "path": "client-side (HttpPort)" if args.client_side else "server-side (POST /tot/search)",
        "baseline": "same --tot-speculation server, per-search speculation.enabled=false",
        "args": {k: v for k, v in vars(args).items() if k != "k_total_client"},
        "step_price": price.as_dict() if price else None,
        "source": f"real CPU SGLang server, SmolLM2-135M ({args.dtype})" if not args.url else f"server at {args.url}",
    }
    out = {"meta": meta, "summary": summary, "rows": rows}
    write(args.out, out)
    print(f"wrote {args.out}")
    return out


def write(path: str, data: Dict[str, Any]) -> None:
    """Write the JSON (after every run too, so an interrupted benchmark keeps what it measured)."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(data, indent=1))


if __name__ == "__main__":
    main()
