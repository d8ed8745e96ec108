"""Baseline vs SPEX on the real CPU SGLang server (SmolLM2-135M), side by side in one run.

Same questions, same seeds: for each policy and each number of concurrent queries, runs the baseline, SPEX
with T1+T2 (pure scheduling: the identical search), and SPEX with T1+T2+T3 (early stop changes the search).
Prints questions/min and the ratio to the baseline, accuracy and the speculation accounting; writes JSON.

    .venv/bin/python benchmark/bench_tot.py --policies rebase-16,rstar-10 --concurrency 1,2,4 --questions 4
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import time
from pathlib import Path
from typing import Any, Dict, List, Optional

import requests
from tqdm import tqdm

from sglang_spex.config import SpexConfig
from sglang_spex.serve import ServerProcess
from sglang_spex.speculation.runner import SpecBudget, context_factory
from sglang_spex.tot.http_port import HttpPort
from sglang_spex.tot.policies import PRESETS
from sglang_spex.tot.search import run_batch
from sglang_spex.tot.search_spec import SearchSpec
from sglang_spex.tot.tasks import get_task

PROMPT = (
    "<|im_start|>system\nSolve the problem step by step, one short step per paragraph. "
    "Finish with 'The answer is N.'<|im_end|>\n<|im_start|>user\n{question}<|im_end|>\n<|im_start|>assistant\n"
)
MODES = {
    "baseline": None,
    "spex_t1t2": dict(components=("t1", "t2"), early_stop=False),
    "spex_t1t2t3": dict(components=("t1", "t2", "t3"), early_stop=True),
}


def build_spec(preset: str, max_depth: int, step_tokens: int, seed: int) -> SearchSpec:
    name, knobs = PRESETS[preset]
    policy = {"name": name, **knobs, "max_depth": max_depth}
    if name == "rest":
        policy.update(iterations=3 * knobs.get("target_answers", 5))
    if name == "ets":
        policy.setdefault("embedder", "tfidf")
    return SearchSpec.from_dict(
        {
            "policy": policy,
            "step": {
                "max_tokens": step_tokens,
                "stop": ["\n\n"],
                "temperature": 0.8,
                "prompt_template": PROMPT,
                "max_total_tokens": max_depth * step_tokens,
            },
            "reward": {"type": "logprob"},
            "answer": {"aggregate": "weighted"},
            "task": "toy_add",
            "seed": seed,
        }
    )


def flush_cache(url: str) -> None:
    """Empty SGLang's radix cache so no run reuses the prefixes an earlier run (same seeds) computed."""
    requests.post(url + "/flush_cache", timeout=60).raise_for_status()


async def run_real(
    url: str,
    spec: SearchSpec,
    questions,
    concurrency: int,
    mode: Optional[dict],
    k_total: int,
    port: Optional[HttpPort] = None,
):
    """One measured batch on a real server (radix cache flushed first): (results, wall seconds). ``port``: an
    HttpPort to ``url`` to use (closed afterwards) instead of a fresh one."""
    flush_cache(url)
    port = port or HttpPort(url)
    kw: Dict[str, Any] = {}
    if mode is not None:
        cfg = SpexConfig(enabled=True, k_total=k_total, **mode)
        kw["context_factory"] = context_factory(cfg, SpecBudget(k_total, cfg.budget_temperature, cfg.min_share))
    t0 = time.monotonic()
    try:
        results = await run_batch(
            spec,
            [q.text for q in questions],
            port,
            concurrency=concurrency,
            references=[q.reference for q in questions],
            **kw,
        )
    finally:
        await port.close()
    return results, time.monotonic() - t0


async def run_mode(url: str, spec: SearchSpec, questions, concurrency: int, mode: Optional[dict], k_total: int):
    results, wall = await run_real(url, spec, questions, concurrency, mode, k_total)
    acc: Dict[str, Any] = {}
    for r in results:
        for key, value in (r.speculation or {}).items():
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                acc[key] = acc.get(key, 0) + value
    acc["early_stops"] = sum(bool((r.speculation or {}).get("early_stopped")) for r in results)
    return {
        "wall_s": round(wall, 2),
        "q_per_min": round(len(questions) / wall * 60, 3),
        "accuracy": sum(bool(r.correct) for r in results) / len(results),
        "tokens": sum(r.tokens_generated for r in results),
        "requests": sum(r.num_requests for r in results),
        "answers": [r.answer for r in results],
        "speculation": acc or None,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--policies", default="rebase-16,rstar-10")
    ap.add_argument("--concurrency", default="1,2,4")
    ap.add_argument("--questions", type=int, default=4)
    ap.add_argument("--max-depth", type=int, default=4)
    ap.add_argument("--step-tokens", type=int, default=32)
    ap.add_argument("--k-total", type=int, default=8)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--url", help="use a running server instead of starting SmolLM2")
    ap.add_argument("--out", default="benchmark/results/bench_tot.json")
    args = ap.parse_args()
    policies = args.policies.split(",")
    concs = [int(c) for c in args.concurrency.split(",")]
    questions = get_task("toy_add").questions(args.questions, split="test", seed=args.seed)
    server = None if args.url else ServerProcess(["--tot-speculation", "--tot-k-total", str(args.k_total)]).start()
    url = args.url or server.url
    rows: List[Dict[str, Any]] = []
    try:
        for policy in policies:  # warm-up (not measured): first-request costs must not land on the baseline
            asyncio.run(run_mode(url, build_spec(policy, 1, 4, args.seed + 1), questions[:1], 1, None, args.k_total))
        runs = [(p, c, m) for p in policies for c in concs for m in MODES]
        for policy, conc, mode in tqdm(runs, desc="bench_tot"):
            spec = build_spec(policy, args.max_depth, args.step_tokens, args.seed)
            row = {
                "policy": policy,
                "concurrency": conc,
                "mode": mode,
                **asyncio.run(run_mode(url, spec, questions, conc, MODES[mode], args.k_total)),
            }
            rows.append(row)
    finally:
        if server is not None:
            server.stop()
    base = {(r["policy"], r["concurrency"]): r["q_per_min"] for r in rows if r["mode"] == "baseline"}
    print(
        f"\n{'policy':10} {'conc':>4} {'mode':12} {'q/min':>7} {'ratio':>6} {'acc':>5} {'tokens':>7} {'hits/issued':>12}"
    )
    for r in rows:
        r["ratio"] = round(r["q_per_min"] / base[(r["policy"], r["concurrency"])], 3)
        s = r["speculation"] or {}
        hits = f"{s.get('hits', 0)}/{s.get('issued', 0)}" if s else "-"
        print(
            f"{r['policy']:10} {r['concurrency']:>4} {r['mode']:12} {r['q_per_min']:>7.2f} {r['ratio']:>6.2f} "
            f"{r['accuracy']:>5.2f} {r['tokens']:>7} {hits:>12}"
        )
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    meta = {"host_cpus": os.cpu_count(), "args": vars(args), "source": "real CPU SGLang server, SmolLM2-135M"}
    Path(args.out).write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
