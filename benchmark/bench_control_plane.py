"""SPEX control-plane cost: planning time and scheduler-hook time per scheduler step at 1/16/64 concurrent searches.

Two parts, one run:

- **live** (real SGLang server, tiny random Llama by default): ``N`` concurrent rSTAR searches with SPEX (T1+T2)
  run client-side over ``HttpPort`` in this process, with the same ``SpexContext`` a server-side search runs
  on the TokenizerManager's loop. Planning is timed around ``dfs_lookahead.predict_expansions`` (T1) and
  around ``SpexContext.pump`` (the whole refill: the T2 split, ``SpecBudget.share``, asks every live search for
  its demand, i.e. its plan, then issues). The scheduler side comes from the batch-stats ring (hook H13): steps, their wall time
  (``step_s``) and the time spent in the plugin's scheduler hooks (``hook_s``). Per scheduler step:
  ``plan`` = planning seconds / steps, ``hooks`` = hook seconds / steps, and the control plane's share
  ``(pump + hooks) / step time``. The ``N`` values are interleaved over ``--repeats`` rounds; medians with
  min-max.
- **micro** (no engine): one plan on a tree of ``S`` nodes with the copy-on-read overlay versus the deep copy
  of every MCTS statistic it replaces (``copy_stats`` before the same walk), interleaved, repeated.

    python benchmark/bench_control_plane.py [--url URL] [--searches 1 16 64] [--repeats 3] [--out FILE.json]

Without ``--url`` a tiny-model server (``--tot-speculation --tot-k-total K``) is started and stopped. The host
may be shared: the numbers then include other tenants' load (the interleaving spreads it over the modes).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import time
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

import httpx
from overlap import fmt, spread, stop_servers_on_sigterm

from sglang_spex.config import SpexConfig
from sglang_spex.speculation import dfs_lookahead
from sglang_spex.speculation.budget import SpecBudget
from sglang_spex.speculation.runner import SpexContext, context_factory
from sglang_spex.tot.http_port import HttpPort
from sglang_spex.tot.policies.base import Stat, Stats, copy_stats
from sglang_spex.tot.policies.rstar import RStar, RStarParams
from sglang_spex.tot.search import run_batch
from sglang_spex.tot.search_spec import SearchSpec

POLICY = {"name": "rstar", "num_rollouts": 8, "max_depth": 4, "branch": 3}
STEP = {"max_tokens": 8, "stop": ["\n\n"], "temperature": 1.0}
TARGET_SHARE = 0.02  # the target: control plane < 2% of the scheduler step time at 64 searches


class Timer:
    """Seconds and calls accumulated around a function (wrapped in place, restored by :meth:`restore`)."""

    def __init__(self, owner: Any, name: str):
        self.owner, self.name, self.orig = owner, name, getattr(owner, name)
        self.seconds, self.calls = 0.0, 0
        orig = self.orig

        def timed(*args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return orig(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - t0
                self.calls += 1

        setattr(owner, name, timed)

    def restore(self) -> None:
        setattr(self.owner, self.name, self.orig)


def _stats(client: httpx.Client, url: str, since: Optional[int] = None) -> Dict[str, Any]:
    """``/spex/stats``: the batch-stats ring (``batch``) and the scheduler-side state (``scheduler``)."""
    params = {} if since is None else {"history_since": since}
    return client.get(url + "/spex/stats", params=params, timeout=120).json()


async def _searches(url: str, n: int, seed: int, k_total: int) -> List[Any]:
    spec = SearchSpec.from_dict(
        {"policy": POLICY, "step": STEP, "reward": {"type": "verifier", "name": "arith"}, "seed": seed}
    )
    cfg = SpexConfig(enabled=True, k_total=k_total, components=("t1", "t2"))
    port = HttpPort(url)
    try:
        questions = [f"What is {seed + i} + {7 * i + 3}?" for i in range(n)]
        return await run_batch(spec, questions, port, concurrency=n, context_factory=context_factory(cfg))
    finally:
        await port.close()


def live_run(url: str, n: int, seed: int, k_total: int) -> Dict[str, float]:
    """One round of ``n`` concurrent searches; control-plane figures per scheduler step."""
    with httpx.Client() as client:
        first = _stats(client, url)
        seq0, by0 = first["batch"]["seq"], first["scheduler"].get("hook_by", {})
        plan = Timer(dfs_lookahead, "predict_expansions")
        pump = Timer(SpexContext, "pump")
        share = Timer(SpecBudget, "share")  # inside pump: asks every live search for its demand (its plan)
        t0 = time.perf_counter()
        try:
            results = asyncio.run(_searches(url, n, seed, k_total))
        finally:
            plan.restore()
            pump.restore()
            share.restore()
        wall = time.perf_counter() - t0
        time.sleep(0.5)  # the last step's time is written when the next step (or idle) is recorded
        last = _stats(client, url, seq0)
        hist, by1 = last["batch"]["history"], last["scheduler"].get("hook_by", {})
    rows = hist["rows"]
    steps = len(rows)
    step_s = sum(r["step_s"] for r in rows if r["step_s"] is not None)
    hook_s = sum(r["hook_s"] for r in rows if r["hook_s"] is not None)
    done = sum(1 for r in results if r.status == "done")
    issued = sum((r.speculation or {}).get("issued", 0) for r in results)
    return {
        "searches": n,
        "done": done,
        "spec_issued": issued,
        "wall_s": wall,
        "steps": steps,
        "rows_lost": hist["lost"],
        "step_ms": 1e3 * step_s / max(steps, 1),
        "plans": plan.calls,
        "plan_ms_per_step": 1e3 * plan.seconds / max(steps, 1),
        "plan_us_per_plan": 1e6 * plan.seconds / max(plan.calls, 1),
        "pump_ms_per_step": 1e3 * pump.seconds / max(steps, 1),
        "share_ms_per_step": 1e3 * share.seconds / max(steps, 1),
        "pumps": pump.calls,
        "hook_ms_per_step": 1e3 * hook_s / max(steps, 1),
        "control_share": (pump.seconds + hook_s) / step_s if step_s > 0 else float("nan"),
        "hook_share": hook_s / step_s if step_s > 0 else float("nan"),
        **{f"hook_ms_per_step.{k}": 1e3 * (v - by0.get(k, 0.0)) / max(steps, 1) for k, v in sorted(by1.items())},
    }


# ---------------------------------------------------------------- micro: overlay vs deep copy
def grown_tree(
    nodes: int, branch: int, max_depth: int, seed: int = 0, p_failed: float = 0.0, p_terminal: float = 0.0
) -> Stats:
    """A tree of about ``nodes`` statistics grown the way an MCTS grows one (random leaves expanded); a new
    child failed with probability ``p_failed``, terminal with ``p_terminal``."""
    rng = random.Random(seed)
    stats: Stats = {"r": Stat("r", None, 0, visits=1, explored=True)}
    leaves = ["r"]
    while len(stats) < nodes and leaves:
        path = leaves.pop(rng.randrange(len(leaves)))
        st = stats[path]
        if st.depth >= max_depth - 1 or st.terminal or st.failed:
            continue
        st.expanded = True
        for i in range(branch):
            c = f"{path}.{i}"
            st.children.append(c)
            stats[c] = Stat(c, path, st.depth + 1, visits=rng.randint(1, 4), value=rng.random(), explored=True)
            stats[c].failed, stats[c].terminal = rng.random() < p_failed, rng.random() < p_terminal
            leaves.append(c)
    return stats


def micro(sizes: Sequence[int], repeats: int, lookahead: int = 4) -> Dict[str, Any]:
    policy = RStar(RStarParams(branch=3, max_depth=12))
    out: Dict[str, Any] = {}
    for size in sizes:
        stats = grown_tree(size, 3, 12)
        times: Dict[str, List[float]] = {"overlay": [], "deep_copy": []}
        for rep in range(repeats):
            for mode in ("overlay", "deep_copy") if rep % 2 == 0 else ("deep_copy", "overlay"):
                rngs = [random.Random(i) for i in range(lookahead)]
                t0 = time.perf_counter()
                base = copy_stats(stats) if mode == "deep_copy" else stats
                dfs_lookahead.predict_expansions(base, "r", policy, rngs, set())
                times[mode].append(1e6 * (time.perf_counter() - t0))
        out[str(size)] = {mode: spread(v) for mode, v in times.items()}
    return out


# ---------------------------------------------------------------- driver
def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", default="", help="a running --tot-speculation server (default: start a tiny one)")
    ap.add_argument("--model-path", default="", help="model of the started server (default: the tiny Llama)")
    ap.add_argument("--searches", type=int, nargs="+", default=[1, 16, 64])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--k-total", type=int, default=16, help="SPEX budget of the searches and the server")
    ap.add_argument("--micro-sizes", type=int, nargs="+", default=[100, 1000, 5000])
    ap.add_argument("--micro-repeats", type=int, default=20)
    ap.add_argument("--out", default="benchmark/results/bench_control_plane.json")
    return ap.parse_args(argv)


def _start_server(args: argparse.Namespace):
    from sglang_spex.models import prepare_tiny_llama
    from sglang_spex.serve import ServerProcess

    model = args.model_path or str(prepare_tiny_llama())
    srv = ServerProcess(["--model-path", model, "--tot-speculation", "--tot-k-total", str(args.k_total)])
    return srv.start()


def main(argv: Optional[Sequence[str]] = None) -> Dict[str, Any]:
    args = parse_args(argv)
    stop_servers_on_sigterm()
    data: Dict[str, Any] = {"args": vars(args), "micro_us": micro(args.micro_sizes, args.micro_repeats)}
    print("micro: one plan (us), copy-on-read overlay vs deep copy of the statistics; median (min-max)")
    for size, m in data["micro_us"].items():
        print(f"  {size:>6} nodes: overlay {fmt(m['overlay'])}  deep copy {fmt(m['deep_copy'])}")
    srv = None if args.url else _start_server(args)
    url = args.url or srv.url
    runs: List[Dict[str, float]] = []
    try:
        for rep in range(args.repeats):
            order = list(args.searches) if rep % 2 == 0 else list(reversed(args.searches))
            for n in order:
                r = live_run(url, n, seed=rep, k_total=args.k_total)
                r["repeat"] = rep
                runs.append(r)
                print(f"  repeat {rep} searches {n}: {json.dumps({k: round(v, 4) for k, v in r.items()})}", flush=True)
    finally:
        if srv is not None:
            srv.stop()
    keys = ("step_ms", "plan_ms_per_step", "plan_us_per_plan", "pump_ms_per_step", "share_ms_per_step")
    keys += ("hook_ms_per_step",)
    summary: Dict[str, Any] = {}
    for n in args.searches:
        mine = [r for r in runs if r["searches"] == n]
        summary[str(n)] = {k: spread([r[k] for r in mine]) for k in (*keys, "control_share", "hook_share")}
        parts = sorted({k for r in mine for k in r if k.startswith("hook_ms_per_step.")})
        summary[str(n)]["hook_parts"] = {k.split(".", 1)[1]: spread([r.get(k, 0.0) for r in mine]) for k in parts}
    data.update(runs=runs, summary=summary, target_share=TARGET_SHARE)
    print("live: per scheduler step, median (min-max) over repeats")
    print(
        f"{'searches':>8} {'step ms':>18} {'plan ms':>18} {'pump ms':>18} {'T2 share ms':>18} {'hooks ms':>18} "
        f"{'control %':>18}"
    )
    for n, s in summary.items():
        share = {k: 100 * v if isinstance(v, float) else v for k, v in s["control_share"].items()}
        print(
            f"{n:>8} {fmt(s['step_ms'], 2):>18} {fmt(s['plan_ms_per_step'], 3):>18} "
            f"{fmt(s['pump_ms_per_step'], 3):>18} {fmt(s['share_ms_per_step'], 3):>18} "
            f"{fmt(s['hook_ms_per_step'], 3):>18} {fmt(share, 2):>18}"
        )
    print("hooks by part, ms per step (median), largest first")
    for n, s in summary.items():
        parts = sorted(s["hook_parts"].items(), key=lambda kv: -kv[1]["median"])
        print(f"{n:>8} " + ", ".join(f"{k} {v['median']:.3f}" for k, v in parts))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(data, indent=1))
    print(f"wrote {args.out}")
    return data


if __name__ == "__main__":
    main()
