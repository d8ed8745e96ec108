"""ReSpec adaptive server vs no speculation vs always-on speculation vs SGLang's adaptive mode, real CPU SGLang.

    python benchmark/bench_respec_server.py --model smollm2 --profile NGRAM.json --eagle-profile EAGLE3.json \
        --drafter bootstrap --prompts task:toy_add --batch-sizes 1 2 4 8 16 32

The modes (each its own server):

* ``nospec``: no speculation;
* ``ngram`` / ``respec``: SGLang's NGRAM as is / the same server with ``--respec-adaptive --respec-profile``;
* ``eagle3``: EAGLE3 always on (``--eagle-config``, our drafter); ``eagle3_sglang``: the same with SGLang's own
  ``--speculative-adaptive`` (acceptance-EMA step choice, steps 0 still draft-extends);
  ``respec_eagle3``: the same with ``--respec-adaptive --respec-profile EAGLE_PROFILE`` (our plan + FSM).

Each batch is a long-tailed length mix like an RL rollout (most sequences stop early, a few run long); tokens/s
(median, min-max over the repeats) and the ratio to ``nospec`` are printed and written as JSON (+ PNG).

Modes are interleaved and ratios paired. By default (``--alternate``, one server alive at a time, for a shared
machine) every repeat starts each mode's server in turn, the order reversed every other repeat, and runs every
batch size on it once. The ratio of a mode is taken per (overlap, repeat, batch size) against the ``nospec`` run of
the same repeat -- runs from the same stretch of time, so a load change on the machine moves both -- and reported
as the median (min-max) of those per-pair ratios (``paired_ratio`` in the JSON), never as a ratio of medians taken
at different times.

``--together`` (instead of ``--alternate``; giving both is an error): the servers of *all* modes run at once and
every (repeat, batch size) runs each of them in turn (order alternating per repeat), so the paired runs are even
closer in time -- the never-slower check:

    python benchmark/bench_respec_server.py --together --modes nospec respec_eagle3 respec_eagle3_off \
        --eagle-profile P.json --batch-sizes 1 4 16 64 --overlap on --repeats 3

``--overlap on,off`` (default both): each mode's servers for both overlap-scheduler settings run together
(default overlap / ``--disable-overlap-schedule``), in an order alternating per repeat; a mode is paired with the
``nospec`` server of the same overlap setting. A server whose ``/get_server_info`` reports another setting than
asked (SGLang turns overlap off for speculative decoding on CPU) is stopped and its column reads ``n/a``.

``respec_eagle3_off`` is the ReSpec EAGLE3 server forced off (``--respec-force plain``): its every decode step is
ReSpec's off step, so its ratio to ``nospec`` is the off state's cost; ``eagle3_steps0`` is the same server with
``--respec-eagle-off warm``: SGLang's own steps = 0 step (a one-node TARGET_VERIFY forward + draft extend). ``--max-running N`` passes
``--max-running-requests N`` to every server (default: not passed, so each server keeps its own default: SGLang's
48 for always-on speculation, the plan's largest batch for ReSpec EAGLE3, the KV pool's bound without
speculation); each server's value is recorded.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
from pathlib import Path
from typing import Any, Dict, List, Tuple

import requests
from overlap import actual_overlap, fmt, overlap_flags, parse_overlap, spread, stop_servers_on_sigterm

from sglang_spex.respec.profiler import CALIBRATION_PROMPTS, batch_prompts, flush
from sglang_spex.serve import ServerProcess


def rollout_lengths(batch: int, short: int, long: int, seed: int = 0) -> List[int]:
    """Most sequences short, ~1 in 8 long (at least one)."""
    rng = random.Random(seed + batch)
    lens = [long if rng.random() < 0.125 else rng.randint(short // 2, short) for _ in range(batch)]
    lens[0] = long
    return lens


def run_batch(
    url: str, batch: int, short: int, long: int, prompts: List[str] = CALIBRATION_PROMPTS
) -> Dict[str, float]:
    """One cold run: ``/flush_cache`` empties the radix cache and the n-gram corpus so no run learns from the one
    before."""
    flush(url)
    return {**_run_once(url, batch, short, long, prompts), "loadavg": os.getloadavg()[0]}


def post_in_flight(url: str, bodies: List[dict], in_flight: int) -> Tuple[int, float]:
    """One HTTP ``/generate`` request per body, ``in_flight`` at a time (a finished one makes room for the next):
    output tokens and wall seconds."""
    import concurrent.futures as cf

    with cf.ThreadPoolExecutor(max_workers=in_flight) as ex:
        t0 = time.perf_counter()
        outs = list(ex.map(lambda r: requests.post(url + "/generate", json=r, timeout=900).json(), bodies))
        dt = time.perf_counter() - t0
    return sum(len(o["output_ids"]) for o in outs), dt


def _run_once(url: str, batch: int, short: int, long: int, prompts: List[str]) -> Dict[str, float]:
    texts = batch_prompts(batch, prompts)
    lens = rollout_lengths(batch, short, long)
    reqs = [
        {"text": t, "sampling_params": {"temperature": 0, "max_new_tokens": n, "ignore_eos": True}}
        for t, n in zip(texts, lens)
    ]
    requests.post(url + "/generate", json={"text": texts, "sampling_params": {"max_new_tokens": 1}}, timeout=600)
    # one HTTP request per sequence, sent together: they finish independently, like a rollout
    tokens, dt = post_in_flight(url, reqs, batch)
    return {"batch": batch, "tokens": tokens, "seconds": dt, "tok_s": tokens / dt}


def plot(paired: Dict[str, Dict[str, dict]], batch_sizes: List[int], path: Path) -> None:
    """Median of the paired throughput ratios to no speculation (same overlap setting and repeat, see
    :func:`paired_ratios`) per batch size, min-max as error bars, one line per column."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, ax = plt.subplots(figsize=(6, 4))
    for mode, per_ov in paired.items():
        for ov, per in per_ov.items():
            med = [per[b]["median"] for b in batch_sizes]
            err = [
                [m - per[b]["min"] for m, b in zip(med, batch_sizes)],
                [per[b]["max"] - m for m, b in zip(med, batch_sizes)],
            ]
            ax.errorbar(batch_sizes, med, yerr=err, marker="o", capsize=2, label=f"{mode} overlap {ov}")
    ax.axhline(1.0, color="grey", lw=0.8, ls="--")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("batch size (rollout, long-tailed lengths)")
    ax.set_ylabel("tokens/s vs no speculation (paired runs)")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"written {path}")


