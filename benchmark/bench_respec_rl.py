"""End-to-end ReSpec RL benchmark: the same GRPO run (same initial policy, seeds, prompts and steps) with no
speculation, naive always-on EAGLE3 with a frozen drafter, and ReSpec (adaptive server + online learner); mode
``learner`` (always-on EAGLE3 + the online learner, not run by default) reads what the learner does to acceptance
on every step, which ReSpec's switching hides where its plan says plain.

    python benchmark/bench_respec_rl.py                        # tiny Llama warm-started on toy_add 2..10, 30 steps
    python benchmark/bench_respec_rl.py --steps 20 --repeats 2 --group 8

Setup (once, or reused from ``--work-dir``): the initial policy (supervised warm start), a bootstrap EAGLE-3
drafter fitted on its samples (``grpo_setup.prepare_run``) and, for ReSpec's adaptive server, a profile of plain
vs EAGLE3 decode at a few batch sizes (``respec.profiler.profile_configs``). Then for every (repeat, seed) the modes
run one after another (never two servers at once), each a full RL run on its own server (``respec/rl_loop.py``),
in an order rotated by one place for each successive (repeat, seed) (:func:`mode_order`): the ``--modes`` order for
the first, so with one repeat and one seed (the default) every mode runs once in the ``--modes`` order, and it takes
as many (repeat, seed) pairs as there are modes for each mode to run once in every position. The raw runs are
written to ``--out`` after every run (``"partial": true``), so an interrupted run or a failing summary loses
nothing; the summary works for any subset of ``--modes`` (speedups and reward gaps need ``none`` among them).

Per step: wall-clock split into generation / drafter update (the loop's learner calls; ReSpec's async updates
run inside the server, overlapping the next generation, and their own seconds are reported separately) / policy
update (optimizer + push), active batch (time-averaged running requests), acceptance length (completion tokens /
verify passes), reward, distinct responses per group (1 would mean argmax, not sampling). Speedup of a mode =
no-speculation seconds / mode seconds of the run with the same (repeat, seed), per step (median, min–max) and over
the whole run (ratio of sums).
Reward trend per mode (``reward_trend``): the least-squares slope of step reward on step index pooled over seeds,
with its standard error and the one-sided p-value of "no rise"; the same for acceptance (``accept_trend``).
ReSpec's learner state says how many updates its payback gate skipped (``learner_skipped``, ``learner_payback``).
``--pool`` reads result files of several runs and compares the modes' acceptance drift (``pooled_acceptance``).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time
from pathlib import Path
from typing import Dict, List

from overlap import stop_servers_on_sigterm
from simbench import save_figure, write_results

RESULTS = Path(__file__).parent / "results"
EAGLE_KEY = "EAGLE3:s3t1n4"  # grpo_setup.EAGLE_ARGS


def spex_info(url: str) -> Dict:
    """What the bench checks once a server is up: whether V1 (lossless CPU verify) is listed as applied."""
    import requests

    info = requests.get(url + "/spex/info", timeout=60).json()
    text = json.dumps(info.get("hooks", info))
    return {"v1_listed": '"V1"' in text or "lossless_verify" in text}


def prepare(a, task, work: Path):
    import torch

    from sglang_spex.respec.grpo_setup import RunSetup, prepare_run
    from sglang_spex.respec.profiler import SpecConfig, profile_configs

    meta = work / "setup.json"
    if meta.exists():
        d = json.loads(meta.read_text())
        setup = RunSetup(Path(d["policy_dir"]), Path(d["drafter_dir"]), d["probe"], d["info"])
    else:
        setup = prepare_run(
            a.model, task, work, a.warm_steps, a.drafter_samples, a.drafter_iters, a.draft_vocab, a.max_new_tokens,
            a.temperature, a.seed, drafter_dir=a.drafter,
        )  # fmt: skip
        d = {"policy_dir": str(setup.policy_dir), "drafter_dir": str(setup.drafter_dir), "probe": setup.probe}
        meta.write_text(json.dumps({**d, "info": setup.info}))
    profile = Path(a.profile) if a.profile else work / "profile.json"
    if not profile.exists():
        torch.set_num_threads(1)
        server_args = ["--attention-backend", "spex_cpu", "--dtype", a.dtype]
        prof = profile_configs(
            str(setup.policy_dir), [None, SpecConfig.parse(EAGLE_KEY)], a.profile_batches, 8, 40, 2, server_args,
            str(setup.drafter_dir), prompts=_profile_prompts(setup, task), temperature=a.temperature,
        )  # fmt: skip
        prof.save(profile)
    return setup, profile


def _profile_prompts(setup, task) -> List[str]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(setup.policy_dir))
    qs = task.questions(16, split="dev", seed=4242)
    return [tok.apply_chat_template([{"role": "user", "content": q.text}], tokenize=False, add_generation_prompt=True)
            for q in qs]  # fmt: skip


def run_mode(mode: str, a, setup, profile: Path, task, seed: int) -> Dict:
    from sglang_spex.respec.grpo import GRPOConfig
    from sglang_spex.respec.grpo_setup import learner_spec
    from sglang_spex.respec.rl_loop import LEARNER_MODES, mode_server_args, run_rl

    spec = None
    if mode in LEARNER_MODES:
        spec = learner_spec(setup, a.kd_variant, "async", lr=a.kd_lr, train_steps=a.kd_train_steps, micro_batch=8)
    args = mode_server_args(
        mode, setup.policy_dir, setup.drafter_dir, a.dtype, str(profile), spec, ["--attention-backend", "spex_cpu"]
    )
    cfg = GRPOConfig(a.prompts, a.group, a.max_new_tokens, a.temperature, a.inner_steps, seed=seed)

    def show(row):
        acc = f"{row['accept_length']:.2f}" if row["accept_length"] else "-"
        print(
            f"  {mode:6s} step {row['step']:2d}: {row['seconds']:6.2f} s (gen {row['generation_s']:.2f}, drafter "
            f"{row['drafter_update_s']:.2f}, policy {row['policy_update_s'] + row['push_s']:.2f}) batch "
            f"{row['active_batch']:.1f} accept {acc} reward {row['reward_mean']:.3f} distinct "
            f"{row['distinct_per_group']:.1f}",
            flush=True,
        )

    save = Path(a.save_policies) / f"{mode}-seed{seed}" if a.save_policies else None
    out = run_rl(
        args, setup.policy_dir, task, cfg, a.steps, a.policy_lr, None, mode in LEARNER_MODES, show, spex_info, save
    )  # fmt: skip
    out["seed"] = seed
    return out


def seed_noise(runs: Dict[str, List[Dict]]) -> Dict:
    """Reward against no speculation, paired by RL seed: per mode, each seed's run-mean reward minus the
    no-speculation run's of the same seed (mean and min–max over seeds), next to the spread of no speculation's own
    run-mean reward across seeds (the noise a gap is read against)."""

    def by_seed(reps):
        return {r["seed"]: statistics.mean(s["reward_mean"] for s in r["steps"]) for r in reps if r["steps"]}

    base = by_seed(runs.get("none", []))
    out: Dict = {"none_reward_by_seed": base}
    if len(base) > 1:
        out["none_reward_spread"] = max(base.values()) - min(base.values())
    for mode, reps in runs.items():
        mine = by_seed(reps)
        gaps = [mine[k] - base[k] for k in mine if k in base]
        if mode != "none" and gaps:
            out[mode] = {
                "reward_by_seed": mine,
                "gap_mean": statistics.mean(gaps),
                "gap_min_max": [min(gaps), max(gaps)],
            }
    return out


def reward_trend(reps: List[Dict], key: str = "reward_mean") -> Dict:
    """Does reward (or another per-step figure, ``key``; steps where it is None are left out) rise over the run?
    Least squares of each step's value on its step index, pooled over the runs (seeds): slope per step with its
    standard error, the one-sided p-value of "no rise" (``p_rise``), the fitted rise over the run (slope × (steps −
    1)) and the mean of the first and last third of the steps."""
    from scipy import stats

    pts = [(s["step"], s[key]) for r in reps for s in r["steps"] if s.get(key) is not None]
    xs, ys = [x for x, _ in pts], [y for _, y in pts]
    if len(set(xs)) < 3:
        return {}
    fit = stats.linregress(xs, ys)
    lo, hi = min(xs), max(xs)
    third = (hi - lo + 1) / 3
    first = [y for x, y in zip(xs, ys) if x < lo + third]
    last = [y for x, y in zip(xs, ys) if x > hi - third]
    t = fit.slope / fit.stderr if fit.stderr > 0 else math.inf * (1 if fit.slope > 0 else -1)
    return {
        "slope_per_step": fit.slope,
        "slope_se": fit.stderr,
        "p_rise": float(stats.t.sf(t, len(xs) - 2)),
        "fitted_rise": fit.slope * (hi - lo),
        "first_third_mean": statistics.mean(first),
        "last_third_mean": statistics.mean(last),
    }


def mode_order(modes: List[str], k: int) -> List[str]:
    """The order the modes run in for the ``k``-th (repeat, seed): ``modes`` rotated left by ``k`` places, so no mode
    always runs first (or last); over ``len(modes)`` successive pairs each mode takes every position once."""
    if not modes:
        return []
    k %= len(modes)
    return list(modes[k:]) + list(modes[:k])


def _pair_key(r: Dict, i: int):
    """What pairs a run with no speculation's: its (repeat, seed); runs written before the ``repeat`` tag pair by
    their position in the mode's list (the order they ran in, one per (repeat, seed))."""
    return (r.get("repeat", i), r.get("seed"))


