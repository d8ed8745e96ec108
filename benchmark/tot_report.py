"""bench_tot's aggregation and tables: per (policy, concurrency, mode) medians, min-max ratios against the baseline of
the same repeat, the priced schedule (:mod:`step_cost`), latency percentiles, and where the time went."""

from __future__ import annotations

import statistics
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np
from step_cost import StepPrice, fit_price


def steps_bound(paths: Sequence[int], concurrency: int) -> float:
    """A lower bound on a run's decode steps: each query needs its critical path, ``concurrency`` at a time."""
    return max(max(paths, default=0), sum(paths) / max(concurrency, 1))


def decode_steps(trace: Dict[str, Any]) -> int:
    """A run's steps that decode (plain decode steps and mixed prefill+decode steps), timed or not. The trace's
    ``decode_steps``/``mixed_steps`` count only steps whose time is known, and the step before every idle gap never
    gets one (its time is written with the next step), so they drop a step per gap; the compacted step rows keep
    every step (``decode_rows`` > 0: the step decodes). Traces without step rows: the timed count."""
    timed = int(trace.get("decode_steps", 0)) + int(trace.get("mixed_steps", 0))
    rows = trace.get("step_rows") or ()
    return max(timed, sum(1 for s in rows if s and s[0] > 0))


def path_steps(row: Dict[str, Any]) -> List[int]:
    """Each query's critical path in decode steps, Σ (tokens − 1) along its longest chain (bench_tot's
    ``critical_path_steps``; runs recorded before it: ``critical_path_tokens``, which also counts every node's
    first token, the one its prefill makes, and so overstates the bound by up to the depth)."""
    return row.get("critical_path_steps") or row.get("critical_path_tokens") or []


def run_flags(row: Dict[str, Any]) -> List[str]:
    """Why a run's timing cannot be trusted: searches that did not end ``done``, nodes that failed, a radix cache
    it could not flush, batch-stats rows lost from the ring (its schedule is truncated), the roofline profiler
    running during it."""
    flags = []
    statuses = row.get("statuses") or ()
    if row.get("failed_searches") or any(s != "done" for s in statuses):
        flags.append("failed")
    if row.get("node_failures"):
        flags.append("node_failures")
    if row.get("flush_wait_s") == "unflushed":
        flags.append("unflushed")
    if (row.get("trace") or {}).get("rows_lost"):
        flags.append("rows_lost")
    if row.get("reprofiled"):
        flags.append("reprofiled")
    return flags


def percentile(xs: Sequence[float], q: float) -> Optional[float]:
    return round(float(np.percentile(np.asarray(xs, dtype=float), q)), 3) if len(xs) else None


def _tps(row: Dict[str, Any]) -> float:
    """Search tokens per second of a run (its trees' tokens over its wall time)."""
    return row["tokens"] / row["wall_s"] if row.get("wall_s") else 0.0


def _time_split(rs: List[Dict[str, Any]], conc: int) -> Dict[str, Any]:
    """Where a cell's time went (medians over repeats): steps that decode (plain and mixed) and their mean time,
    prefill-only seconds, and the decode-step bound of its trees (:func:`steps_bound`; the baseline's steps over it
    bound any speedup that comes from running fewer decode steps)."""
    traced = [r["trace"] for r in rs if r.get("trace") and r["trace"].get("decode_steps")]
    if not traced:
        return {}
    med = statistics.median

    def timed(t: Dict[str, Any]) -> int:  # timed steps that decode: plain decode steps and mixed prefill+decode
        return t["decode_steps"] + t.get("mixed_steps", 0)

    out = {
        "decode_steps": med(decode_steps(t) for t in traced),  # every step that decodes, timed or not
        "decode_ms": round(med(1e3 * (t["decode_s"] + t.get("mixed_s", 0.0)) / timed(t) for t in traced), 1),
        "prefill_s": round(med(t["prefill_s"] - t.get("mixed_s", 0.0) for t in traced), 2),
        "mean_decode_batch": round(med(t["mean_decode_batch"] for t in traced), 2),
    }
    cpu = [t["cpu_s"] for t in traced if t.get("cpu_s")]
    if cpu:  # CPU seconds per server process role (sched_trace.cpu_seconds)
        out["cpu_s"] = {k: round(med(c.get(k, 0.0) for c in cpu), 2) for k in sorted({k for c in cpu for k in c})}
    bounds = [steps_bound(path_steps(r), conc) for r in rs if path_steps(r)]
    if bounds:
        out["steps_bound"] = round(med(bounds), 1)
    return out


