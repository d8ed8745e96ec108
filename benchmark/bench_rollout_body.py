"""What one RL step's ``POST /respec/rollouts`` costs the server, JSON body vs binary body (``rollout_wire``).

The learner is a frozen one on SmolLM2-135M's vocabulary and context (no update runs: this is the post alone). A
step is ``--rollouts`` rollouts of a ``--prompt``-token prompt and a ``--response``-token response, each with the
served log-probs and top-``--top-k`` rows the GRPO loop posts (7-digit log-probs, as ``served_fields`` keeps them).
Each repeat hands both bodies, in alternating order, to ``routes.submit_body`` (what the route runs in its
threadpool once the body is read) on a worker thread, while this thread runs an asyncio loop that wakes every
millisecond: the longest gap between its wake-ups is how long the post stalled SGLang's HTTP event loop (Python's
GIL). Reports body bytes, posts needed under the default ``max_post_bytes``, medians with min-max of the seconds
and of the stall, and the buffer's bytes for the step (``tracemalloc``); writes JSON (``--out``).

    .venv/bin/python benchmark/bench_rollout_body.py --rollouts 64 --response 512
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import statistics
import threading
import time
import tracemalloc
from pathlib import Path
from typing import Any, Callable, Dict, List

from sglang_spex.config import LearnerConfig
from sglang_spex.respec import rollout_wire
from sglang_spex.respec.routes import submit_body

FORMATS = {"json": "application/json", "binary": rollout_wire.CONTENT_TYPE}


def make_step(args: argparse.Namespace, vocab: int) -> List[Dict[str, Any]]:
    rng = random.Random(0)
    step = []
    for i in range(args.rollouts):
        rows = []
        for _ in range(args.response):
            ids = rng.sample(range(vocab), args.top_k)
            logps = sorted((math.log(rng.random() / (2 * args.top_k)) for _ in ids), reverse=True)
            rows.append([[t, float(f"{x:.7g}")] for t, x in zip(ids, logps)])
        step.append(
            {
                "prompt_ids": [rng.randrange(vocab) for _ in range(args.prompt)],
                "response_ids": [row[0][0] for row in rows],
                "reward": float(i % 2),
                "target_logprobs": [row[0][1] for row in rows],
                "target_top_logprobs": rows,
            }
        )
    return step


def timed_post(learner, body: bytes, content_type: str) -> Dict[str, float]:
    """Seconds of ``submit_body`` on a worker thread, and the longest event-loop gap meanwhile (seconds)."""
    out = timed_on_thread(lambda: submit_body(learner, body, content_type))
    learner.buffer.drain()
    return out


def timed_on_thread(work: Callable[[], Any]) -> Dict[str, float]:
    """Seconds of ``work()`` on a worker thread (``seconds``), and the longest gap between the wake-ups of an
    asyncio loop ticking every millisecond on this thread meanwhile (``stall``: what it would hold SGLang's HTTP
    event loop for)."""
    done = threading.Event()
    out: Dict[str, float] = {}

    def run() -> None:
        t0 = time.perf_counter()
        try:
            work()
        finally:
            out["seconds"] = time.perf_counter() - t0
            done.set()

    async def ticker() -> float:
        worst, last = 0.0, time.perf_counter()
        threading.Thread(target=run).start()
        while not done.is_set():
            await asyncio.sleep(0.001)
            now = time.perf_counter()
            worst, last = max(worst, now - last), now
        return worst

    out["stall"] = asyncio.run(ticker())
    return out


def stored_bytes(learner, body: bytes, content_type: str) -> int:
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    submit_body(learner, body, content_type)
    size = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()
    learner.buffer.drain()
    return size


def spread(values: List[float], digits: int = 3) -> Dict[str, float]:
    return {k: round(f(values), digits) for k, f in (("median", statistics.median), ("min", min), ("max", max))}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rollouts", type=int, default=64)
    ap.add_argument("--prompt", type=int, default=64)
    ap.add_argument("--response", type=int, default=512)
    ap.add_argument("--top-k", type=int, default=20)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", default="benchmark/results/rollout_body.json")
    args = ap.parse_args()

    import torch
    from transformers import AutoModelForCausalLM

    from sglang_spex.models import default_model_path
    from sglang_spex.respec.drafter import Eagle3Drafter
    from sglang_spex.respec.learner import OnlineLearner

    target = AutoModelForCausalLM.from_pretrained(str(default_model_path()), dtype=torch.float32)
    vocab = target.config.vocab_size
    drafter = Eagle3Drafter.for_target(target, 2048, torch.arange(vocab).float())
    learner = OnlineLearner(
        drafter, lambda *a, **k: None, LearnerConfig(variant="frozen", mode="sync"), max_rollout_tokens=8192
    )
    step = make_step(args, vocab)
    limit = learner.config.max_post_bytes
    bodies = {
        "json": json.dumps({"rollouts": step}, separators=(",", ":")).encode(),
        "binary": rollout_wire.encode(step),
    }
    posts = {"json": math.ceil(len(bodies["json"]) / limit), "binary": len(rollout_wire.parts(step, limit))}
    runs: Dict[str, List[Dict[str, float]]] = {name: [] for name in FORMATS}
    for r in range(args.repeats):
        for name in list(FORMATS)[:: 1 if r % 2 == 0 else -1]:  # interleaved, the order alternating
            runs[name].append(timed_post(learner, bodies[name], FORMATS[name]))
    report = {"args": vars(args), "max_post_bytes": limit, "formats": {}}
    for name, content_type in FORMATS.items():
        report["formats"][name] = {
            "body_mib": round(len(bodies[name]) / 2**20, 2),
            "posts_at_limit": posts[name],
            "seconds": spread([x["seconds"] for x in runs[name]]),
            "event_loop_stall_s": spread([x["stall"] for x in runs[name]]),
            "stored_mb": round(stored_bytes(learner, bodies[name], content_type) / 1e6, 1),
        }
        print(name, json.dumps(report["formats"][name]), flush=True)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
