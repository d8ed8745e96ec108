"""Fig 11: ablation of SPEX's techniques — T1 / T1+T2 / T1+T2+T3 — for RSTAR-10 and REBASE-16 on the simulator.

T1: speculative generation (DFS lookahead / BFS early expansion) with an even split of k_total over the live
queries; +T2: the dynamic budget allocation across queries; +T3: early termination (changes the search).
Throughput is questions/min in virtual time on the A100-80G + Llemma-7B roofline. Writes JSON and a PNG.

    .venv/bin/python benchmark/bench_fig11.py                      # ~1 min
    .venv/bin/python benchmark/bench_fig11.py --policies rstar-10 --batch-sizes 1,8
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any, Dict, List

import simbench as sb
from tqdm import tqdm

MODES = list(sb.ABLATION_MODES)


def plot(rows: List[Dict[str, Any]], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    policies = list(dict.fromkeys(r["policy"] for r in rows))
    sizes = sorted({r["concurrency"] for r in rows})
    get = {(r["policy"], r["concurrency"], r["mode"]): r for r in rows}
    fig, axes = plt.subplots(1, len(policies), figsize=(5.2 * len(policies), 3.6), squeeze=False)
    x = np.arange(len(sizes))
    wid = 0.8 / len(MODES)
    colors = ["#9e9e9e", "#aec7e8", "#1f77b4", "#ff7f0e"]
    for ax, preset in zip(axes.flat, policies):
        for j, mode in enumerate(MODES):
            vals = [(get[(preset, b, mode)] if (preset, b, mode) in get else {}).get("speedup") for b in sizes]
            bars = ax.bar(
                x + (j - (len(MODES) - 1) / 2) * wid, [v or 0 for v in vals], wid, color=colors[j], label=mode
            )
            for v, bar in zip(vals, bars):
                ax.text(
                    bar.get_x() + bar.get_width() / 2,
                    bar.get_height(),
                    "-" if v is None else f"{v:.2f}",
                    ha="center",
                    va="bottom",
                    fontsize=6,
                    rotation=90,
                )
        ax.axhline(1.0, color="k", lw=0.6)
        ax.set_title(preset.upper())
        ax.set_xticks(x, [str(b) for b in sizes])
        ax.set_xlabel("query batch size")
        ax.set_ylabel("speedup over baseline (questions/min)")
        ax.margins(y=0.15)
    axes.flat[0].legend(fontsize=7)
    sb.save_figure(fig, path, title)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--policies", default="rstar-10,rebase-16")
    ap.add_argument("--batch-sizes", default="1,2,4,8,16")
    ap.add_argument("--questions-per-batch", type=int, default=1, help="questions per run = this x batch size")
    ap.add_argument("--min-questions", type=int, default=4)
    ap.add_argument("--device", default="A100-80G")
    ap.add_argument("--model", default="Llemma-7B")
    ap.add_argument("--k-total", type=int, default=None, help="default: the simulated roofline knee")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="benchmark/results/fig11.json")
    ap.add_argument("--plot", default="benchmark/results/fig11.png")
    args = ap.parse_args()
    sb.require_fit(args.device, args.model)  # a model that does not fit: a message, not a crash mid-grid
    t0 = time.monotonic()
    policies, sizes = sb.parse_list(args.policies), sb.parse_list(args.batch_sizes, int)
    runs = [(p, b, m) for p in policies for b in sizes for m in MODES]
    rows = []
    for preset, bs, mode in tqdm(runs, desc="fig11 sim"):
        n = max(args.min_questions, args.questions_per_batch * bs)
        row = sb.run_mode(
            preset,
            sb.ABLATION_MODES[mode],
            cost=(args.device, args.model),
            questions=n,
            concurrency=bs,
            seed=args.seed,
            k_total=args.k_total,
        )
        rows.append({"source": "sim", "policy": preset, "concurrency": bs, "mode": mode, "questions": n, **row})
    sb.add_ratios(rows)
    get = {(r["policy"], r["concurrency"], r["mode"]): r for r in rows}
    title = f"Fig 11 ablation (simulator {args.device} + {args.model}): speedup over baseline"
    print(f"\n{title}\n{'policy':10} {'mode':9}" + "".join(f" {'bs=' + str(b):>13}" for b in sizes))
    for preset in policies:
        for mode in MODES:
            cells = "".join(
                f" {sb.fmt_speedup(get[(preset, b, mode)]['speedup'])} {get[(preset, b, mode)]['q_per_min']:>6.1f}"
                for b in sizes
            )
            print(f"{preset:10} {mode:9}{cells}")
    print("(cells: speedup, questions/min; T3 rows also change accuracy: see JSON 'accuracy')")
    plot(rows, Path(args.plot), title)
    sb.write_results(args.out, f"simulator {args.device}/{args.model}", args, t0, args.plot, rows=rows)


if __name__ == "__main__":
    main()
