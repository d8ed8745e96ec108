"""ReSpec adaptive server vs no speculation vs always-on speculation vs SGLang's adaptive mode, real CPU SGLang.

    python benchmark/bench_respec_server.py --model smollm2 --profile NGRAM.json --eagle-profile EAGLE3.json \
        --drafter bootstrap --prompts task:toy_add --batch-sizes 1 2 4 8 16 32

For each mode one server (one at a time):

* ``nospec``: no speculation;
* ``ngram`` / ``respec``: SGLang's NGRAM as is / the same server with ``--respec-adaptive --respec-profile``;
* ``eagle3``: EAGLE3 always on (``--eagle-config``, our drafter); ``eagle3_sglang``: the same with SGLang's own
  ``--speculative-adaptive`` (acceptance-EMA step choice, steps 0 still draft-extends);
  ``respec_eagle3``: the same with ``--respec-adaptive --respec-profile EAGLE_PROFILE`` (our plan + FSM).

Each batch is a long-tailed length mix like an RL rollout (most sequences stop early, a few run long); tokens/s
and the ratio to ``nospec`` are printed and written as JSON (+ PNG).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
from pathlib import Path
from typing import Dict, List

import requests
from tqdm import tqdm

from sglang_spex.respec.profiler import CALIBRATION_PROMPTS, batch_prompts, flush
from sglang_spex.serve import ServerProcess


def rollout_lengths(batch: int, short: int, long: int, seed: int = 0) -> List[int]:
    """Most sequences short, ~1 in 8 long (at least one)."""
    rng = random.Random(seed + batch)
    lens = [long if rng.random() < 0.125 else rng.randint(short // 2, short) for _ in range(batch)]
    lens[0] = long
    return lens


def run_batch(
    url: str, batch: int, short: int, long: int, prompts: List[str] = CALIBRATION_PROMPTS, repeats: int = 1
) -> Dict[str, float]:
    """The fastest of ``repeats`` runs (other processes on a shared machine only ever add time), each cold:
    ``/flush_cache`` empties the radix cache and the n-gram corpus so no run learns from the one before."""
    runs = []
    for _ in range(max(1, repeats)):
        flush(url)
        runs.append(_run_once(url, batch, short, long, prompts))
    best = max(runs, key=lambda r: r["tok_s"])
    return {**best, "runs_tok_s": [r["tok_s"] for r in runs], "loadavg": os.getloadavg()[0]}


def _run_once(url: str, batch: int, short: int, long: int, prompts: List[str]) -> Dict[str, float]:
    texts = batch_prompts(batch, prompts)
    lens = rollout_lengths(batch, short, long)
    reqs = [
        {"text": t, "sampling_params": {"temperature": 0, "max_new_tokens": n, "ignore_eos": True}}
        for t, n in zip(texts, lens)
    ]
    requests.post(url + "/generate", json={"text": texts, "sampling_params": {"max_new_tokens": 1}}, timeout=600)
    t0 = time.perf_counter()
    # one HTTP request per sequence, sent together: they finish independently, like a rollout
    import concurrent.futures as cf

    with cf.ThreadPoolExecutor(max_workers=batch) as ex:
        outs = list(ex.map(lambda r: requests.post(url + "/generate", json=r, timeout=900).json(), reqs))
    dt = time.perf_counter() - t0
    tokens = sum(len(o["output_ids"]) for o in outs)
    return {"batch": batch, "tokens": tokens, "seconds": dt, "tok_s": tokens / dt}


def plot(results: Dict[str, list], modes: List[str], batch_sizes: List[int], path: Path) -> None:
    """Throughput ratio to no speculation per batch size, one line per mode."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, ax = plt.subplots(figsize=(6, 4))
    for mode in modes:
        ratios = [r["tok_s"] / b["tok_s"] for r, b in zip(results[mode], results["nospec"])]
        ax.plot(batch_sizes, ratios, marker="o", label=mode)
    ax.axhline(1.0, color="grey", lw=0.8, ls="--")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("batch size (rollout, long-tailed lengths)")
    ax.set_ylabel("tokens/s vs no speculation")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"written {path}")


MODES = ("nospec", "ngram", "respec", "eagle3", "eagle3_sglang", "respec_eagle3")


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
    ap.add_argument("--repeats", type=int, default=2, help="runs per (mode, batch size); the fastest counts")
    ap.add_argument("--modes", nargs="+", default=list(MODES))
    ap.add_argument("--out", type=Path, default=Path("respec_server_bench.json"))
    a = ap.parse_args(argv)

    from sglang_spex.models import prepare_smollm2, prepare_tiny_llama
    from sglang_spex.respec.profiler import SpecConfig, default_drafter, prompt_set

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
    common = ["--model-path", model, "--attention-backend", "spex_cpu", "--max-running-requests", "64"]
    modes = {"nospec": common, "ngram": common + spec}
    modes["respec"] = modes["ngram"] + ["--respec-adaptive", "--respec-profile", str(a.profile)]
    if any(m.startswith(("eagle3", "respec_eagle3")) for m in a.modes):
        drafter = default_drafter(model) if a.drafter == "bootstrap" else a.drafter
        eagle = common + SpecConfig.parse(a.eagle_config).server_args() + ["--speculative-draft-model-path", drafter]
        modes["eagle3"] = eagle
        modes["eagle3_sglang"] = eagle + ["--speculative-adaptive"]
        modes["respec_eagle3"] = eagle + ["--respec-adaptive", "--respec-profile", str(a.eagle_profile)]
    results: Dict[str, list] = {}
    for mode in a.modes:
        args = modes[mode] + (["--respec-hysteresis", a.hysteresis] if mode.startswith("respec") else [])
        with ServerProcess(args) as srv:
            results[mode] = [
                run_batch(srv.url, b, a.short, a.long, prompts, a.repeats)
                for b in tqdm(a.batch_sizes, desc=mode, leave=False)
            ]
            if mode.startswith("respec"):
                results[f"{mode}_state"] = (
                    requests.get(srv.url + "/get_server_info", timeout=60).json()["internal_states"][0].get("respec")
                )
        for r in results[mode]:
            print(f"{mode:13s} B={r['batch']:3d} {r['tok_s']:8.1f} tok/s ({r['tokens']} tokens, {r['seconds']:.1f} s)")
    if "nospec" in results:
        for mode in a.modes:
            ratios = [r["tok_s"] / b["tok_s"] for r, b in zip(results[mode], results["nospec"])]
            print(f"{mode:13s} vs nospec: " + " ".join(f"B={b}:{x:.2f}x" for b, x in zip(a.batch_sizes, ratios)))
    a.out.write_text(json.dumps(results, indent=1))
    print(f"written {a.out}")
    if "nospec" in results:
        plot(results, a.modes, a.batch_sizes, a.out.with_suffix(".png"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
