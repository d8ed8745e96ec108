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
  The refill's time is also taken as this thread's CPU time (``pump_cpu_ms_per_step``, and
  ``control_share_pump_cpu`` = (pump CPU + hooks) / step time): on a loaded host the wall time of the client's
  Python stretches with the other tenants. The hooks stay wall time (the scheduler charges them so).
- **micro** (no engine): one plan on a tree of ``S`` nodes with the copy-on-read overlay versus the deep copy
  of every MCTS statistic it replaces (``copy_stats`` before the same walk), interleaved, repeated; and the CPU
  time of one scheduler step's hooks on fake requests and of one T2 re-split at 64 searches (:func:`micro_hooks`,
  best of 7: far less moved by the host's load than wall time; what a change to the hooks' Python saves).

    python benchmark/bench_control_plane.py [--url URL] [--searches 1 16 64] [--repeats 3] [--out FILE.json]
    python benchmark/bench_control_plane.py --skip-live   # the micro parts only, no server

Without ``--url`` a tiny-model server (``--tot-speculation --tot-k-total K``) is started and stopped. The host
may be shared: the numbers then include other tenants' load (the interleaving spreads it over the modes).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence

import httpx
from overlap import fmt, spread, stop_servers_on_sigterm
from sched_trace import stats_history

from sglang_spex.config import SpexConfig
from sglang_spex.speculation import dfs_lookahead
from sglang_spex.speculation.budget import QueryDemand, SpecBudget
from sglang_spex.speculation.runner import SpexContext, context_factory
from sglang_spex.tot.engine import EnginePort, GenResult
from sglang_spex.tot.http_port import HttpPort
from sglang_spex.tot.policies.base import Stat, Stats, copy_stats
from sglang_spex.tot.policies.rstar import RStar, RStarParams
from sglang_spex.tot.search import run_batch
from sglang_spex.tot.search_spec import SearchSpec

POLICY = {"name": "rstar", "num_rollouts": 8, "max_depth": 4, "branch": 3}
STEP = {"max_tokens": 8, "stop": ["\n\n"], "temperature": 1.0}
TARGET_SHARE = 0.02  # the target: control plane < 2% of the scheduler step time at 64 searches


