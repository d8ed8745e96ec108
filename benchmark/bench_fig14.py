"""Fig 14: speculation hit rate vs prediction distance (DFS: rSTAR/REST) and vs tree depth (BFS: REBASE/ETS).

Simulator (A100-80G + Llemma-7B), SPEX with pure scheduling (T1+T2, no early stop). A DFS speculative node's
distance is how many rollouts ahead of the current one its prediction reaches (1 = the current rollout); a BFS
node's depth is the depth of the tree level it was expanded into early. Hit = adopted by the primary search.
Writes JSON and a PNG.

    .venv/bin/python benchmark/bench_fig14.py                      # ~30 s
    .venv/bin/python benchmark/bench_fig14.py --lookahead 6 --questions 16
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any, Dict, List

import simbench as sb
from tqdm import tqdm


def plot(rows: List[Dict[str, Any]], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    fig, (a, b) = plt.subplots(1, 2, figsize=(9.5, 3.6))
    for r in rows:
        ax, key = (b, "hit_depth") if r["bfs"] else (a, "hit_distance")
        pts = [(int(k), v["hit_rate"], v["issued"]) for k, v in r[key].items() if v["issued"]]
        if pts:
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=r["policy"].upper())
    a.set_xlabel("prediction distance (rollouts ahead)")
    b.set_xlabel("tree depth of the speculative node")
    for ax, t in ((a, "DFS"), (b, "BFS")):
        ax.set_ylabel("hit rate (adopted / issued)")
        ax.set_ylim(0, 1.05)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_title(t)
        ax.legend(fontsize=7)
        ax.grid(alpha=0.3)
    sb.save_figure(fig, path, title)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--policies", default="rstar-5,rstar-10,rest-5,rest-10,rebase-8,rebase-16,ets-8,ets-16")
    ap.add_argument("--questions", type=int, default=8)
    ap.add_argument("--concurrency", type=int, default=1)
    ap.add_argument("--lookahead", type=int, default=None, help="DFS lookahead k (default: SpexConfig's)")
    ap.add_argument("--device", default="A100-80G")
    ap.add_argument("--model", default="Llemma-7B")
    ap.add_argument("--k-total", type=int, default=None)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="benchmark/results/fig14.json")
    ap.add_argument("--plot", default="benchmark/results/fig14.png")
    args = ap.parse_args()
    sb.require_fit(args.device, args.model)  # a model that does not fit: a message, not a crash mid-grid
    t0 = time.monotonic()
    rows = []
    for preset in tqdm(sb.parse_list(args.policies), desc="fig14 sim"):
        r = sb.run_mode(
            preset,
            sb.SPEX_MODES["spex_sched"],
            cost=(args.device, args.model),
            questions=args.questions,
            concurrency=args.concurrency,
            seed=args.seed,
            k_total=args.k_total,
            lookahead=args.lookahead,
        )
        s = r["speculation"] or {}
        rows.append(
            {
                "policy": preset,
                "bfs": sb.is_bfs(preset),
                "hits": s.get("hits"),
                "issued": s.get("issued"),
                "hit_rate": s.get("hit_rate"),
                "in_flight_adopted": s.get("in_flight_adopted"),
                "hit_distance": s.get("hit_distance", {}),
                "hit_depth": s.get("hit_depth", {}),
            }
        )
    print(f"\nFig 14 (simulator {args.device} + {args.model}, {args.questions} questions, batch {args.concurrency})")
    for r in rows:
        key = "hit_depth" if r["bfs"] else "hit_distance"
        cells = "  ".join(
            f"{'depth' if r['bfs'] else 'dist'} {k}: {v['hit_rate']:.2f} ({v['hits']}/{v['issued']})"
            for k, v in r[key].items()
            if v["issued"]
        )
        print(f"{r['policy']:10} overall {r['hit_rate'] or 0:.2f} ({r['hits']}/{r['issued']})  {cells}")
    plot(rows, Path(args.plot), f"Fig 14 (simulator {args.device} + {args.model}): speculation hit rate")
    sb.write_results(args.out, f"simulator {args.device}/{args.model}", args, t0, args.plot, rows=rows)


if __name__ == "__main__":
    main()
