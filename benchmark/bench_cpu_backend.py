"""Decode tokens/s of the ``spex_cpu`` attention backend vs SGLang's ``torch_native`` at several batch sizes.

Each backend gets its own server (one at a time). Decode rate at batch B is isolated from prefill by
timing two runs that differ only in ``max_new_tokens``: rate = B * (n_long - n_short) / (t_long - t_short).

    python benchmark/bench_cpu_backend.py [--model PATH] [--batch-sizes 1 4 8 16 32]
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Dict, List

import requests

from sglang_spex.serve import ServerProcess

PROMPT = "Write a long story about a lighthouse keeper and the sea. Chapter {i}:"


def _run(url: str, bs: int, n: int) -> float:
    payload = {
        "text": [PROMPT.format(i=i) for i in range(bs)],
        "sampling_params": {"temperature": 0, "max_new_tokens": n, "ignore_eos": True},
    }
    t0 = time.perf_counter()
    r = requests.post(url + "/generate", json=payload, timeout=600)
    r.raise_for_status()
    return time.perf_counter() - t0


def measure(
    model: str, backend: str, batch_sizes: List[int], n_short: int, n_long: int, repeats: int
) -> Dict[int, float]:
    """Decode tokens/s per batch size for one backend."""
    rates: Dict[int, float] = {}
    with ServerProcess(["--model-path", model, "--attention-backend", backend]) as srv:
        _run(srv.url, 1, 4)  # warm-up (and prefix cache for the prompts)
        for bs in batch_sizes:
            best = 0.0
            for _ in range(repeats):
                t_short = _run(srv.url, bs, n_short)
                t_long = _run(srv.url, bs, n_long)
                best = max(best, bs * (n_long - n_short) / max(t_long - t_short, 1e-6))
            rates[bs] = best
            print(f"  {backend:13s} B={bs:3d}  {best:8.1f} tok/s", flush=True)
    return rates


def main() -> None:
    from sglang_spex.models import prepare_smollm2

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="model path (default: SmolLM2-135M-Instruct)")
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 4, 8, 16, 32])
    ap.add_argument("--n-short", type=int, default=8)
    ap.add_argument("--n-long", type=int, default=40)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--backends", nargs=2, default=["torch_native", "spex_cpu"], metavar=("BASE", "OURS"))
    ap.add_argument("--json", default=None, help="also write the results here")
    args = ap.parse_args()
    model = args.model or str(prepare_smollm2())
    base, ours = args.backends
    res = {b: measure(model, b, args.batch_sizes, args.n_short, args.n_long, args.repeats) for b in (base, ours)}
    print(f"\n{'B':>4} {base + ' tok/s':>18} {ours + ' tok/s':>16} {'ratio':>7}")
    for bs in args.batch_sizes:
        print(f"{bs:4d} {res[base][bs]:18.1f} {res[ours][bs]:16.1f} {res[ours][bs] / res[base][bs]:7.2f}x")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"model": model, "results": res}, f, indent=2)


if __name__ == "__main__":
    main()