def _server_facts(url: str, mode: str) -> dict:
    """What the server runs with (max running requests) and, for ReSpec, its runtime report."""
    info = requests.get(url + "/get_server_info", timeout=60).json()
    out = {"max_running_requests": info.get("max_running_requests")}
    if mode.startswith("respec"):
        out["respec"] = info["internal_states"][0].get("respec")
    return out


def mode_order(names: List[Any], rep: int) -> List[Any]:
    """The order modes (or servers) run in, in repeat ``rep``: as given in even repeats, reversed in odd ones, so
    none of them always runs first or last."""
    return list(names) if rep % 2 == 0 else list(names)[::-1]


def measure_together(
    modes: Dict[str, List[str]], overlaps: List[str], a: argparse.Namespace, prompts: List[str]
) -> Dict[str, dict]:
    """Every (mode, overlap) server alive at once; each (repeat, batch size) runs all of them in turn, the order
    reversed every other repeat. Returns per mode what :func:`measure_mode` returns."""
    servers: Dict[tuple, ServerProcess] = {}
    out: Dict[str, Any] = {m: {"runs": {}, "overlap_actual": {}, "state": {}, "server": {}} for m in modes}
    try:
        for mode, args in modes.items():
            for ov in overlaps:
                srv = servers[(mode, ov)] = ServerProcess(args + overlap_flags(ov))
                srv.start()
                out[mode]["overlap_actual"][ov] = actual_overlap(srv.url)
                if out[mode]["overlap_actual"][ov] != ov:
                    print(f"{mode}: overlap {ov} asked, server runs overlap {out[mode]['overlap_actual'][ov]}: n/a")
                    servers.pop((mode, ov)).stop()
                    continue
                out[mode]["runs"][ov] = {b: [] for b in a.batch_sizes}
                out[mode]["server"][ov] = _server_facts(srv.url, mode)
        keys = list(servers)
        for rep in range(a.repeats):
            for b in a.batch_sizes:
                for mode, ov in mode_order(keys, rep):
                    r = run_batch(servers[(mode, ov)].url, b, a.short, a.long, prompts)
                    out[mode]["runs"][ov][b].append({**r, "repeat": rep})
            line = "  ".join(
                f"{m}/{ov} " + " ".join(f"B={b}:{out[m]['runs'][ov][b][-1]['tok_s']:.0f}" for b in a.batch_sizes)
                for m, ov in keys
            )
            print(f"repeat {rep}: {line} tok/s", flush=True)
        for mode, ov in keys:
            if mode.startswith("respec"):
                out[mode]["state"][ov] = _server_facts(servers[(mode, ov)].url, mode)["respec"]
    finally:
        for srv in servers.values():
            srv.stop()
    return out


