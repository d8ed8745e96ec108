"""Fig 10: questions/min, baseline vs SPEX, for REST/rSTAR (DFS) and REBASE/ETS (BFS) across query batch sizes.

Simulator (A100-80G + Llemma-7B roofline, virtual time): for each policy preset and batch size runs the baseline,
SPEX with pure scheduling (T1+T2, early stop off: the identical search, same answers) and SPEX with T3 early stop
on, and reports the two SPEX gains apart. ``--real`` also runs a small subset on the real CPU SGLang server
(SmolLM2-135M) with bench_tot's runner. Writes JSON and a PNG under benchmark/results/.

    .venv/bin/python benchmark/bench_fig10.py                       # full grid, ~1-2 min
    .venv/bin/python benchmark/bench_fig10.py --policies rstar-5 --batch-sizes 1,4
    .venv/bin/python benchmark/bench_fig10.py --real --real-policies rebase-8,rstar-5 --real-concurrency 1,4
"""

from __future__ import annotations

import argparse
import asyncio
import time
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional

import simbench as sb
from overlap import stop_servers_on_sigterm
from tqdm import tqdm

from sglang_spex.sim.cost import RooflineCost

MODE_LABELS = {
    "baseline": "baseline",
    "spex_sched": "SPEX (T1+T2, pure scheduling)",
    "spex_t3": "SPEX (+T3 early stop)",
}


def sim_rows(args: argparse.Namespace) -> List[Dict[str, Any]]:
    policies = sb.parse_list(args.policies)
    sizes = sb.parse_list(args.batch_sizes, int)
    runs = [(p, b, m) for p in policies for b in sizes for m in sb.SPEX_MODES]
    rows = []
    for preset, bs, mode in tqdm(runs, desc="fig10 sim"):
        n = max(args.min_questions, args.questions_per_batch * bs)
        row = sb.run_mode(
            preset,
            sb.SPEX_MODES[mode],
            cost=(args.device, args.model),
            questions=n,
            concurrency=bs,
            seed=args.seed,
            k_total=args.k_total,
            lookahead=args.lookahead,
            max_lookahead=args.max_lookahead,
            bfs_lookahead=args.bfs_lookahead,
            gate=not args.no_gate,
            mixed=not args.no_mixed,
            reward_latency_s=args.reward_latency_ms / 1000.0,
        )
        rows.append({"source": "sim", "policy": preset, "concurrency": bs, "mode": mode, "questions": n, **row})
    sb.add_ratios(rows)
    return rows


# The bench_tot modes the real subset runs, named as this figure's modes (its table and plot show these three;
# bench_tot's other modes, e.g. the payoff gate, are not part of Fig 10).
REAL_MODES = {"baseline": "baseline", "spex_t1t2": "spex_sched", "spex_t1t2t3": "spex_t3"}


def real_modes(available: Dict[str, Any]) -> Dict[str, Any]:
    """``{bench_tot mode: its speculation settings}`` for :data:`REAL_MODES`, taken from bench_tot's ``MODES``
    (``available``); exits with a message naming the missing ones before any run when bench_tot lacks one."""
    missing = [m for m in REAL_MODES if m not in available]
    if missing:
        raise SystemExit(
            f"bench_fig10 --real: bench_tot.MODES has no {missing} (it has {sorted(available)}); update REAL_MODES"
        )
    return {m: available[m] for m in REAL_MODES}


def real_rows(
    args: argparse.Namespace, on_row: Optional[Callable[[List[Dict[str, Any]]], None]] = None
) -> List[Dict[str, Any]]:
    """The subset on the real CPU server, through bench_tot's client-side runner, in the modes of
    :data:`REAL_MODES` (baseline, T1+T2, T1+T2+T3). ``on_row(rows)`` is called after every run with the rows so
    far (speedups added), so a run cut short keeps what it measured."""
    import bench_tot

    from sglang_spex.serve import ServerProcess
    from sglang_spex.tot.tasks import get_task

    modes = real_modes(bench_tot.MODES)
    questions = get_task("toy_add").questions(args.real_questions, split="test", seed=args.seed)
    server = None if args.url else ServerProcess(["--tot-speculation", "--tot-k-total", str(args.real_k_total)]).start()
    url = args.url or server.url
    rows: List[Dict[str, Any]] = []
    try:
        policies = sb.parse_list(args.real_policies)
        for preset in policies:  # warm-up, not measured
            spec = bench_tot.build_spec(preset, 1, 4, args.seed + 1)
            asyncio.run(bench_tot.run_mode(url, spec, questions[:1], 1, None, args.real_k_total))
        runs = [(p, c, m) for p in policies for c in sb.parse_list(args.real_concurrency, int) for m in modes]
        for preset, conc, mode in tqdm(runs, desc="fig10 real"):
            spec = bench_tot.build_spec(preset, args.real_max_depth, args.real_step_tokens, args.seed)
            row = asyncio.run(bench_tot.run_mode(url, spec, questions, conc, modes[mode], args.real_k_total))
            rows.append(
                {
                    "source": "real",
                    "policy": preset,
                    "concurrency": conc,
                    "mode": REAL_MODES[mode],
                    "questions": len(questions),
                    **row,
                }
            )
            if on_row is not None:
                sb.add_ratios(rows)
                on_row(rows)
    finally:
        if server is not None:
            server.stop()
    sb.add_ratios(rows)
    return rows


