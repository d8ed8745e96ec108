"""T2's softmax temperature τ (``--tot-budget-temperature``): what it changes, on the simulator.

T2 splits k_total over the live queries by softmax(score/τ) (``speculation/budget.py``): a small τ gives nearly
all of the budget to the best-scoring queries (hit rate, cached prefix), a large one splits it evenly. The effect
only shows where the budget binds (k_total below what the live queries could issue), so the default k_total here
is small. Per (policy, concurrency, seed): the baseline, T1 alone (an even split, no T2) and T1+T2 at each τ,
pure scheduling (T3 off: the same search). Every question's latency is virtual seconds from its start to its
result (a stream: ``--questions-per-slot`` questions per concurrency slot), so the table shows what τ does to
throughput and to the per-query p50/p99 that the starvation bound (``--tot-min-share``, max wait) protects.

    .venv/bin/python benchmark/bench_t2_temperature.py                     # ~3 min
    .venv/bin/python benchmark/bench_t2_temperature.py --policies rstar-10 --batch-sizes 8 --k-total 8
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

import simbench as sb
from tqdm import tqdm

from sglang_spex.config import SpexConfig
from sglang_spex.speculation.budget import QueryDemand, split_budget


def modes(
    temperatures: Sequence[float], bounds: Sequence[Tuple[int, float]] = ()
) -> Dict[str, Optional[Dict[str, Any]]]:
    """Mode name -> SpexConfig overrides (None = baseline); ``bounds``: (min share, max wait s) starvation bounds,
    each a T2 mode at the default τ."""
    out: Dict[str, Optional[Dict[str, Any]]] = {"baseline": None, "T1 (even split)": sb.ABLATION_MODES["T1"]}
    t2 = dict(components=("t1", "t2"), early_stop=False)
    for tau in temperatures:
        out[f"T2 tau={tau:g}"] = dict(t2, budget_temperature=tau)
    for share, wait in bounds:
        out[f"T2 min{share} wait{wait:g}s"] = dict(t2, min_share=share, budget_max_wait_s=wait)
    return out


def parse_bounds(text: str) -> List[Tuple[int, float]]:
    """``"1/0.5,2/2"`` -> [(1, 0.5), (2, 2.0)]: min share / max wait in seconds."""
    out = []
    for item in sb.parse_list(text):
        share, _, wait = item.partition("/")
        if not wait:
            raise SystemExit(f"--bounds: {item!r} is not MIN_SHARE/MAX_WAIT_S")
        out.append((int(share), float(wait)))
    return out


# The split alone, for four queries that differ only in their running hit rate P_q (same context, same cached
# prefix, every query able to take the whole budget): what τ does to the shares themselves.
SHARE_HIT_RATES = (0.9, 0.6, 0.3, 0.1)


def share_table(temperatures: Sequence[float], k_total: int, min_share: int) -> List[Dict[str, Any]]:
    demands = [QueryDemand(f"P_q={p:g}", candidates=k_total, hit_rate=p) for p in SHARE_HIT_RATES]
    return [
        {"tau": tau, **split_budget(demands, k_total, temperature=tau, min_share=min_share)} for tau in temperatures
    ]


def spread(values: Sequence[float], fmt: str = "{:.2f}") -> str:
    """median (min–max)"""
    if not values:
        return "–"
    med = statistics.median(values)
    return f"{fmt.format(med)} ({fmt.format(min(values))}–{fmt.format(max(values))})"


def summarise(rows: List[Dict[str, Any]], names: Sequence[str]) -> List[Dict[str, Any]]:
    """One line per (policy, concurrency, mode): over seeds, the speedup, hit rate, p50/p99 latency ratios."""
    base = {(r["policy"], r["concurrency"], r["seed"]): r for r in rows if r["mode"] == "baseline"}
    out = []
    for policy in dict.fromkeys(r["policy"] for r in rows):
        for conc in sorted({r["concurrency"] for r in rows if r["policy"] == policy}):
            for name in names:
                cell = [r for r in rows if (r["policy"], r["concurrency"], r["mode"]) == (policy, conc, name)]
                pairs = [(r, base[(policy, conc, r["seed"])]) for r in cell]
                spec = [r["speculation"] or {} for r in cell]
                out.append(
                    {
                        "policy": policy,
                        "concurrency": conc,
                        "mode": name,
                        "speedup": [r["q_per_min"] / b["q_per_min"] for r, b in pairs],
                        "p50_ratio": [r["latency_p50_s"] / b["latency_p50_s"] for r, b in pairs],
                        "p99_ratio": [r["latency_p99_s"] / b["latency_p99_s"] for r, b in pairs],
                        "issued": [s.get("issued", 0) for s in spec],
                        "hit_rate": [s["hit_rate"] for s in spec if s.get("hit_rate") is not None],
                        "by_policy": program_ratios(pairs),
                    }
                )
    return out


def program_ratios(pairs: Sequence[Tuple[Dict[str, Any], Dict[str, Any]]]) -> Optional[Dict[str, Dict[str, list]]]:
    """A mix: per program, its questions' p50/p99 latency over the baseline's (per seed) and its issue count."""
    if not pairs or not pairs[0][0].get("by_policy"):
        return None
    out: Dict[str, Dict[str, list]] = {}
    for r, b in pairs:
        for policy, mine in r["by_policy"].items():
            theirs = b["by_policy"][policy]
            o = out.setdefault(policy, {"p50_ratio": [], "p99_ratio": [], "issued": []})
            o["p50_ratio"].append(mine["latency_p50_s"] / theirs["latency_p50_s"])
            o["p99_ratio"].append(mine["latency_p99_s"] / theirs["latency_p99_s"])
            o["issued"].append(mine["issued"])
    return out


def plot(summary: List[Dict[str, Any]], temperatures: Sequence[float], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    policies = list(dict.fromkeys(s["policy"] for s in summary))
    fig, axes = plt.subplots(2, len(policies), figsize=(5.2 * len(policies), 6.4), squeeze=False)
    for col, policy in enumerate(policies):
        for conc in sorted({s["concurrency"] for s in summary if s["policy"] == policy}):
            get = {s["mode"]: s for s in summary if (s["policy"], s["concurrency"]) == (policy, conc)}
            cells = [get[f"T2 tau={t:g}"] for t in temperatures]
            for row, key, label in ((0, "speedup", "speedup (q/min)"), (1, "p99_ratio", "p99 latency / baseline")):
                ax = axes[row][col]
                line = ax.plot(temperatures, [statistics.median(c[key]) for c in cells], marker="o", label=f"{conc} q")
                ax.axhline(statistics.median(get["T1 (even split)"][key]), color=line[0].get_color(), ls=":", lw=0.8)
                ax.set_xscale("log")
                ax.set_xlabel("T2 temperature τ (dotted: T1, even split)")
                ax.set_ylabel(label)
                ax.set_title(policy.upper())
        axes[0][col].legend(fontsize=7)
    sb.save_figure(fig, path, title)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--policies",
        default="rstar-10,rebase-16",
        help="presets; a+b runs a mix on one engine (question i: part i %% parts), e.g. rstar-10+rebase-16",
    )
    ap.add_argument("--batch-sizes", default="4,8,16")
    ap.add_argument("--temperatures", default="0.05,0.25,1,4")
    ap.add_argument(
        "--bounds",
        default="",
        help="starvation bounds to add as T2 modes at the default τ, MIN_SHARE/MAX_WAIT_S, comma-separated "
        "(e.g. 0/2,2/0.5; the default bound is 1/%g)" % SpexConfig().budget_max_wait_s,
    )
    ap.add_argument("--k-total", type=int, default=16, help="the global budget (small, so that T2 has to choose)")
    ap.add_argument("--questions-per-slot", type=int, default=2, help="questions per run = this x concurrency")
    ap.add_argument("--seeds", default="0,1,2", help="one workload per seed; cells show median (min–max)")
    ap.add_argument(
        "--reward-noise-spread",
        type=float,
        default=0.0,
        help="per-question reward noise, log-normal around the workload's (0: the same for every question; >0: "
        "questions with different hit rates, where T2 has something to choose between)",
    )
    ap.add_argument("--device", default="A100-80G")
    ap.add_argument("--model", default="Llemma-7B")
    ap.add_argument("--out", default="benchmark/results/t2_temperature.json")
    ap.add_argument("--plot", default="benchmark/results/t2_temperature.png")
    args = ap.parse_args()
    t0 = time.monotonic()
    temperatures = sb.parse_list(args.temperatures, float)
    table = modes(temperatures, parse_bounds(args.bounds))
    policies, sizes, seeds = (
        sb.parse_list(args.policies),
        sb.parse_list(args.batch_sizes, int),
        sb.parse_list(args.seeds, int),
    )
    runs = [(p, b, s, m) for p in policies for b in sizes for s in seeds for m in table]
    rows = []
    for preset, conc, seed, name in tqdm(runs, desc="t2 temperature sim"):
        n = args.questions_per_slot * conc
        workload = sb.workload_for(preset, seed=seed, reward_noise_spread=args.reward_noise_spread)
        row = sb.run_mode(
            preset,
            table[name],
            cost=(args.device, args.model),
            questions=n,
            concurrency=conc,
            seed=seed,
            k_total=args.k_total,
            workload=workload,
        )
        rows.append({"policy": preset, "concurrency": conc, "seed": seed, "mode": name, "questions": n, **row})
    summary = summarise(rows, [m for m in table if m != "baseline"])
    title = f"T2 temperature (simulator {args.device} + {args.model}, k_total {args.k_total}"
    title += f", reward noise spread {args.reward_noise_spread:g})" if args.reward_noise_spread else ")"
    print(f"\n{title}; median (min–max) over seeds {args.seeds}")
    w = max(10, *(len(p) for p in policies))
    head = f"{'policy':{w}} {'q':>3} {'mode':16} {'speedup':>18} {'p50/base':>18} {'p99/base':>18} {'issued':>8} {'hit rate':>8}"
    print(head)
    for s in summary:
        print(
            f"{s['policy']:{w}} {s['concurrency']:>3} {s['mode']:16} {spread(s['speedup']):>18} "
            f"{spread(s['p50_ratio']):>18} {spread(s['p99_ratio']):>18} {statistics.median(s['issued']):>8.0f} "
            f"{spread(s['hit_rate']) if s['hit_rate'] else '–':>8}"
        )
        for policy, part in (s["by_policy"] or {}).items():
            print(
                f"{'':{w}} {'':>3} {'  ' + policy:16} {'':>18} {spread(part['p50_ratio']):>18} "
                f"{spread(part['p99_ratio']):>18} {statistics.median(part['issued']):>8.0f}"
            )
    shares = share_table(temperatures, args.k_total, SpexConfig().min_share)
    print(
        f"\nT2 shares of k_total {args.k_total} for four queries that differ only in P_q (min share {SpexConfig().min_share})"
    )
    print(f"{'tau':>6}" + "".join(f" {k:>9}" for k in shares[0] if k != "tau"))
    for line in shares:
        print(f"{line['tau']:>6g}" + "".join(f" {v:>9}" for k, v in line.items() if k != "tau"))
    plot(summary, temperatures, Path(args.plot), title)
    sb.write_results(
        args.out,
        f"simulator {args.device}/{args.model}",
        args,
        t0,
        args.plot,
        rows=rows,
        summary=summary,
        shares=shares,
    )


if __name__ == "__main__":
    main()