def measure_alternating(
    modes: Dict[str, List[str]], overlaps: List[str], a: argparse.Namespace, prompts: List[str]
) -> Dict[str, dict]:
    """One server at a time: each repeat runs every mode once (a fresh server, order reversed every other repeat)
    and appends its runs, tagged ``repeat``, so run ``r`` of every mode comes from the same stretch of time. The
    results so far are rewritten to ``a.out`` after every mode (kept if the run is cut short)."""
    once = argparse.Namespace(**{**vars(a), "repeats": 1})
    out: Dict[str, dict] = {}
    names = list(modes)
    for rep in range(a.repeats):
        for mode in mode_order(names, rep):
            r = measure_mode(mode, modes[mode], overlaps, once, prompts, first_repeat=rep)
            if mode not in out:
                out[mode] = r
            else:
                for ov, runs in r["runs"].items():
                    for b, rs in runs.items():
                        out[mode]["runs"].setdefault(ov, {}).setdefault(b, []).extend(rs)
                out[mode].setdefault("state_per_repeat", [dict(out[mode]["state"])]).append(r["state"])
                out[mode]["state"].update(r["state"])  # the last repeat's runtime report
            a.out.write_text(json.dumps({"partial": True, "results": out}, indent=1))  # kept if the run is cut short
    return out


def measure_mode(
    mode: str, args: List[str], overlaps: List[str], a: argparse.Namespace, prompts: List[str], first_repeat: int = 0
) -> dict:
    """This mode's servers, one per overlap setting, alive together; ``a.repeats`` repeats, numbered from
    ``first_repeat`` (the ``repeat`` tag of each run; the overlap settings' order alternates with it)."""
    servers: Dict[str, ServerProcess] = {}
    out: Dict[str, Any] = {"runs": {}, "overlap_actual": {}, "state": {}}
    try:
        for ov in overlaps:
            srv = servers[ov] = ServerProcess(args + overlap_flags(ov))
            srv.start()  # registered first: an interrupted start is stopped too
            out["overlap_actual"][ov] = actual_overlap(srv.url)
            if out["overlap_actual"][ov] != ov:
                print(f"{mode}: overlap {ov} asked, server runs overlap {out['overlap_actual'][ov]}: column n/a")
                servers.pop(ov).stop()
                continue
            out["runs"][ov] = {b: [] for b in a.batch_sizes}
            out.setdefault("server", {})[ov] = _server_facts(srv.url, mode)
        for rep in range(first_repeat, first_repeat + a.repeats):
            for ov in mode_order(list(servers), rep):
                for b in a.batch_sizes:
                    r = run_batch(servers[ov].url, b, a.short, a.long, prompts)
                    out["runs"][ov][b].append({**r, "repeat": rep})
                line = " ".join(f"B={b}:{out['runs'][ov][b][-1]['tok_s']:.1f}" for b in a.batch_sizes)
                print(f"{mode:13s} overlap {ov:3s} repeat {rep}: {line} tok/s", flush=True)
        for ov, srv in servers.items():
            if mode.startswith("respec"):
                info = requests.get(srv.url + "/get_server_info", timeout=60).json()
                out["state"][ov] = info["internal_states"][0].get("respec")
    finally:
        for srv in servers.values():
            srv.stop()
    return out


