"""Evidence for SPEX's determinism question: is a seeded sample independent of the batch it runs in?

Samples N prompts with fixed seeds once alone (batch 1, sequentially) and once all together (one batch), on a
running sglang-spex server (``--tot-speculation`` enables seeded sampling, hook H2), and reports how many
outputs differ and at which token — plus whether greedy (temperature 0) outputs differ too, which isolates
the logits (bf16 batch-shape numerics) from the sampler.

    .venv/bin/python scripts/probe_determinism.py --url http://127.0.0.1:30000 --n 16
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import json

import requests


def gen(url: str, text: str, seed: int, temperature: float, n: int) -> list:
    body = {"text": text, "sampling_params": {"max_new_tokens": n, "temperature": temperature, "sampling_seed": seed}}
    return requests.post(url + "/generate", json=body, timeout=600).json()["output_ids"]


def first_diff(a: list, b: list) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), -1 if len(a) == len(b) else min(len(a), len(b)))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", required=True)
    ap.add_argument("--n", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=48)
    args = ap.parse_args()
    prompts = [f"Question {i}: what is {i + 3} + {2 * i + 5}? Let us think step by step." for i in range(args.n)]
    report = {}
    for temp in (0.0, 1.0):
        alone = [gen(args.url, p, 1000 + i, temp, args.tokens) for i, p in enumerate(prompts)]
        with cf.ThreadPoolExecutor(args.n) as ex:
            together = list(
                ex.map(lambda ip: gen(args.url, ip[1], 1000 + ip[0], temp, args.tokens), enumerate(prompts))
            )
        diffs = [first_diff(a, b) for a, b in zip(alone, together)]
        report[f"temperature={temp}"] = {
            "differ": sum(d >= 0 for d in diffs),
            "of": args.n,
            "first_differing_token": [d for d in diffs if d >= 0],
        }
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
