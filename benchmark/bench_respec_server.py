"""ReSpec adaptive server vs no speculation vs always-on speculation on the real CPU SGLang server.

    python benchmark/bench_respec_server.py --model smollm2 --profile PROFILE.json --batch-sizes 1 8 32

For each mode one server (one at a time): ``nospec``; ``ngram`` (SGLang's NGRAM as is); ``respec`` (the same NGRAM
server with ``--respec-adaptive --respec-profile PROFILE``). SGLang's own ``--speculative-adaptive`` is EAGLE /
EAGLE3 only and is not run here with NGRAM. Each batch is a long-tailed length mix like an RL rollout (most
sequences stop early, a few run long); tokens/s and the ratio to ``nospec`` are printed and written as JSON.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path
from typing import Dict, List

import requests

from sglang_spex.respec.profiler import CALIBRATION_PROMPTS, batch_prompts
from sglang_spex.serve import ServerProcess


def rollout_lengths(batch: int, short: int, long: int, seed: int = 0) -> List[int]:
    """Most sequences short, ~1 in 8 long (at least one)."""
    rng = random.Random(seed + batch)
    lens = [long if rng.random() < 0.125 else rng.randint(short // 2, short) for _ in range(batch)]
    lens[0] = long
    return lens


def run_batch(url: str, batch: int, short: int, long: int) -> Dict[str, float]:
    texts = batch_prompts(batch, CALIBRATION_PROMPTS)
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


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--profile", required=True, help="ReSpec profile JSON (scripts/respec_profile.py)")
    ap.add_argument("--config", default="NGRAM:s4t1n4", help="the NGRAM config the spec servers run")
    ap.add_argument("--batch-sizes", nargs="+", type=int, default=[1, 8, 32])
    ap.add_argument("--short", type=int, default=24)
    ap.add_argument("--long", type=int, default=128)
    ap.add_argument("--hysteresis", default="1,8,2")
    ap.add_argument("--modes", nargs="+", default=["nospec", "ngram", "respec"])
    ap.add_argument("--out", type=Path, default=Path("respec_server_bench.json"))
    a = ap.parse_args(argv)

    from sglang_spex.models import prepare_smollm2, prepare_tiny_llama
    from sglang_spex.respec.profiler import SpecConfig

    model = {"smollm2": lambda: str(prepare_smollm2()), "tiny": lambda: str(prepare_tiny_llama())}.get(
        a.model, lambda: a.model
    )()
    spec = SpecConfig.parse(a.config).server_args()
    common = ["--model-path", model, "--attention-backend", "spex_cpu", "--max-running-requests", "64"]
    modes = {
        "nospec": common,
        "ngram": common + spec,
        "respec": common
        + spec
        + ["--respec-adaptive", "--respec-profile", str(a.profile), "--respec-hysteresis", a.hysteresis],
    }
    results: Dict[str, list] = {}
    for mode in a.modes:
        with ServerProcess(modes[mode]) as srv:
            results[mode] = [run_batch(srv.url, b, a.short, a.long) for b in a.batch_sizes]
            if mode == "respec":
                results["respec_state"] = (
                    requests.get(srv.url + "/get_server_info", timeout=60).json()["internal_states"][0].get("respec")
                )
        for r in results[mode]:
            print(f"{mode:7s} B={r['batch']:3d} {r['tok_s']:8.1f} tok/s ({r['tokens']} tokens, {r['seconds']:.1f} s)")
    if "nospec" in results:
        for mode in a.modes:
            ratios = [r["tok_s"] / b["tok_s"] for r, b in zip(results[mode], results["nospec"])]
            print(f"{mode:7s} vs nospec: " + " ".join(f"B={b}:{x:.2f}x" for b, x in zip(a.batch_sizes, ratios)))
    a.out.write_text(json.dumps(results, indent=1))
    print(f"written {a.out}")
    if "nospec" in results:
        plot(results, a.modes, a.batch_sizes, a.out.with_suffix(".png"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