class Timer:
    """Seconds and calls accumulated around a function (wrapped in place, restored by :meth:`restore`); with
    ``cpu``, also this thread's CPU seconds in it (read outside the wall-clock window, so the wall figure does not
    include the CPU clock's own cost; a Timer nested inside a ``cpu`` one should not be ``cpu`` itself)."""

    def __init__(self, owner: Any, name: str, cpu: bool = False):
        self.owner, self.name, self.orig = owner, name, getattr(owner, name)
        self.seconds, self.cpu_seconds, self.calls = 0.0, 0.0, 0
        orig = self.orig

        def timed(*args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return orig(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - t0
                self.calls += 1

        def timed_cpu(*args: Any, **kwargs: Any) -> Any:
            c0 = time.thread_time()
            try:
                return timed(*args, **kwargs)
            finally:
                self.cpu_seconds += time.thread_time() - c0

        setattr(owner, name, timed_cpu if cpu else timed)

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
        pump = Timer(SpexContext, "pump", cpu=True)  # the numerator's client part, also as CPU time
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
        last = stats_history(url, seq0, lambda since: _stats(client, url, since))
        hist, by1 = last["batch"]["history"], last["scheduler"].get("hook_by", {})
    rows = [r for r in hist["rows"] if r["batch_size"]]  # the steps (an idle row, batch_size 0, is none)
    steps = len(rows)
    step_s = sum(r["step_s"] for r in rows if r["step_s"] is not None)
    hook_s = sum(r["hook_s"] for r in hist["rows"] if r["hook_s"] is not None)  # the idle rows' hook time too
    done = sum(1 for r in results if r.status == "done")
    issued = sum((r.speculation or {}).get("issued", 0) for r in results)
    return {
        "searches": n,
        "done": done,
        "spec_issued": issued,
        "wall_s": wall,
        "steps": steps,
        "rows_lost": hist["lost"],
        # rows whose step time was never written (the step before an idle gap): their hook time counts, their
        # step time does not (the share leans high, never low)
        "rows_untimed": sum(1 for r in rows if r["step_s"] is None),
        "step_ms": 1e3 * step_s / max(steps, 1),
        "plans": plan.calls,
        "plan_ms_per_step": 1e3 * plan.seconds / max(steps, 1),
        "plan_us_per_plan": 1e6 * plan.seconds / max(plan.calls, 1),
        "pump_ms_per_step": 1e3 * pump.seconds / max(steps, 1),
        "pump_cpu_ms_per_step": 1e3 * pump.cpu_seconds / max(steps, 1),
        "share_ms_per_step": 1e3 * share.seconds / max(steps, 1),
        "pumps": pump.calls,
        "hook_ms_per_step": 1e3 * hook_s / max(steps, 1),
        "control_share": (pump.seconds + hook_s) / step_s if step_s > 0 else float("nan"),
        # the same with the refill's CPU time instead of its wall time (a loaded host stretches the wall time of
        # the client's Python; the hooks stay wall time, measured in the scheduler)
        "control_share_pump_cpu": (pump.cpu_seconds + hook_s) / step_s if step_s > 0 else float("nan"),
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


# ---------------------------------------------------------------- micro: one step's hooks and T2 split, CPU time
class _Params:
    def __init__(self, custom: Dict[str, Any]):
        self.custom_params = custom


class _Req:
    def __init__(self, i: int, spec: bool, search: str):
        self.rid = f"spex:{search}:r.{i}:{'s' if spec else ''}"
        self.sampling_params = _Params({"spex_role": "spec" if spec else "primary", "spex_search": search})
        self.finished_reason, self.to_finish, self.extend_len = None, None, 24

    def finished(self) -> bool:
        return self.finished_reason is not None


class _Batch:
    def __init__(self, reqs: List[_Req], mode: Any):
        self.reqs, self.forward_mode, self.decoding_reqs = reqs, mode, None


class _Tree:
    def evictable_size(self) -> int:
        return 1000

    def protected_size(self) -> int:
        return 500


class _Allocator:
    def available_size(self) -> int:
        return 40000


class _Scheduler:
    """What the hooks read of SGLang's ``Scheduler`` (the hooked methods' signatures name their arguments)."""

    def __init__(self, running: _Batch, waiting: List[_Req]):
        self.running_batch, self.waiting_queue, self.chunked_req, self.last_batch = running, waiting, None, None
        self.tree_cache, self.token_to_kv_pool_allocator, self.max_total_num_tokens = _Tree(), _Allocator(), 100000

    def get_next_batch_to_run(self, running_batch: Any, last_batch: Any) -> Any: ...

    def update_running_batch(self, batch: Any) -> Any: ...

    def _get_new_batch_prefill_raw(self, running_batch: Any = None) -> Any: ...


class _Plan:
    def __init__(self, batch: _Batch, running: _Batch):
        self.batch_to_run, self.running_batch = batch, running


class _Query:
    """A live search as T2 sees it, with a fixed demand and ``inflight`` primaries in flight."""

    def __init__(self, i: int, candidates: int, inflight: int = 0):
        self.search_id, self.version = f"q{i}", 0
        self.inflight = {f"q{i}-p{j}" for j in range(inflight)}
        self.d = QueryDemand(self.search_id, candidates, 0.3 + 0.01 * i, 1e4, 1e6)

    def should_stop(self) -> bool:
        return False

    def demand_key(self) -> Any:
        return self.version

    def demand(self) -> QueryDemand:
        return self.d


def _best_us(fn: Callable[[], Any], repeats: int, inner: int = 1000) -> float:
    """The least process CPU time of one call, over ``repeats`` runs of ``inner`` calls (µs)."""
    out = []
    for _ in range(repeats):
        t0 = time.process_time()
        for _ in range(inner):
            fn()
        out.append(1e6 * (time.process_time() - t0) / inner)
    return min(out)


def micro_hooks(repeats: int = 7, running: int = 80, waiting: int = 12, searches: int = 64) -> Dict[str, float]:
    """CPU µs of one scheduler step's hooks on fake requests (``running`` in the running batch, a third
    speculative; ``waiting`` waiting; a live curve that has seen 80 batch sizes) and of one T2 re-split at
    ``searches`` live searches (7 with candidates): computed, and answered from the round's last split."""
    from sglang.srt.model_executor.forward_batch_info import ForwardMode

    from sglang_spex.adapters import scheduler as sa
    from sglang_spex.srt import batch_stats, census, prefix_protection, scheduling

    rng = random.Random(0)
    run = _Batch([_Req(i, i % 3 == 0, f"s{rng.randrange(64)}") for i in range(running)], ForwardMode.DECODE)
    for r in run.reqs[::6]:  # half the speculative requests sure
        r.sampling_params.custom_params["spex_sure"] = True
    queue = [_Req(1000 + i, i % 2 == 0, f"s{rng.randrange(64)}") for i in range(waiting)]
    sched = _Scheduler(run, queue)
    state = scheduling.SpexSchedulerState(budget=running, knee=None)  # room for all: nothing is retracted
    sa.attach_state(sched, state)
    for i in range(80 * 20):
        state.curve.add(1 + i % 80, 0.01 + 0.0001 * (i % 80))
    prefill = _Batch(queue[:6], ForwardMode.EXTEND)
    out: Dict[str, float] = {}
    with tempfile.TemporaryDirectory() as tmp:
        state.stats = batch_stats.StatsWriter(str(Path(tmp) / "ring"))
        try:
            out["publish_decode"] = _best_us(lambda: batch_stats.h_publish(_Plan(run, run), sched), repeats)
            out["publish_prefill"] = _best_us(lambda: batch_stats.h_publish(_Plan(prefill, run), sched), repeats)
            out["cap_decode"] = _best_us(lambda: scheduling.h_cap_decode(sched, run), repeats)
            out["cap_prefill"] = _best_us(lambda: scheduling.h_cap_prefill(lambda *a, **k: None, sched, run), repeats)
            out["pre_step"] = _best_us(lambda: scheduling.h_pre_step(sched, run, None), repeats)
            out["protect_pre_step"] = _best_us(lambda: prefix_protection.h_pre_step(sched, run, None), repeats)
            out["census_decode"] = _best_us(lambda: census.census(sched, run, full=False), repeats)
            out["census_prefill"] = _best_us(lambda: census.census(sched, run), repeats)
        finally:
            state.stats.close()
    budget = SpecBudget(16, max_wait_s=1e9)
    queries = [_Query(i, 4 if i % 9 == 0 else 0) for i in range(searches)]
    for q in queries:
        budget.register(q)

    async def resplits(changed: bool, n: int = 200) -> float:
        """CPU µs of one re-split within an event-loop round."""
        budget.share(queries[1])
        t0 = time.process_time()
        for _ in range(n):
            queries[1].version += 1  # its share (0) was held by its C_q (0): the round splits again
            if changed:
                queries[0].d = QueryDemand("q0", 4, rng.random(), 1e4, 1e6)
            budget.share(queries[1])
        return 1e6 * (time.process_time() - t0) / n

    for changed in (True, False):
        key = "t2_resplit_" + ("new_inputs" if changed else "same_inputs")
        out[key] = min(asyncio.run(resplits(changed)) for _ in range(repeats))
    out["t2_new_round"] = min(asyncio.run(_new_rounds(searches)) for _ in range(repeats))
    out["t2_split_spex"] = min(asyncio.run(_spex_splits(searches)) for _ in range(max(3, repeats // 2)))
    return out


async def _new_rounds(searches: int, n: int = 200) -> float:
    """CPU µs of the first refill of an event-loop round at ``searches`` searches with primaries in flight (the
    room below the knee is read again: the searches' in-flight primaries and the engine's load), one primary
    finishing and one starting per round."""
    budget = SpecBudget(4 * searches, max_wait_s=1e9, engine_primary=lambda: 0)
    queries = [_Query(i, 4 if i % 9 == 0 else 0, inflight=1 + i % 3) for i in range(searches)]
    for q in queries:
        budget.register(q)
    budget.share(queries[1])
    t0 = time.process_time()
    for i in range(n):
        await asyncio.sleep(0)  # a new round
        q = queries[i % searches]
        q.inflight.discard(f"{q.search_id}-p0")
        q.inflight.add(f"{q.search_id}-p0")
        budget.share(queries[1])
    return 1e6 * (time.process_time() - t0) / n


class _StallPort(EnginePort):
    """An engine port that answers the first ``answer`` requests at once and then never again: the searches stop
    mid-search, with primaries and speculative requests in flight."""

    def __init__(self, answer: int):
        self.answer = answer

    async def generate(self, req: Any) -> Any:
        if self.answer <= 0:
            await asyncio.Event().wait()
        self.answer -= 1
        rng = random.Random(req.seed)
        a, b = rng.randint(1, 9), rng.randint(1, 9)
        text = f"{a} + {b} = {a + b}." + (" The answer is 5." if rng.random() < 0.3 else "")
        return GenResult(req.rid, text, [1] * 5, "stop", "\n\n", [-0.5] * 5, 40, 5, 0)

    async def abort(self, rid_or_prefix: str) -> None: ...


async def _spex_splits(searches: int, n: int = 40) -> float:
    """CPU µs of one T2 split over ``searches`` real rSTAR ``SpexContext`` searches stopped mid-search, every one of
    them with a new demand key (as after each one's node finished): their demands, re-planned where a plan ran out,
    and the split."""
    spec = SearchSpec.from_dict(
        {"policy": POLICY, "step": STEP, "reward": {"type": "verifier", "name": "arith"}, "seed": 3}
    )
    cfg = SpexConfig(enabled=True, k_total=16, components=("t1", "t2"))
    budget = SpecBudget(16 * searches, max_wait_s=1e9)  # room for a split whatever is in flight
    make = context_factory(cfg, budget)
    port = _StallPort(answer=6 * searches)
    ctxs = [make(spec, f"What is {i} + {7 * i + 3}?", port) for i in range(searches)]
    tasks = [asyncio.ensure_future(c.run()) for c in ctxs]
    for _ in range(50):
        await asyncio.sleep(0)
    t0 = time.process_time()
    for _ in range(n):
        for c in ctxs:
            c._version += 1  # every search moved on since the last split
        budget._end_round()
        budget.share(ctxs[0])
    took = 1e6 * (time.process_time() - t0) / n
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    return took


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
    ap.add_argument("--skip-live", action="store_true", help="only the in-process micro-benchmarks (no server)")
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
    data["micro_hooks_us"] = micro_hooks()
    print(
        "micro: CPU us of one step's hooks (80 running, 12 waiting), the gate's census, and T2 (64 searches: a "
        "re-split, a new round's first refill, a split over real stalled searches); best of 7"
    )
    print("  " + ", ".join(f"{k} {v:.1f}" for k, v in data["micro_hooks_us"].items()))
    if args.skip_live:
        return data
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
    keys = ("step_ms", "plan_ms_per_step", "plan_us_per_plan", "pump_ms_per_step", "pump_cpu_ms_per_step")
    keys += ("share_ms_per_step", "hook_ms_per_step")
    summary: Dict[str, Any] = {}
    shares = ("control_share", "control_share_pump_cpu", "hook_share")
    for n in args.searches:
        mine = [r for r in runs if r["searches"] == n]
        summary[str(n)] = {k: spread([r[k] for r in mine]) for k in (*keys, *shares)}
        parts = sorted({k for r in mine for k in r if k.startswith("hook_ms_per_step.")})
        summary[str(n)]["hook_parts"] = {k.split(".", 1)[1]: spread([r.get(k, 0.0) for r in mine]) for k in parts}
    data.update(runs=runs, summary=summary, target_share=TARGET_SHARE)
    print("live: per scheduler step, median (min-max) over repeats")
    print(
        f"{'searches':>8} {'step ms':>18} {'plan ms':>18} {'pump ms':>18} {'pump CPU ms':>18} {'T2 share ms':>18} "
        f"{'hooks ms':>18} {'control %':>18} {'control % (pump CPU)':>21}"
    )
    for n, s in summary.items():
        pct = {k: {m: 100 * v if isinstance(v, float) else v for m, v in s[k].items()} for k in shares}
        print(
            f"{n:>8} {fmt(s['step_ms'], 2):>18} {fmt(s['plan_ms_per_step'], 3):>18} "
            f"{fmt(s['pump_ms_per_step'], 3):>18} {fmt(s['pump_cpu_ms_per_step'], 3):>18} "
            f"{fmt(s['share_ms_per_step'], 3):>18} {fmt(s['hook_ms_per_step'], 3):>18} "
            f"{fmt(pct['control_share'], 2):>18} {fmt(pct['control_share_pump_cpu'], 2):>21}"
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