def summarize(runs: Dict[str, List[Dict]]) -> Dict:
    """Per mode: mean step seconds and split, acceptance start/end, reward; when ``none`` ran, speedup vs ``none``
    (per step, pairing each run with no speculation's run of the same repeat and seed) and reward gap. Any subset of
    modes, in any order; runs without steps are left out."""
    out: Dict = {}
    base = {_pair_key(r, i): r for i, r in enumerate(runs.get("none", [])) if r["steps"]}
    base_reward = statistics.mean(s["reward_mean"] for r in base.values() for s in r["steps"]) if base else None
    for mode, all_reps in runs.items():
        keyed = [(_pair_key(r, i), r) for i, r in enumerate(all_reps) if r["steps"]]
        reps = [r for _, r in keyed]
        steps = [s for r in reps for s in r["steps"]]
        if not steps:
            continue
        acc = [s["accept_length"] for s in steps if s["accept_length"]]
        n = min(len(r["steps"]) for r in reps)  # the reward curve over the steps every run has
        first_acc = [r["steps"][0]["accept_length"] for r in reps if r["steps"][0]["accept_length"]]
        last_acc = [r["steps"][-1]["accept_length"] for r in reps if r["steps"][-1]["accept_length"]]
        m = {
            "step_s_mean": statistics.mean(s["seconds"] for s in steps),
            "generation_s_mean": statistics.mean(s["generation_s"] for s in steps),
            "drafter_update_s_mean": statistics.mean(s["drafter_update_s"] for s in steps),
            "policy_update_s_mean": statistics.mean(s["policy_update_s"] + s["push_s"] for s in steps),
            "active_batch_mean": statistics.mean(s["active_batch"] for s in steps),
            "reward_mean": statistics.mean(s["reward_mean"] for s in steps),
            "reward_curve": [statistics.mean(r["steps"][i]["reward_mean"] for r in reps) for i in range(n)],
            "reward_trend": reward_trend(reps),
            "accept_trend": reward_trend(reps, "accept_length"),  # p_rise near 1: acceptance falls
            "accept_mean": statistics.mean(acc) if acc else None,
            "accept_first": statistics.mean(first_acc) if first_acc else None,
            "accept_last": statistics.mean(last_acc) if last_acc else None,
            "distinct_per_group_mean": statistics.mean(s["distinct_per_group"] for s in steps),
            "server_start_s": [r["server_start_s"] for r in reps],
            "v1_listed": [bool((r.get("on_start") or {}).get("v1_listed")) for r in reps],
        }
        reports = [r.get("respec_report") for r in reps if r.get("respec_report")]
        if reports:
            keys = ("decode_steps", "plain_steps", "spec_steps", "mean_accept_length", "plan")
            m["respec_steps"] = [{k: rep.get(k) for k in keys if k in rep} for rep in reports]
        learners = [r["learner"] for r in reps if r.get("learner")]
        if learners:
            ups = [u for st in learners for u in st["updates"]]
            m["learner_updates"] = len(ups)
            m["learner_published"] = sum(u["outcome"] == "published" for u in ups)
            m["learner_update_s_mean"] = statistics.mean(u["seconds"] for u in ups) if ups else None
            m["learner_skipped"] = sum(st.get("skipped_updates", 0) for st in learners)
            m["learner_payback"] = [st.get("payback") for st in learners]
        if base_reward is not None and mode != "none":
            pairs = [(base[key], r) for key, r in keyed if key in base]
            ratios = [
                b["steps"][i]["seconds"] / r["steps"][i]["seconds"]
                for b, r in pairs
                for i in range(min(len(b["steps"]), len(r["steps"])))
            ]
            if ratios:
                total_b = sum(s["seconds"] for b, _ in pairs for s in b["steps"])
                m["speedup_per_step_median"] = statistics.median(ratios)
                m["speedup_per_step_min_max"] = [min(ratios), max(ratios)]
                m["speedup_total"] = total_b / sum(s["seconds"] for _, r in pairs for s in r["steps"])
                m["speedup_pairs"] = len(pairs)
            m["reward_gap_vs_none"] = m["reward_mean"] - base_reward
        out[mode] = m
    return out