def priced_bound(row: Dict[str, Any], cost_s: float, a_s: float, conc: int) -> Optional[float]:
    """The most a run's tree allows at one step price: its priced schedule over the same schedule with its decode
    steps cut to the critical-path bound (:func:`steps_bound`), each step cut saving the fixed price ``a_s``; every
    row, prefill and context token still paid. On a baseline run (the tree's work, nothing wasted) this bounds
    what any speculation can reach on this host, where a step costs more with every row it carries."""
    t, paths = row.get("trace") or {}, path_steps(row)
    if not paths or not t.get("decode_steps") or cost_s <= 0:
        return None
    cut = max(0.0, decode_steps(t) - steps_bound(paths, conc))
    return cost_s / max(cost_s - cut * a_s, 1e-9)


def tree_key(row: Dict[str, Any]) -> Tuple[Any, ...]:
    """What two runs that grew the same trees agree on: tokens generated and every answer."""
    return row["tokens"], tuple(row["answers"])


def summarise(rows: List[Dict[str, Any]], price: Optional[StepPrice] = None) -> List[Dict[str, Any]]:
    """One line per (policy, concurrency, mode): medians over repeats, the per-repeat ratio to the baseline of
    the same repeat (median, min, max), summed accounting, per-query p50/p99 completion time. ``price``: price the
    schedules at this step price instead of the one fitted over ``rows`` (another machine's).

    Flagged runs (:func:`run_flags`) are counted (``flagged``, ``flags``: runs per reason) and left out: a repeat
    enters the ratios only when both its run and the baseline's run of it are unflagged, and the medians are
    over the cell's unflagged runs (over all of them, marked, when every run is flagged). ``failed_searches``:
    searches of the cell that did not end ``done`` (they do not count as finished queries in q/min). A cell whose
    runs saw different k_totals (``k_totals``) or in which the profiler ran is flagged too (``k_total varied``,
    ``reprofiled``)."""
    flagged = {id(r): run_flags(r) for r in rows}
    clean = [r for r in rows if not flagged[id(r)]]
    base = {(r["policy"], r["concurrency"], r["repeat"]): r["q_per_min"] for r in clean if r["mode"] == "baseline"}
    price = price or step_price(rows)
    cost = {id(r): price.cost_s(r["trace"]["step_rows"]) for r in rows if price and "step_rows" in r.get("trace", {})}
    base_cost = {
        (r["policy"], r["concurrency"], r["repeat"]): cost.get(id(r)) for r in clean if r["mode"] == "baseline"
    }
    base_tps = {(r["policy"], r["concurrency"], r["repeat"]): _tps(r) for r in clean if r["mode"] == "baseline"}
    base_tree = {(r["policy"], r["concurrency"], r["repeat"]): tree_key(r) for r in clean if r["mode"] == "baseline"}
    cells: Dict[Tuple[str, int, str], List[Dict[str, Any]]] = {}
    for r in rows:
        cells.setdefault((r["policy"], r["concurrency"], r["mode"]), []).append(r)
    out = []
    for (policy, conc, mode), all_rs in cells.items():
        ok = [r for r in all_rs if not flagged[id(r)]]
        rs = ok or all_rs  # medians over the unflagged runs; over all of them when none is
        reasons: Dict[str, int] = {}
        for r in all_rs:
            for f in flagged[id(r)]:
                reasons[f] = reasons.get(f, 0) + 1
        k_totals = sorted({r["k_total"] for r in all_rs if r.get("k_total") is not None})
        if len(k_totals) > 1:
            reasons["k_total varied"] = len(k_totals)
        ratios = [
            r["q_per_min"] / base[(policy, conc, r["repeat"])] for r in ok if base.get((policy, conc, r["repeat"]))
        ]
        tps_ratios = [
            _tps(r) / base_tps[(policy, conc, r["repeat"])] for r in ok if base_tps.get((policy, conc, r["repeat"]))
        ]
        lat = [x for r in rs for x in r["latencies_s"]]
        spec = [r["speculation"] for r in rs if r["speculation"]]
        paired = [r for r in ok if (policy, conc, r["repeat"]) in base_tree]
        same = [tree_key(r) == base_tree[(policy, conc, r["repeat"])] for r in paired]
        cost_ratios = [
            base_cost[(policy, conc, r["repeat"])] / cost[id(r)]
            for r in ok
            if cost.get(id(r)) and base_cost.get((policy, conc, r["repeat"]))
        ]

        bounds = [
            b
            for r in rs
            if price and cost.get(id(r))
            for b in [priced_bound(r, cost[id(r)], price.coef[0], conc)]
            if b is not None
        ]

        def total(key: str) -> int:
            return int(sum(s.get(key, 0) for s in spec))

        out.append(
            {
                "policy": policy,
                "concurrency": conc,
                "mode": mode,
                "repeats": len(all_rs),
                "flagged": len(all_rs) - len(ok),
                "flags": dict(sorted(reasons.items())),
                "searches": sum(r.get("searches", len(r.get("latencies_s") or ())) for r in all_rs),
                "failed_searches": sum(r.get("failed_searches", 0) for r in all_rs),
                "k_totals": k_totals,
                "q_per_min": round(statistics.median(r["q_per_min"] for r in rs), 3),
                **_spread("ratio", ratios),
                "accuracy": round(statistics.mean(r["accuracy"] for r in rs), 3),
                "tokens": int(statistics.median(r["tokens"] for r in rs)),
                "tokens_per_s": round(statistics.median(_tps(r) for r in rs), 2),
                "tokens_per_s_ratio": round(statistics.median(tps_ratios), 3) if tps_ratios else None,
                "same_tree": f"{sum(same)}/{len(same)}",
                **_spread("cost_ratio", cost_ratios),
                **_time_split(rs, conc),
                "priced_bound": round(statistics.median(bounds), 2) if bounds else None,
                "hits": total("hits"),
                "issued": total("issued"),
                "wasted_tokens": total("wasted_tokens"),
                "spec_tokens": total("spec_tokens"),
                "early_stops": total("early_stops"),
                "latency_p50_s": percentile(lat, 50),
                "latency_p99_s": percentile(lat, 99),
            }
        )
    return out


