"""Calibration: does the simulator (``cpu-measured`` profile) predict the real CPU SGLang server?

Goal (issue #7): on the same workload the simulator predicts questions/min within 20% and the SPEX/baseline
ratio within 15%.

1. Real half (``calib_real.py``): starts SmolLM2-135M (or ``--url``); for every repeat × policy × concurrency a
   *pair*: re-profile, measure the per-request latency outside the engine, then baseline and SPEX (T1+T2, pure
   scheduling) in alternating order, with the load, the client's CPU per request and the engine's busy/idle
   time recorded around each run.
2. Workload fit (``calib_fit.py``): step lengths and path ends from the real trees, the path-end hazard
   scaled so the simulated baseline's nodes per question match the real baseline's.
3. Simulator: the same specs, k_total, concurrency and questions on :class:`~sglang_spex.sim.cost.MeasuredCost`
   built from *that pair's* profile, with the measured :class:`~sglang_spex.sim.client.ClientOverhead`
   (``request_s``/``response_s`` from the latency probe, ``cpu_s`` = the run's client CPU / its requests);
   also without the overhead, to show what it explains.
4. Medians over repeats; prints predicted vs measured questions/min and ratios, and where the time went
   (decode / prefill / idle, real vs simulated).

    .venv/bin/python benchmark/bench_calibration.py --repeats 3          # ~20 min on a 2-core CPU
    .venv/bin/python benchmark/bench_calibration.py --policies rebase-8 --concurrency 1 --questions 2
    .venv/bin/python benchmark/bench_calibration.py --from-json benchmark/results/calibration.json   # sim only
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import time
from collections import defaultdict
from pathlib import Path
from typing import Any, Dict, List, Tuple

import bench_tot
import calib_fit as cf
import calib_real as cr
import simbench as sb
from overlap import stop_servers_on_sigterm
from tqdm import tqdm

from sglang_spex.profile.cache import Profile
from sglang_spex.sim.client import ClientOverhead
from sglang_spex.sim.cost import MeasuredCost
from sglang_spex.sim.workload import Workload, WorkloadParams
from sglang_spex.tot.tasks import get_task

MODES = cr.MODES
# SGLang's CPU radix cache: single-token pages, and a prompt is cached once prefilled (cache_unfinished_req)
SIM_ENGINE = {"cache_block": 1, "cache_on_prefill": True}
Key = Tuple[str, int, str]


def run_real_half(args: argparse.Namespace, policies: List[str], concs: List[int], questions) -> Dict[str, Any]:
    """Every measured pair (profile, latency, both runs with their meters) and the baseline trees."""
    server = None
    if not args.url:
        from sglang_spex.serve import ServerProcess

        server = ServerProcess(["--tot-speculation", "--tot-k-total", str(args.k_total)]).start()
    url = args.url or server.url
    pid = server.proc.pid if server is not None else None
    pairs: List[Dict[str, Any]] = []
    trees: Dict[str, List[Any]] = defaultdict(list)
    load_start = cr.load_average()
    try:
        for preset in policies:  # warm-up, not measured: the first full-size run pays one-off client costs
            warm = bench_tot.build_spec(preset, args.max_depth, args.step_tokens, args.seed + 1)
            for mode in MODES.values():
                cr.run_measured(url, warm, questions[:1], 1, mode, args.k_total, pid)
        cells = [(r, p, c) for r in range(args.repeats) for p in policies for c in concs]
        for i, (rep, preset, conc) in enumerate(tqdm(cells, desc="calibration real (pairs)")):
            spec = bench_tot.build_spec(preset, args.max_depth, args.step_tokens, args.seed)
            profile, latency, runs = cr.measure_pair(
                url, spec, questions, conc, args.k_total, i, args.profile_repeats, pid
            )
            rec = {"repeat": rep, "policy": preset, "concurrency": conc, "pair_index": i}
            rec.update(profile=profile.to_dict(), profile_summary=profile.summary(), latency=latency, runs={})
            for mode, run in runs.items():
                ct = cf.compact_trees(run.results)
                rec["runs"][mode] = {**run.to_dict(), **cf.tree_stats(ct)}
                rec["runs"][mode]["speculation"] = sb.sum_speculation([r.speculation for r in run.results])
                if mode == "baseline":
                    trees[preset] += ct
            pairs.append(rec)
            b, s = rec["runs"]["baseline"], rec["runs"]["spex_sched"]
            tqdm.write(
                f"{preset} c{conc} rep{rep}: base {b['q_per_min']:.2f} spex {s['q_per_min']:.2f} q/min, "
                f"load {latency['load_before_pair'][0]}, other cores {b['cpu']['other_cores_busy']}, "
                f"{profile.summary()}, latency {latency['request_s']}/{latency['response_s']} s"
            )
    finally:
        if server is not None:
            server.stop()
    return {"pairs": pairs, "trees": dict(trees), "load_start": load_start, "load_end": cr.load_average()}


def simulate_pairs(args: argparse.Namespace, real: Dict[str, Any]) -> Dict[str, Any]:
    """Per pair and mode: the simulator's q/min with and without the client overhead (mean over seeds)."""
    # the simulated question prompt, in tokens: the real prompt (template + question) as the server tokenized it
    q_words = int(statistics.median(p["latency"]["prompt_tokens"] for p in real["pairs"]))
    fits = {}
    seeds = [args.seed + s for s in range(args.sim_seeds)]
    for preset, trees in real["trees"].items():
        params, measured = cf.fit_workload(trees, args.step_tokens, args.max_depth, q_words)
        spec = cf.sim_spec_like(bench_tot.build_spec(preset, args.max_depth, args.step_tokens, args.seed))
        target = statistics.median(p["runs"]["baseline"]["nodes_per_q"] for p in real["pairs"] if p["policy"] == preset)
        params, size = cf.match_tree_size(params, spec, target, args.questions, seeds)
        fits[preset] = {"measured": {**measured, **size}, "params": dataclasses.asdict(params)}
    jobs = [(i, mode) for i in range(len(real["pairs"])) for mode in MODES]
    sims: Dict[str, Dict[str, Any]] = {}
    for i, mode in tqdm(jobs, desc="calibration sim"):
        pair = real["pairs"][i]
        run, lat = pair["runs"][mode], pair["latency"]
        overhead = ClientOverhead(lat["request_s"], lat["response_s"], run["client_cpu_s_per_request"])
        profile = Profile.from_dict(pair["profile"])
        server_profile = Profile.from_dict(profile.meta["server_profile"])
        spec = cf.sim_spec_like(bench_tot.build_spec(pair["policy"], args.max_depth, args.step_tokens, args.seed))
        out: Dict[str, Any] = {"overhead": overhead.to_dict()}
        inrun = scaled_profile(profile, run["engine"].get("decode_vs_profile") or 1.0)
        variants = (
            ("sim", profile, overhead),
            ("sim_no_overhead", profile, ClientOverhead()),
            ("sim_server_profile", server_profile, overhead),
            ("sim_inrun_speed", inrun, overhead),
        )
        for label, prof, client in variants:
            rows = []
            for s in seeds:
                row = sb.run_mode(
                    pair["policy"],
                    MODES[mode],
                    cost=MeasuredCost(prof, client=client),
                    questions=args.questions,
                    concurrency=pair["concurrency"],
                    k_total=args.k_total,
                    spec=spec,
                    workload=Workload(WorkloadParams(**fits[pair["policy"]]["params"]), seed=s),
                    keep_results=True,
                    engine_kwargs=SIM_ENGINE,
                )
                row.update(cf.tree_stats(cf.compact_trees(row.pop("_results"))))
                rows.append(row)
            keys = (
                "q_per_min",
                "virtual_time_s",
                "decode_s",
                "decode_steps",
                "prefill_s",
                "prefill_passes",
                "mean_batch",
                "nodes_per_q",
            )
            out[label] = {k: round(statistics.mean(r[k] for r in rows), 3) for k in keys}
            out[label]["q_per_min_seeds"] = [r["q_per_min"] for r in rows]
        v = out["sim"]
        v["idle_s"] = round(max(v["virtual_time_s"] - v["decode_s"] - v["prefill_s"], 0.0), 3)
        sims[f"{i}:{mode}"] = out
    return {"fits": fits, "sims": sims}