def print_table(rows: List[Dict[str, Any]], title: str) -> None:
    sizes = sorted({r["concurrency"] for r in rows})
    get = {(r["policy"], r["concurrency"], r["mode"]): r for r in rows}
    print(f"\n{title}\n{'policy':10} {'mode':11}" + "".join(f" {'bs=' + str(b):>14}" for b in sizes))
    for preset in dict.fromkeys(r["policy"] for r in rows):
        for mode in ("baseline", "spex_sched", "spex_t3"):
            cells = []
            for b in sizes:
                r = get.get((preset, b, mode))
                if r is None:
                    cells.append(f" {'-':>14}")
                elif mode == "baseline":
                    cells.append(f" {r['q_per_min']:>8.2f} q/min")
                else:
                    cells.append(f" {sb.fmt_speedup(r['speedup'])} {r['q_per_min']:>7.2f}")
            print(f"{preset:10} {mode:11}" + "".join(cells))


def print_why(rows: List[Dict[str, Any]], step_s: float) -> List[Dict[str, Any]]:
    """Batch-1 diagnosis: requests per question, hits, hit rate by distance, Amdahl and critical-path bounds."""
    get = {(r["policy"], r["concurrency"], r["mode"]): r for r in rows}
    out = []
    print(
        f"\nwhy (batch 1, pure scheduling) {'req/q':>6} {'depth':>5} {'hits/issued':>12} {'hit%':>5} "
        f"{'inflight':>8} {'hits/req':>8} {'amdahl':>6} {'s/q':>5} {'crit_s':>6} {'crit':>5} {'got':>5}"
        "  hit rate by distance"
    )
    for preset in dict.fromkeys(r["policy"] for r in rows):
        base, spex = get.get((preset, 1, "baseline")), get.get((preset, 1, "spex_sched"))
        if not base or not spex:
            continue
        w = {"policy": preset, **sb.why_row(base, spex, step_s), "speedup": spex["speedup"]}
        dist = (spex.get("speculation") or {}).get("hit_distance", {})
        w["hit_distance"] = dist
        rates = " ".join(f"d{k}:{v['hit_rate']:.2f}({v['issued']})" for k, v in dist.items() if v["issued"])
        print(
            f"{preset:30} {w['requests_per_q']:>6.1f} {w['max_depth_per_q']:>5.1f} "
            f"{str(w['hits']) + '/' + str(w['issued']):>12} {(w['hit_rate'] or 0) * 100:>4.0f}% "
            f"{w['in_flight_share'] or 0:>8.2f} {w['hit_share']:>8.2f} {w['amdahl_bound'] or 0:>6.2f} "
            f"{w['base_s_per_q']:>5.1f} {w['crit_path_s']:>6.2f} {w['crit_bound'] or 0:>5.2f} {sb.fmt_speedup(w['speedup'], '')}  {rates}"
        )
        out.append(w)
    return out