def step_price(rows: List[Dict[str, Any]]) -> Optional[StepPrice]:
    """One step price over every traced run of the benchmark, all modes (:mod:`step_cost`)."""
    return fit_price(r["trace"]["step_rows"] for r in rows if "step_rows" in r.get("trace", {}))


def _spread(key: str, xs: List[float]) -> Dict[str, Optional[float]]:
    """``key``, ``key_min``, ``key_max``: median, min and max of ``xs`` (None when empty)."""
    vals = (statistics.median(xs), min(xs), max(xs)) if xs else (None, None, None)
    return {k: None if v is None else round(v, 3) for k, v in zip((key, f"{key}_min", f"{key}_max"), vals)}


def print_table(summary: List[Dict[str, Any]]) -> None:
    """The summary, one line per cell; ``failed``: searches that did not end done / searches; ``flagged``: runs
    left out of the cell's medians and ratios / runs (their reasons are listed under the table)."""
    print(
        f"\n{'policy':10} {'conc':>4} {'mode':12} {'q/min':>7} {'ratio (min-max)':>18} {'acc':>5} {'tokens':>7} "
        f"{'tok/s x':>7} {'same tree':>9} {'hits/issued':>12} {'wasted':>7} {'p50 s':>7} {'p99 s':>7} "
        f"{'priced x (min-max)':>18} {'failed':>7} {'flagged':>7}"
    )

    def fmt(s: Dict[str, Any], key: str) -> str:
        return f"{s[key]:.2f} ({s[key + '_min']:.2f}-{s[key + '_max']:.2f})" if s.get(key) is not None else "-"

    for s in summary:
        ratio = fmt(s, "ratio")
        hits = f"{s['hits']}/{s['issued']}" if s["issued"] else "-"
        print(
            f"{s['policy']:10} {s['concurrency']:>4} {s['mode']:12} {s['q_per_min']:>7.2f} {ratio:>18} "
            f"{s['accuracy']:>5.2f} {s['tokens']:>7} {s['tokens_per_s_ratio'] or 0:>7.2f} {s.get('same_tree', '-'):>9} {hits:>12} {s['wasted_tokens']:>7} "
            f"{s['latency_p50_s']:>7} {s['latency_p99_s']:>7} {fmt(s, 'cost_ratio'):>18} "
            f"{_count(s, 'failed_searches', 'searches'):>7} {_count(s, 'flagged', 'repeats'):>7}"
        )
    flagged = [s for s in summary if s.get("flags")]
    for s in flagged:
        why = ", ".join(f"{k} {v}" if k == "k_total varied" else f"{k} x{v}" for k, v in s["flags"].items())
        kt = f" (k_total {'/'.join(map(str, s['k_totals']))})" if len(s.get("k_totals") or ()) > 1 else ""
        print(f"flagged: {s['policy']} conc {s['concurrency']} {s['mode']}: {why}{kt}")
    if flagged:
        print("(flagged runs are left out of the ratios, for both modes of their repeat; the runs' rows keep them)")


