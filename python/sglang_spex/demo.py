"""``make demo``: serve SmolLM2-135M on CPU SGLang (--tot-speculation), then run a REBASE search and an
rSTAR-MCTS search server-side (POST /tot/search) on a handful of toy-addition questions, printing each
question's answer, correctness and tokens, and questions/min per policy."""

from __future__ import annotations

import argparse
import time
from typing import List

import httpx
from tqdm import tqdm

import sglang_spex.lang as tot
from sglang_spex.serve import ServerProcess
from sglang_spex.tot.tasks import Question, get_task

CHAT = (
    "<|im_start|>user\n{question} Answer with a short calculation, then 'The answer is N.'<|im_end|>\n"
    "<|im_start|>assistant\n"
)
ANSWER = r"[Tt]he answer is[:\s]*\$?(-?[\d,]+(?:\.\d+)?)"


def programs(seed: int) -> List[tot.Program]:
    @tot.search
    def rebase_demo(s):
        s.policy(tot.rebase(width=4, max_depth=4))
        s.prompt(CHAT)
        s.step(stop=["\n"], max_tokens=40, temperature=0.8, seed=seed, max_total_tokens=160)
        s.reward(tot.logprob())
        s.answer(ANSWER, aggregate="weighted", score="mean")

    @tot.search
    def rstar_demo(s):
        s.policy(tot.rstar(num_rollouts=4, max_depth=3, branch=2, target_answers=3))
        s.prompt(CHAT)
        s.step(stop=["\n"], max_tokens=40, temperature=0.8, seed=seed, max_total_tokens=160)
        s.reward(tot.logprob())
        s.answer(ANSWER, aggregate="majority")

    return [rebase_demo, rstar_demo]


def run_policy(prog: tot.Program, qs: List[Question], url: str, concurrency: int) -> None:
    name = prog.spec().policy.name
    bar = tqdm(total=len(qs), desc=f"{name:>7}", unit="q")
    t0 = time.monotonic()
    results = prog.run_batch(
        [q.text for q in qs],
        tot.Endpoint(url),
        references=[q.reference for q in qs],
        concurrency=concurrency,
        on_result=lambda i, r: bar.update(1),
    )
    wall = time.monotonic() - t0
    bar.close()
    for q, r in zip(qs, results):
        mark = "✓" if r.correct else "✗"
        print(
            f"  {mark} {q.text:<18} answer={str(r.answer):<6} ref={q.reference:<4} tokens={r.tokens_generated:<5} "
            f"requests={r.num_requests:<3} nodes_failed={len(r.failures)} {r.wall_time:5.1f}s"
        )
    right = sum(bool(r.correct) for r in results)
    tokens = sum(r.tokens_generated for r in results)
    print(
        f"  {name}: {right}/{len(qs)} correct, {tokens} tokens, {len(qs) / wall * 60:.1f} questions/min "
        f"({wall:.1f}s, {tokens / wall:.0f} tok/s)"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("-n", type=int, default=4, help="questions (toy_add dev split)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--concurrency", type=int, default=4, help="questions searched at once")
    ap.add_argument("--url", help="use this running server instead of starting one")
    args = ap.parse_args()
    qs = get_task("toy_add").questions(args.n, split="dev", seed=args.seed)
    t0 = time.monotonic()
    srv = None if args.url else ServerProcess(["--tot-speculation"]).start()
    url = args.url or srv.url
    try:
        print(f"server ready in {time.monotonic() - t0:.0f}s at {url}")
        info = httpx.get(url + "/spex/info", timeout=60).json()
        print(f"plugin loaded in scheduler pid {info['scheduler']['pid']}: {info['plugin_loaded_in_scheduler']}")
        for prog in programs(args.seed):
            run_policy(prog, qs, url, args.concurrency)
    finally:
        if srv is not None:
            srv.stop()
            print("server stopped")


if __name__ == "__main__":
    main()
