"""Scale-out on the same cores: 1 server vs ``--dp-size 2`` vs 2 servers + sglang-router, in one run.

Setups (each gets all the machine's cores; started one at a time, every worker's radix cache flushed before every
batch, on each worker itself, each flush retried until that worker is idle):

- ``single``: one server, one rank running as many torch threads as there are cores;
- ``dp2``: one server with ``--dp-size 2`` (the launcher binds one core range per rank); each client-side search
  is pinned to a rank with SGLang's ``routed_dp_rank`` (searches alternate between ranks);
- ``router``: 2 servers (one core range each) behind sglang-router ``--policy manual``: every request of a search
  carries ``X-SMG-Routing-Key: <search id>`` (``HttpPort``'s default), so a search stays on one worker;
- ``round_robin``: the same 2 servers behind ``--policy round_robin`` (the header is ignored: no affinity).

Every setup runs the same questions with the same seeds, client-side (``HttpPort`` to the server or router URL),
baseline and SPEX (T1+T2), rSTAR and REBASE; within a setup, repeats interleave policies and modes (the order
alternates). Reported per (setup, policy, mode): median q/min with min–max over repeats, the q/min ratio to
``single`` (same policy, mode), and the radix-cache hit rate = Σ cached_tokens / Σ prompt_tokens over every
request (SGLang's ``meta_info``), with its difference to ``single`` in points.

    .venv/bin/python benchmark/bench_scale.py                      # tiny model (seconds per batch)
    .venv/bin/python benchmark/bench_scale.py --model smollm2 --questions 4 --repeats 2
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import statistics
import time
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional

from bench_tot import MODES, build_spec, flush_cache
from overlap import stop_servers_on_sigterm

from sglang_spex.config import SpexConfig
from sglang_spex.models import prepare_smollm2, prepare_tiny_llama
from sglang_spex.scale.cluster import Cluster
from sglang_spex.scale.router import RouterProcess
from sglang_spex.serve import ServerProcess
from sglang_spex.speculation.runner import SpecBudget, context_factory
from sglang_spex.tot.context import SearchContext
from sglang_spex.tot.http_port import HttpPort
from sglang_spex.tot.search import run_batch
from sglang_spex.tot.tasks import get_task

SETUPS = ("single", "dp2", "router", "round_robin")
POLICIES = {"rstar": "rstar-5", "rebase": "rebase-8"}
BENCH_MODES = {"baseline": MODES["baseline"], "spex": MODES["spex_t1t2"]}
K_TOTAL = 8


def rank_pinned(factory: Callable[..., SearchContext], ranks: int) -> Callable[..., SearchContext]:
    """A context factory whose searches alternate over ``ranks`` DP ranks (SGLang's ``routed_dp_rank``)."""
    counter = itertools.count()

    def make(*args: Any, **kwargs: Any) -> SearchContext:
        ctx = factory(*args, **kwargs)
        ctx.dp_rank = next(counter) % ranks
        return ctx

    return make


async def one_batch(
    url: str, spec, questions, mode: Optional[dict], dp_ranks: int, flush_urls: List[str]
) -> Dict[str, Any]:
    """One measured batch, all questions at once (every worker's cache flushed first): q/min and cache figures."""
    for u in flush_urls:  # each worker itself: no cell inherits the prefixes of the one before (same seeds)
        flush_cache(u)
    factory: Callable[..., SearchContext] = SearchContext
    if mode is not None:
        cfg = SpexConfig(enabled=True, k_total=K_TOTAL, **mode)
        factory = context_factory(cfg, SpecBudget(K_TOTAL, cfg.budget_temperature, cfg.min_share))
    if dp_ranks > 1:
        factory = rank_pinned(factory, dp_ranks)
    port = HttpPort(url)
    t0 = time.monotonic()
    try:
        results = await run_batch(
            spec, [q.text for q in questions], port, concurrency=len(questions), context_factory=factory
        )
    finally:
        await port.close()
    wall = time.monotonic() - t0
    nodes = [n for r in results for n in r.to_dict()["nodes"] if n["path"] != "r"]
    prompt = sum(n.get("prompt_tokens") or 0 for n in nodes)
    cached = sum(n.get("cached_tokens") or 0 for n in nodes)
    return {
        "wall_s": round(wall, 2),
        "q_per_min": round(len(results) / wall * 60, 3),
        "prompt_tokens": prompt,
        "cached_tokens": cached,
        "hit_rate": cached / prompt if prompt else 0.0,
        "statuses": sorted({r.status for r in results}),
        "failures": sum(len(r.failures) for r in results),
        "requests": sum(r.num_requests for r in results),
    }


def run_setup(
    url: str, name: str, args, questions, dp_ranks: int = 1, workers: Optional[List[str]] = None
) -> List[Dict[str, Any]]:
    rows = []
    cells = [(p, m) for p in POLICIES for m in BENCH_MODES]
    for rep in range(args.repeats):
        order = cells if rep % 2 == 0 else cells[::-1]
        for policy, mode in order:
            spec = build_spec(POLICIES[policy], args.max_depth, args.step_tokens, seed=rep, task=args.task)
            row = asyncio.run(one_batch(url, spec, questions, BENCH_MODES[mode], dp_ranks, workers or [url]))
            row.update(setup=name, policy=policy, mode=mode, repeat=rep)
            print(json.dumps(row), flush=True)
            rows.append(row)
    return rows


def summarize(rows: List[Dict[str, Any]]) -> List[Dict[str, Any]]:
    cells: Dict[tuple, List[dict]] = {}
    for r in rows:
        cells.setdefault((r["setup"], r["policy"], r["mode"]), []).append(r)
    out = []
    for (setup, policy, mode), rs in cells.items():
        qpm = [r["q_per_min"] for r in rs]
        hit = sum(r["cached_tokens"] for r in rs) / max(sum(r["prompt_tokens"] for r in rs), 1)
        out.append(
            dict(setup=setup, policy=policy, mode=mode, qpm=statistics.median(qpm), qpm_min=min(qpm),
                 qpm_max=max(qpm), hit_rate=hit, failures=sum(r["failures"] for r in rs))
        )  # fmt: skip
    base = {(s["policy"], s["mode"]): s for s in out if s["setup"] == "single"}
    for s in out:
        b = base.get((s["policy"], s["mode"]))
        s["qpm_vs_single"] = s["qpm"] / b["qpm"] if b and b["qpm"] else None
        s["hit_pts_vs_single"] = 100 * (s["hit_rate"] - b["hit_rate"]) if b else None
    return out


def table(summary: List[Dict[str, Any]]) -> str:
    lines = [
        "| setup | policy | mode | q/min median (min–max) | × single | cache hit | Δ hit vs single (pts) | failures |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for s in sorted(summary, key=lambda s: (s["policy"], s["mode"], SETUPS.index(s["setup"]))):
        ratio = f"{s['qpm_vs_single']:.2f}" if s["qpm_vs_single"] else "–"
        pts = f"{s['hit_pts_vs_single']:+.1f}" if s["hit_pts_vs_single"] is not None else "–"
        lines.append(
            f"| {s['setup']} | {s['policy']} | {s['mode']} | {s['qpm']:.2f} ({s['qpm_min']:.2f}–{s['qpm_max']:.2f})"
            f" | {ratio} | {100 * s['hit_rate']:.1f}% | {pts} | {s['failures']} |"
        )
    return "\n".join(lines)


def main() -> None:
    stop_servers_on_sigterm()  # a `timeout` or kill still stops the servers this run started
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", choices=("tiny", "smollm2"), default="tiny")
    p.add_argument("--setups", default=",".join(SETUPS), help=f"comma list of {SETUPS}")
    p.add_argument("--task", default="toy_add")
    p.add_argument("--questions", type=int, default=4)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--max-depth", type=int, default=2)
    p.add_argument("--step-tokens", type=int, default=8)
    p.add_argument("--out", default="benchmark/results/bench_scale.json")
    p.add_argument("--startup-timeout", type=float, default=1800.0, help="seconds a server may take to start")
    args = p.parse_args()
    setups = [s for s in args.setups.split(",") if s]
    unknown = set(setups) - set(SETUPS)
    if unknown:
        p.error(f"unknown setups {sorted(unknown)}; choose from {SETUPS}")
    model = str(prepare_tiny_llama() if args.model == "tiny" else prepare_smollm2())
    server_args = ["--model-path", model, "--tot-speculation", "--tot-k-total", str(K_TOTAL)]
    if args.model == "tiny":
        server_args += ["--dtype", "float32"]
    questions = get_task(args.task).questions(args.questions, split="test")
    rows: List[Dict[str, Any]] = []

    try:
        run_all(setups, server_args, args, questions, rows, args.startup_timeout)
    finally:  # a setup that failed to start still leaves the rows measured so far
        report(rows, args)


def run_all(setups, server_args, args, questions, rows: List[Dict[str, Any]], startup_timeout: float) -> None:
    cores = sorted(os.sched_getaffinity(0))
    if "single" in setups:  # one rank, one torch thread per core
        env = {"OMP_NUM_THREADS": str(len(cores))}
        with ServerProcess(server_args, env=env, startup_timeout=startup_timeout) as srv:
            rows += run_setup(srv.url, "single", args, questions)
    if "dp2" in setups:
        with ServerProcess([*server_args, "--dp-size", "2"], startup_timeout=startup_timeout) as srv:
            rows += run_setup(srv.url, "dp2", args, questions, dp_ranks=2)
    routed = [s for s in ("router", "round_robin") if s in setups]
    if routed:  # the same 2 workers behind one router per policy
        cluster = Cluster(server_args, n=2, policy="manual", startup_timeout=startup_timeout)
        with cluster:
            if "router" in routed:
                rows += run_setup(cluster.url, "router", args, questions, workers=cluster.worker_urls)
            if "round_robin" in routed:
                with RouterProcess(cluster.worker_urls, policy="round_robin") as rr:
                    rows += run_setup(rr.url, "round_robin", args, questions, workers=cluster.worker_urls)


def report(rows: List[Dict[str, Any]], args) -> None:
    summary = summarize(rows)
    print(table(summary))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"args": vars(args), "rows": rows, "summary": summary}, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