def pooled_acceptance(paths: List[str]) -> Dict:
    """Acceptance drift pooled over result files of this benchmark: per mode (a learner mode named with its KD
    variant), each run's acceptance trend (:func:`reward_trend` on ``accept_length``) and last-third / first-third
    change, their mean, and Welch's t-test of the per-run slopes between every two modes."""
    from scipy import stats

    from sglang_spex.respec.rl_loop import LEARNER_MODES

    per: Dict[str, List[Dict]] = {}
    for path in paths:
        d = json.loads(Path(path).read_text())
        variant = d["meta"]["args"].get("kd_variant", "reward")
        for mode, reps in d["runs"].items():
            name = f"{mode}-{variant}" if mode in LEARNER_MODES else mode
            for r in reps:
                t = reward_trend([r], "accept_length")
                if t:
                    change = t["last_third_mean"] / t["first_third_mean"] - 1.0
                    per.setdefault(name, []).append({"file": path, "seed": r["seed"], "change": change, **t})
    out: Dict = {"modes": {}, "slope_welch_p": {}}
    for name, runs in per.items():
        changes = [r["change"] for r in runs]
        out["modes"][name] = {
            "runs": runs,
            "slope_mean": statistics.mean(r["slope_per_step"] for r in runs),
            "change_mean": statistics.mean(changes),
            "change_min_max": [min(changes), max(changes)],
            "first_third_mean": statistics.mean(r["first_third_mean"] for r in runs),
            "last_third_mean": statistics.mean(r["last_third_mean"] for r in runs),
        }
    names = sorted(per)
    for i, a in enumerate(names):
        for b in names[i + 1 :]:
            if len(per[a]) > 1 and len(per[b]) > 1:
                slopes = [[r["slope_per_step"] for r in per[n]] for n in (a, b)]
                out["slope_welch_p"][f"{a} vs {b}"] = float(stats.ttest_ind(*slopes, equal_var=False).pvalue)
    return out