def _count(s: Dict[str, Any], key: str, total: str) -> str:
    """``key/total`` of a summary line ("-" for a summary written before the key existed)."""
    return f"{s[key]}/{s[total]}" if key in s and total in s else "-"


def print_time_split(summary: List[Dict[str, Any]]) -> None:
    """Where the time goes, per cell: baseline vs SPEX steps that decode, ms per such step, mean decode batch,
    prefill-only seconds, the critical-path bound on decode steps (baseline steps / bound = the most that fewer
    steps could give; ``priced max x``: the same at the step price, :func:`priced_bound` of the baseline's runs),
    and the CPU seconds of the server's launcher process (HTTP, TokenizerManager, server-side
    searches) and scheduler: on a host with few cores the launcher's work slows the scheduler's steps."""
    base = {(s["policy"], s["concurrency"]): s for s in summary if s["mode"] == "baseline"}
    print(
        f"\n{'policy':10} {'conc':>4} {'mode':12} {'decode steps':>14} {'ms/step':>13} {'batch':>11} "
        f"{'prefill s':>13} {'path bound':>10} {'max x':>6} {'priced max x':>12} {'CPU s: launcher':>16} "
        f"{'scheduler':>13}"
    )
    for s in summary:
        b = base.get((s["policy"], s["concurrency"]))
        if s["mode"] == "baseline" or b is None or "decode_steps" not in s or "decode_steps" not in b:
            continue
        bound = b.get("steps_bound")
        best = f"{b['decode_steps'] / bound:.2f}" if bound else "-"
        print(
            f"{s['policy']:10} {s['concurrency']:>4} {s['mode']:12} {b['decode_steps']:>6g} -> {s['decode_steps']:<5g} "
            f"{b['decode_ms']:>5} -> {s['decode_ms']:<5} {b['mean_decode_batch']:>4} -> {s['mean_decode_batch']:<4} "
            f"{b['prefill_s']:>5} -> {s['prefill_s']:<5} {bound or '-':>10} {best:>6} {b.get('priced_bound') or '-':>12} "
            f"{_cpu(b, s, 'tokenizer_manager'):>16} {_cpu(b, s, 'scheduler'):>13}"
        )


def _cpu(base: Dict[str, Any], spex: Dict[str, Any], role: str) -> str:
    """``base -> spex`` CPU seconds of one server process role ("-" when not measured)."""
    b, x = (base.get("cpu_s") or {}).get(role), (spex.get("cpu_s") or {}).get(role)
    return "-" if b is None or x is None else f"{b:g} -> {x:g}"