def plot(rows: List[Dict[str, Any]], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    policies = list(dict.fromkeys(r["policy"] for r in rows))
    sizes = sorted({r["concurrency"] for r in rows})
    get = {(r["policy"], r["concurrency"], r["mode"]): r for r in rows}
    cols = min(4, len(policies))
    nrows = (len(policies) + cols - 1) // cols
    fig, axes = plt.subplots(nrows, cols, figsize=(4.2 * cols, 3.4 * nrows), squeeze=False)
    x = np.arange(len(sizes))
    colors = {"baseline": "#9e9e9e", "spex_sched": "#1f77b4", "spex_t3": "#ff7f0e"}
    for ax, preset in zip(axes.flat, policies):
        for j, mode in enumerate(("baseline", "spex_sched", "spex_t3")):
            vals = [get[(preset, b, mode)]["q_per_min"] if (preset, b, mode) in get else 0 for b in sizes]
            bars = ax.bar(x + (j - 1) * 0.27, vals, 0.27, color=colors[mode], label=MODE_LABELS[mode])
            if mode != "baseline":
                for b, bar in zip(sizes, bars):
                    r = get.get((preset, b, mode))
                    if r and r.get("speedup"):
                        ax.text(
                            bar.get_x() + bar.get_width() / 2,
                            bar.get_height(),
                            f"{r['speedup']:.1f}x",
                            ha="center",
                            va="bottom",
                            fontsize=6,
                            rotation=90,
                        )
        ax.set_title(preset.upper())
        ax.set_xticks(x, [str(b) for b in sizes])
        ax.set_xlabel("query batch size")
        ax.set_ylabel("questions / min")
        ax.margins(y=0.2)
    for ax in list(axes.flat)[len(policies) :]:
        ax.axis("off")
    handles, labels = axes.flat[0].get_legend_handles_labels()
    fig.suptitle(title, y=0.995, fontsize=9)
    fig.legend(handles, labels, loc="upper center", ncol=3, fontsize=8, bbox_to_anchor=(0.5, 0.965))
    fig.tight_layout(rect=(0, 0, 1, 0.91))
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=130)
    plt.close(fig)


def main() -> None:
    stop_servers_on_sigterm()  # a `timeout` or kill of a --real run still stops its server
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--policies", default=",".join(sb.FIG10_POLICIES))
    ap.add_argument("--batch-sizes", default="1,2,4,8,16")
    ap.add_argument("--questions-per-batch", type=int, default=1, help="questions per run = this x batch size")
    ap.add_argument("--min-questions", type=int, default=4, help="... but at least this many")
    ap.add_argument("--device", default="A100-80G")
    ap.add_argument("--model", default="Llemma-7B")
    ap.add_argument("--k-total", type=int, default=None, help="default: the simulated roofline knee")
    ap.add_argument("--lookahead", type=int, default=None, help="DFS lookahead k (default: SpexConfig's)")
    ap.add_argument("--no-gate", action="store_true", help="simulate the engine without the scheduler's gate")
    ap.add_argument("--no-mixed", action="store_true", help="prefill passes replace decode steps (no mixed chunk)")
    ap.add_argument("--max-lookahead", type=int, default=None, help="DFS lookahead cap (default: SpexConfig's)")
    ap.add_argument("--bfs-lookahead", type=int, default=None, help="BFS depths ahead (default: SpexConfig's)")
    ap.add_argument("--reward-latency-ms", type=float, default=0.0, help="virtual PRM latency per scored node")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--real", action="store_true", help="also run a subset on the real CPU server (SmolLM2)")
    ap.add_argument("--real-policies", default="rebase-8,rstar-5")
    ap.add_argument("--real-concurrency", default="1,4")
    ap.add_argument("--real-questions", type=int, default=4)
    ap.add_argument("--real-max-depth", type=int, default=4)
    ap.add_argument("--real-step-tokens", type=int, default=24)
    ap.add_argument("--real-k-total", type=int, default=8)
    ap.add_argument("--url", help="--real: use a running server instead of starting one")
    ap.add_argument("--out", default="benchmark/results/fig10.json")
    ap.add_argument("--plot", default="benchmark/results/fig10.png")
    args = ap.parse_args()
    if args.real:  # an unknown mode stops the run now, not after the simulator grid
        import bench_tot

        real_modes(bench_tot.MODES)
    sb.require_fit(args.device, args.model)  # a model that does not fit: a message, not a crash mid-grid
    t0 = time.monotonic()
    rows = sim_rows(args)
    sim_title = f"Fig 10 (simulator {args.device} + {args.model}): questions/min, baseline vs SPEX"
    print_table(rows, sim_title + " — speedup over baseline and q/min")
    step_s = float(RooflineCost(args.device, args.model).decode_time(1, 512))
    why = print_why(rows, step_s)
    source = f"simulator {args.device}/{args.model}" + (" + real CPU server" if args.real else "")

    def write(real: List[Dict[str, Any]]) -> None:  # after the simulator and after every real run
        sb.write_results(args.out, source, args, t0, args.plot, rows=rows, why=why, real_rows=real)

    write([])
    plot(rows, Path(args.plot), sim_title)
    real: List[Dict[str, Any]] = []
    if args.real:
        real = real_rows(args, on_row=write)
        print_table(real, "Fig 10 subset on the real CPU SGLang server (SmolLM2-135M)")
        plot(
            real,
            Path(args.plot).with_name(Path(args.plot).stem + "_real.png"),
            "Fig 10 subset, real CPU SGLang server (SmolLM2-135M)",
        )
        write(real)


if __name__ == "__main__":
    main()