def _trend(t: Dict) -> str:
    if not t:
        return ""
    return (
        f" (slope {t['slope_per_step']:+.4f}/step ± {t['slope_se']:.4f}, p_rise {t['p_rise']:.3f}; thirds "
        f"{t['first_third_mean']:.3f}→{t['last_third_mean']:.3f})"
    )


def plot(runs: Dict[str, List[Dict]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    for mode, reps in runs.items():
        for k, r in enumerate(reps):
            xs = [s["step"] for s in r["steps"]]
            label = mode if k == 0 else None
            c = {"none": "tab:grey", "naive": "tab:orange", "learner": "tab:blue", "respec": "tab:green"}[mode]
            axes[0].plot(xs, [s["reward_mean"] for s in r["steps"]], marker=".", color=c, label=label)
            if mode != "none":
                axes[1].plot(xs, [s["accept_length"] or 1.0 for s in r["steps"]], marker=".", color=c, label=label)
            axes[2].plot(xs, [s["seconds"] for s in r["steps"]], marker=".", color=c, label=label)
    axes[0].set(xlabel="RL step", ylabel="mean reward", title="reward")
    axes[1].set(xlabel="RL step", ylabel="tokens per verify pass", title="acceptance length")
    axes[2].set(xlabel="RL step", ylabel="seconds", title="RL step wall-clock")
    for ax in axes:
        ax.legend()
    save_figure(fig, path, "GRPO on real CPU SGLang, one curve per speculation mode and RL seed")


def main(argv=None) -> int:
    stop_servers_on_sigterm()  # a `timeout` or kill still stops the servers this run started
    from sglang_spex.respec.grpo_setup import add_run_args
    from sglang_spex.respec.rl_loop import MODES

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_run_args(ap, max_new_tokens=32)
    ap.add_argument(  # "learner" is a measurement mode: run it by name
        "--modes", nargs="+", default=[m for m in MODES if m != "learner"], choices=MODES
    )
    ap.add_argument("--steps", type=int, default=30, help="RL (policy) steps per run")
    ap.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="runs per mode and seed; the mode order rotates by one place per (repeat, seed)",
    )
    ap.add_argument(
        "--seeds",
        type=int,
        nargs="+",
        default=None,
        help="RL seeds (sampling, prompt order), each run in every mode; "
        "default: --seed. The setup (policy, drafter, profile) is --seed's",
    )
    ap.add_argument(
        "--kd-variant",
        default="reward",
        choices=["reward", "unweighted"],
        help="the learner's KD: reward-weighted (w = r normalised, the paper's) or unweighted",
    )
    ap.add_argument("--profile", default=None, help="ReSpec profile JSON (default: measured into --work-dir)")
    ap.add_argument("--profile-batches", type=int, nargs="+", default=[1, 4, 16])
    ap.add_argument("--work-dir", default=None, help="setup cache (policy, drafter, profile); default: a new one")
    ap.add_argument("--out", default=str(RESULTS / "respec_rl.json"))
    ap.add_argument(
        "--save-policies",
        default=None,
        help="save each run's final policy under DIR/<mode>-seed<seed> (for check_on_policy.py --policy-dir)",
    )
    ap.add_argument(
        "--pool",
        nargs="+",
        default=None,
        metavar="JSON",
        help="no run: pool the acceptance drift of these result files (per mode and KD variant) and print it",
    )
    a = ap.parse_args(argv)
    if len(set(a.modes)) != len(a.modes):
        ap.error(f"--modes: a mode given twice: {a.modes}")
    if a.pool:
        pooled = pooled_acceptance(a.pool)
        for name, m in pooled["modes"].items():
            lo, hi = m["change_min_max"]
            print(
                f"{name}: {len(m['runs'])} runs, acceptance {m['first_third_mean']:.2f} → {m['last_third_mean']:.2f} "
                f"(first → last third), change {m['change_mean']:+.1%} ({lo:+.1%} … {hi:+.1%}), "
                f"slope {m['slope_mean']:+.4f}/step"
            )
        for pair, p in pooled["slope_welch_p"].items():
            print(f"slopes {pair}: Welch p = {p:.3f}")
        return 0

    import tempfile

    import torch

    from sglang_spex.respec.grpo_setup import resolve_model, resolve_task

    torch.set_num_threads(1)
    t0 = time.monotonic()
    resolve_model(a.model)
    task = resolve_task(a.task, a.toy_range)
    work = Path(a.work_dir) if a.work_dir else Path(tempfile.mkdtemp(prefix="bench-respec-rl-"))
    work.mkdir(parents=True, exist_ok=True)
    setup, profile = prepare(a, task, work)
    print(f"setup in {work}: {json.dumps(setup.info)}; profile {profile} ({time.monotonic() - t0:.0f} s)", flush=True)
    runs: Dict[str, List[Dict]] = {m: [] for m in a.modes}
    k = 0
    for rep in range(a.repeats):
        for seed in a.seeds or [a.seed]:
            for pos, mode in enumerate(mode_order(a.modes, k)):
                print(f"repeat {rep} seed {seed} mode {mode} (position {pos})", flush=True)
                runs[mode].append({**run_mode(mode, a, setup, profile, task, seed), "repeat": rep, "position": pos})
                # the raw runs so far, before any summary: an interrupted run or a failing summary loses nothing
                write_results(a.out, __file__, a, t0, None, partial=True, runs=runs, profile=str(profile))
            k += 1
    summary = summarize(runs)
    noise = seed_noise(runs)
    if len(a.seeds or []) > 1:
        print(f"reward vs no speculation, paired by seed: {json.dumps(noise)}")
    for mode, m in summary.items():
        if m.get("respec_steps"):
            print(f"{mode}: adaptive server steps {m['respec_steps']}")
        sp = m.get("speedup_total")
        print(
            f"{mode:6s} step {m['step_s_mean']:.2f} s (gen {m['generation_s_mean']:.2f} drafter "
            f"{m['drafter_update_s_mean']:.2f} policy {m['policy_update_s_mean']:.2f}) batch "
            f"{m['active_batch_mean']:.1f} accept {m['accept_first']}→{m['accept_last']} reward "
            f"{m['reward_mean']:.3f}{_trend(m['reward_trend'])}"
            + (f" acceptance{_trend(m['accept_trend'])}" if m["accept_trend"] else "")
            + (f" speedup {sp:.2f}× (per step median {m['speedup_per_step_median']:.2f}×)"
                                          if sp else "")  # fmt: skip
        )
    png = Path(a.out).with_suffix(".png")
    plot(runs, png)
    write_results(a.out, __file__, a, t0, png, summary=summary, seeds=noise, runs=runs, profile=str(profile))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