def paired_ratios(results: Dict[str, dict], batch_sizes: List[int]) -> Dict[str, Dict[str, dict]]:
    """Each mode's tokens/s over the ``nospec`` run of the same (overlap, repeat, batch size), as median (min-max)
    of those per-pair ratios (``n``: the pairs): runs from the same stretch of time, so a load change on the machine
    moves both. Runs pair by their ``repeat`` tag (by position for rows without one); a repeat that only one side
    has is left out."""
    base = results.get("nospec")
    out: Dict[str, Dict[str, dict]] = {}
    if base is None:
        return out
    for mode, res in results.items():
        if mode == "nospec":
            continue
        for ov, runs in res["runs"].items():
            if ov not in base["runs"]:
                continue
            per = {}
            for b in batch_sizes:
                mine, ref = _by_repeat(runs.get(b, [])), _by_repeat(base["runs"][ov].get(b, []))
                per[b] = spread([mine[k]["tok_s"] / ref[k]["tok_s"] for k in sorted(mine) if k in ref])
            out.setdefault(mode, {})[ov] = per
    return out


def _by_repeat(rows: List[dict]) -> Dict[int, dict]:
    return {r.get("repeat", i): r for i, r in enumerate(rows)}


def table_lines(
    results: Dict[str, dict],
    summary: Dict[str, Dict[str, Any]],
    paired: Dict[str, Dict[str, dict]],
    modes: List[str],
    overlaps: List[str],
    batch_sizes: List[int],
) -> List[str]:
    """The printed table: per (mode, overlap) and batch size tokens/s median (min-max) and, where ``nospec`` ran
    with the same overlap, the paired ratio median (min-max) (:func:`paired_ratios`)."""
    lines = []
    for mode in modes:
        for ov in overlaps:
            per = summary[mode][ov]
            if per is None:
                lines.append(
                    f"{mode:17s} overlap {ov:3s} n/a (server ran overlap {results[mode]['overlap_actual'][ov]})"
                )
                continue
            ratio = paired.get(mode, {}).get(ov)
            cells = [f"B={b}: {fmt(per[b], 0)}" + (f" {fmt(ratio[b], 2)}x" if ratio else "") for b in batch_sizes]
            lines.append(f"{mode:17s} overlap {ov:3s} " + "  ".join(cells))
    return lines