def scaled_profile(profile: Profile, factor: float) -> Profile:
    """``profile`` with every step ``factor`` times slower: the engine speed a run actually had (its
    ``decode_vs_profile``). Not a prediction (it uses the run's own step times): it separates the simulator's
    scheduling error from the machine's speed changing between profiling and the run."""
    return Profile.from_points(
        profile.key,
        profile.batch_sizes,
        [t * factor for t in profile.step_times],
        profile.context_len,
        ctx_coef=(profile.ctx_coef or 0.0) * factor,
        prefill_tok_s=(profile.prefill_tok_s or 0.0) / factor or None,
        prefill_overhead_s=(profile.prefill_overhead_s or 0.0) * factor,
    )


def _med(xs: List[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def summarize(real: Dict[str, Any], sim: Dict[str, Any]) -> List[Dict[str, Any]]:
    """One row per (policy, concurrency, mode): medians over repeats, errors, ratios, where the time went."""
    acc: Dict[Key, Dict[str, List[Any]]] = defaultdict(lambda: defaultdict(list))
    for i, pair in enumerate(real["pairs"]):
        base_real = pair["runs"]["baseline"]["q_per_min"]
        base_sim = sim["sims"][f"{i}:baseline"]
        for mode in MODES:
            r, s = pair["runs"][mode], sim["sims"][f"{i}:{mode}"]
            a = acc[(pair["policy"], pair["concurrency"], mode)]
            a["real"].append(r["q_per_min"])
            a["sim"].append(s["sim"]["q_per_min"])
            a["sim_no_overhead"].append(s["sim_no_overhead"]["q_per_min"])
            a["sim_server_profile"].append(s["sim_server_profile"]["q_per_min"])
            a["sim_inrun_speed"].append(s["sim_inrun_speed"]["q_per_min"])
            a["real_ratio"].append(r["q_per_min"] / base_real)
            a["sim_ratio"].append(s["sim"]["q_per_min"] / base_sim["sim"]["q_per_min"])
            for v in ("no_overhead", "server_profile", "inrun_speed"):
                a[f"sim_ratio_{v}"].append(s[f"sim_{v}"]["q_per_min"] / base_sim[f"sim_{v}"]["q_per_min"])
            a["load"].append(pair["latency"]["load_before_pair"][0])
            a["other_cores"].append(r["cpu"]["other_cores_busy"])
            for k in ("decode_s", "prefill_s", "idle_s"):
                a[f"real_{k}"].append(r["engine"][k])
                a[f"sim_{k}"].append(s["sim"][k])
            a["real_batch"].append(r["engine"]["mean_decode_batch"])
            a["decode_vs_profile"].append(r["engine"].get("decode_vs_profile", float("nan")))
            a["sim_batch"].append(s["sim"]["mean_batch"])
            a["real_nodes"].append(r["nodes_per_q"])
            a["sim_nodes"].append(s["sim"]["nodes_per_q"])
            a["cpu_ms_per_req"].append(1e3 * r["client_cpu_s_per_request"])
            a["latency_ms"].append(1e3 * (pair["latency"]["request_s"] + pair["latency"]["response_s"]))
    table = []
    for (policy, conc, mode), a in acc.items():
        m = {k: round(_med(v), 3) for k, v in a.items()}
        row = {"policy": policy, "concurrency": conc, "mode": mode, "median": m, "all": dict(a)}
        row["q_per_min_err"] = round(m["sim"] / m["real"] - 1, 3)
        row["q_per_min_err_no_overhead"] = round(m["sim_no_overhead"] / m["real"] - 1, 3)
        row["q_per_min_err_server_profile"] = round(m["sim_server_profile"] / m["real"] - 1, 3)
        row["ratio_err"] = round(m["sim_ratio"] / m["real_ratio"] - 1, 3)
        row["ratio_err_no_overhead"] = round(m["sim_ratio_no_overhead"] / m["real_ratio"] - 1, 3)
        row["ratio_err_server_profile"] = round(m["sim_ratio_server_profile"] / m["real_ratio"] - 1, 3)
        row["q_per_min_err_inrun_speed"] = round(m["sim_inrun_speed"] / m["real"] - 1, 3)
        row["ratio_err_inrun_speed"] = round(m["sim_ratio_inrun_speed"] / m["real_ratio"] - 1, 3)
        table.append(row)
    return table


def report(table: List[Dict[str, Any]]) -> Dict[str, float]:
    print(
        "\nmedians over repeats; sim = the pair's stats-ring profile + measured client overhead; no-oh = without the "
        "overhead; srv-prof = the server's /spex/profile instead of the stats-ring one"
        f"\n{'policy':9} {'conc':>4} {'mode':10} {'real q/min':>10} {'sim':>6} {'err':>5} {'no-oh':>6} {'err':>5} | "
        f"{'ratio real':>10} {'sim':>5} {'err':>5} {'no-oh':>5} {'err':>5} | {'srv-prof':>8} {'err':>5} {'ratio':>5} "
        f"{'err':>5} | {'load':>4} {'other':>5}"
    )
    for r in table:
        m, rat = r["median"], r["mode"] != "baseline"
        ratio = (
            f"{m['real_ratio']:>10.2f} {m['sim_ratio']:>5.2f} {r['ratio_err']:>+5.0%} "
            f"{m['sim_ratio_no_overhead']:>5.2f} {r['ratio_err_no_overhead']:>+5.0%}"
            if rat
            else f"{'':>10} {'':>5} {'':>5} {'':>5} {'':>5}"
        )
        srv = f"{m['sim_server_profile']:>8.2f} {r['q_per_min_err_server_profile']:>+5.0%} " + (
            f"{m['sim_ratio_server_profile']:>5.2f} {r['ratio_err_server_profile']:>+5.0%}" if rat else f"{'':>11}"
        )
        print(
            f"{r['policy']:9} {r['concurrency']:>4} {r['mode']:10} {m['real']:>10.2f} {m['sim']:>6.2f} "
            f"{r['q_per_min_err']:>+5.0%} {m['sim_no_overhead']:>6.2f} {r['q_per_min_err_no_overhead']:>+5.0%} | "
            f"{ratio} | {srv} | {m['load']:>4.1f} {m['other_cores']:>5.2f}"
        )
    print(
        "\nwhere the time went (medians, real/sim): decode s, prefill s, engine idle s, mean decode batch, "
        "nodes/q; client overhead: latency ms (request+response), client CPU ms/request; real decode step time / "
        "the profile's at the same batch sizes"
    )
    for r in table:
        m = r["median"]
        print(
            f"{r['policy']:9} {r['concurrency']:>4} {r['mode']:10} "
            + "  ".join(f"{m['real_' + k]:.2f}/{m['sim_' + k]:.2f}" for k in ("decode_s", "prefill_s", "idle_s"))
            + f"  {m['real_batch']:.1f}/{m['sim_batch']:.1f}  {m['real_nodes']:.1f}/{m['sim_nodes']:.1f}"
            + f"  lat {m['latency_ms']:.0f} ms, cpu {m['cpu_ms_per_req']:.1f} ms/req"
            + f"  step/profile {m['decode_vs_profile']:.2f}"
            + f"  | at in-run speed: {m['sim_inrun_speed']:.2f} q/min {r['q_per_min_err_inrun_speed']:+.0%}"
            + (
                f", ratio {m['sim_ratio_inrun_speed']:.2f} {r['ratio_err_inrun_speed']:+.0%}"
                if r["mode"] != "baseline"
                else ""
            )
        )
    spex = [r for r in table if r["mode"] != "baseline"]
    worst = {
        "q_per_min": max(abs(r["q_per_min_err"]) for r in table),
        "q_per_min_no_overhead": max(abs(r["q_per_min_err_no_overhead"]) for r in table),
        "ratio": max(abs(r["ratio_err"]) for r in spex),
        "ratio_no_overhead": max(abs(r["ratio_err_no_overhead"]) for r in spex),
        "q_per_min_server_profile": max(abs(r["q_per_min_err_server_profile"]) for r in table),
        "ratio_server_profile": max(abs(r["ratio_err_server_profile"]) for r in spex),
        "q_per_min_inrun_speed": max(abs(r["q_per_min_err_inrun_speed"]) for r in table),
        "ratio_inrun_speed": max(abs(r["ratio_err_inrun_speed"]) for r in spex),
    }
    print(
        f"\nworst q/min error {worst['q_per_min']:.0%} (goal <= 20%; {worst['q_per_min_no_overhead']:.0%} without "
        f"the client overhead), worst SPEX/baseline ratio error {worst['ratio']:.0%} (goal <= 15%; "
        f"{worst['ratio_no_overhead']:.0%} without); with the server's profile: {worst['q_per_min_server_profile']:.0%}"
        f" and {worst['ratio_server_profile']:.0%}; at each run's own engine speed (diagnostic, not a prediction): "
        f"{worst['q_per_min_inrun_speed']:.0%} and {worst['ratio_inrun_speed']:.0%}"
    )
    return worst


def plot(table: List[Dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(9, 4))
    for r in table:
        m, mk = r["median"], "o" if r["mode"] == "baseline" else "s"
        label = f"{r['policy']} c{r['concurrency']} {r['mode'][:4]}"
        a.scatter(m["real"], m["sim"], marker=mk)
        a.annotate(label, (m["real"], m["sim"]), fontsize=6)
        if r["mode"] != "baseline":
            b.scatter(m["real_ratio"], m["sim_ratio"], marker=mk)
            b.annotate(label, (m["real_ratio"], m["sim_ratio"]), fontsize=6)
    for ax, lab, tol in ((a, "questions/min", 0.2), (b, "SPEX / baseline", 0.15)):
        lo = min(ax.get_xlim()[0], ax.get_ylim()[0])
        hi = max(ax.get_xlim()[1], ax.get_ylim()[1])
        ax.plot([lo, hi], [lo, hi], "k--", lw=0.8)
        ax.fill_between(
            [lo, hi],
            [lo * (1 - tol), hi * (1 - tol)],
            [lo * (1 + tol), hi * (1 + tol)],
            color="g",
            alpha=0.08,
            label=f"±{tol:.0%}",
        )
        ax.set_xlabel(f"real CPU server: {lab} (median)")
        ax.set_ylabel(f"simulator (cpu-measured): {lab}")
        ax.legend(fontsize=7)
    sb.save_figure(fig, path, "Calibration: simulator vs real SGLang (SmolLM2-135M, CPU)")


def main() -> None:
    stop_servers_on_sigterm()  # a `timeout` or kill still stops the servers this run started
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--policies", default="rebase-8,rstar-5")
    ap.add_argument("--concurrency", default="1,4")
    ap.add_argument("--questions", type=int, default=4)
    ap.add_argument("--max-depth", type=int, default=4)
    ap.add_argument("--step-tokens", type=int, default=24)
    ap.add_argument("--k-total", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=3, help="measured pairs per cell (medians are reported)")
    ap.add_argument("--profile-repeats", type=int, default=2, help="short/long pairs per profiled batch size")
    ap.add_argument("--sim-seeds", type=int, default=3, help="simulated workload seeds averaged per run")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--from-json", help="reuse the real half of an earlier output; rerun the simulator only")
    ap.add_argument("--url", help="use a running server (started with --tot-speculation) instead of SmolLM2")
    ap.add_argument("--out", default="benchmark/results/calibration.json")
    ap.add_argument("--plot", default="benchmark/results/calibration.png")
    args = ap.parse_args()
    t0 = time.monotonic()
    if args.from_json:
        saved = json.loads(Path(args.from_json).read_text())
        for k in ("policies", "concurrency", "questions", "max_depth", "step_tokens", "k_total", "seed", "repeats"):
            setattr(args, k, saved["meta"]["args"][k])
        real = saved["real"]
    else:
        policies, concs = sb.parse_list(args.policies), sb.parse_list(args.concurrency, int)
        questions = get_task("toy_add").questions(args.questions, split="test", seed=args.seed)
        real = run_real_half(args, policies, concs, questions)
    sim = simulate_pairs(args, real)
    table = summarize(real, sim)
    worst = report(table)
    plot(table, Path(args.plot))
    source = "real CPU SGLang server (SmolLM2-135M) vs simulator (cpu-measured profile + client overhead)"
    sb.write_results(args.out, source, args, t0, args.plot, rows=table, worst=worst, sim=sim, real=real)


if __name__ == "__main__":
    main()