MODES = ("nospec", "ngram", "respec", "eagle3", "eagle3_sglang", "respec_eagle3", "respec_eagle3_off", "eagle3_steps0")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--profile", default=None, help="NGRAM ReSpec profile JSON (scripts/respec_profile.py)")
    ap.add_argument("--eagle-profile", default=None, help="EAGLE3 ReSpec profile JSON (scripts/respec_profile.py)")
    ap.add_argument("--config", default="NGRAM:s4t1n4", help="the NGRAM config the spec servers run")
    ap.add_argument("--eagle-config", default="EAGLE3:s3t1n4", help="the EAGLE3 config the EAGLE servers start with")
    ap.add_argument("--drafter", default="bootstrap", help="EAGLE3 draft model path or 'bootstrap'")
    ap.add_argument("--prompts", default="calibration", help="'calibration' or 'task:NAME'")
    ap.add_argument("--batch-sizes", nargs="+", type=int, default=[1, 2, 4, 8, 16, 32])
    ap.add_argument("--short", type=int, default=24)
    ap.add_argument("--long", type=int, default=128)
    ap.add_argument("--hysteresis", default="1,8,2")
    ap.add_argument(
        "--repeats",
        type=int,
        default=3,
        help="interleaved runs per (mode, overlap, batch size), each paired with nospec's of the same repeat",
    )
    ap.add_argument("--overlap", default="on,off", help="overlap scheduler settings, comma list of on/off")
    ap.add_argument("--modes", nargs="+", default=list(MODES))
    how = ap.add_mutually_exclusive_group()
    how.add_argument("--together", action="store_true", help="all modes' servers at once, modes interleaved")
    how.add_argument("--alternate", action="store_true", help="modes interleaved, one server at a time (the default)")
    ap.add_argument("--server-args", default="", help="more launcher flags for every server, one string")
    ap.add_argument("--max-running", type=int, default=0, help="--max-running-requests for every server (0: none)")
    ap.add_argument("--out", type=Path, default=Path("respec_server_bench.json"))
    a = ap.parse_args(argv)
    if a.repeats < 1:
        ap.error("--repeats must be >= 1")
    stop_servers_on_sigterm()

    from sglang_spex.models import prepare_smollm2, prepare_tiny_llama
    from sglang_spex.respec.profiler import SpecConfig, default_drafter, prompt_set

    try:
        overlaps = parse_overlap(a.overlap)
    except ValueError as e:
        ap.error(str(e))
    bad = [m for m in a.modes if m not in MODES]
    if bad:
        ap.error(f"--modes: unknown {bad}; choose from {MODES}")
    for mode, flag, value in (
        ("respec", "--profile", a.profile),
        ("respec_eagle3", "--eagle-profile", a.eagle_profile),
    ):
        if mode in a.modes and not value:
            ap.error(f"mode {mode} needs {flag}")
    model = {"smollm2": lambda: str(prepare_smollm2()), "tiny": lambda: str(prepare_tiny_llama())}.get(
        a.model, lambda: a.model
    )()
    prompts = prompt_set(a.prompts, model)
    spec = SpecConfig.parse(a.config).server_args()
    common = ["--model-path", model, "--attention-backend", "spex_cpu"]
    common += ["--max-running-requests", str(a.max_running)] if a.max_running else []
    common += a.server_args.split()
    modes = {"nospec": common, "ngram": common + spec}
    modes["respec"] = modes["ngram"] + ["--respec-adaptive", "--respec-profile", str(a.profile)]
    if any(m.startswith(("eagle3", "respec_eagle3")) for m in a.modes):
        drafter = default_drafter(model) if a.drafter == "bootstrap" else a.drafter
        eagle = common + SpecConfig.parse(a.eagle_config).server_args() + ["--speculative-draft-model-path", drafter]
        modes["eagle3"] = eagle
        modes["eagle3_sglang"] = eagle + ["--speculative-adaptive"]
        modes["respec_eagle3"] = eagle + ["--respec-adaptive", "--respec-profile", str(a.eagle_profile)]
        modes["respec_eagle3_off"] = eagle + ["--respec-adaptive", "--respec-force", "plain"]
        modes["eagle3_steps0"] = modes["respec_eagle3_off"] + ["--respec-eagle-off", "warm"]
    run_args = {
        m: modes[m] + (["--respec-hysteresis", a.hysteresis] if m.startswith("respec") else []) for m in a.modes
    }
    measure = measure_together if a.together else measure_alternating
    results = measure(run_args, overlaps, a, prompts)
    summary: Dict[str, Dict[str, Any]] = {}
    for mode in a.modes:
        summary[mode] = {
            ov: (
                {b: spread([r["tok_s"] for r in results[mode]["runs"][ov][b]]) for b in a.batch_sizes}
                if ov in results[mode]["runs"]
                else None
            )
            for ov in overlaps
        }
    paired = paired_ratios(results, a.batch_sizes)
    how = "all servers at once" if a.together else "one server at a time"
    print(
        f"\ntokens/s, median (min-max) of {a.repeats} interleaved repeats ({how}); ratio to nospec (same overlap): "
        "median (min-max) of the per-repeat ratios of paired runs"
    )
    print("\n".join(table_lines(results, summary, paired, a.modes, overlaps, a.batch_sizes)))
    a.out.write_text(json.dumps({"summary": summary, "paired_ratio": paired, "results": results}, indent=1))
    print(f"written {a.out}")
    if paired:
        plot(paired, a.batch_sizes, a.out.with_suffix(".png"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
