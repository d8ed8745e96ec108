"""Soak of a ReSpec learner server: concurrent rollout posts, malformed posts, state reads and generation.

Bounded in time (``--minutes``) and loopback only. One tiny-model EAGLE3 server with ``--respec-learner`` (async
updates, an untrained drafter: acceptance is not the point) and client threads that loop until the deadline:

- ``--posters`` post batches of 1–40 random rollouts (prompt and response 1–200 tokens each, reward in [0, 1]);
- one posts malformed batches (past the context, an id outside the vocabulary, NaN reward, not a list): each must
  get a 4xx and change nothing;
- ``--readers`` read ``GET /respec/state`` while the async learner appends its updates;
- ``--generators`` run ``/generate`` (32 tokens at T = 1): none may fail, their latency is reported.

Samples the RSS of the launcher's process tree (the learner lives in the HTTP server process). Prints a summary and
writes JSON (``--out``). Targets: no 5xx and no client error, every malformed post a 4xx, every update published or
rolled back with a reason, the server healthy at the end.

    .venv/bin/python benchmark/bench_soak_learner.py --minutes 3
"""

from __future__ import annotations

import argparse
import collections
import json
import random
import statistics
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Callable, Dict, List

import httpx
import torch
from bench_soak import rss_by_process, summarize_rss
from overlap import stop_servers_on_sigterm
from transformers import AutoConfig, AutoModelForCausalLM

from sglang_spex.models import prepare_tiny_llama
from sglang_spex.respec.drafter import Eagle3Drafter
from sglang_spex.respec.grpo_setup import EAGLE_ARGS
from sglang_spex.serve import ServerProcess


def untrained_drafter(model: str, out: Path) -> Path:
    """An EAGLE-3 drafter for ``model`` with a 128-token draft vocabulary, saved for the server."""
    target = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
    drafter = Eagle3Drafter.for_target(target, 128, torch.arange(target.config.vocab_size).float())
    return drafter.save_pretrained(out, dtype=torch.float32)


def malformed(rng: random.Random, vocab: int, context: int) -> Dict[str, Any]:
    one = {"prompt_ids": [1, 2], "response_ids": [3], "reward": 1.0}
    return rng.choice(
        [
            {"rollouts": [{**one, "prompt_ids": [1] * context}]},  # past the context with its response
            {"rollouts": [one, {**one, "response_ids": [vocab]}]},  # an id outside the vocabulary
            {"rollouts": [{**one, "reward": "NaN"}]},
            {"rollouts": "x"},
            {"rollouts": [one], "extra": 1},
        ]
    )


def run(args: argparse.Namespace) -> Dict[str, Any]:
    model = str(prepare_tiny_llama())
    cfg = AutoConfig.from_pretrained(model)
    drafter = untrained_drafter(model, Path(tempfile.mkdtemp(prefix="soak-drafter-")))
    learner = {"variant": "reward", "mode": "async", "train_steps": 2}
    spec = {"drafter": str(drafter), "target": model, "learner": learner}
    server_args = ["--model-path", model, "--dtype", "float32", "--speculative-algorithm", "EAGLE3"]
    server_args += ["--speculative-draft-model-path", str(drafter), *EAGLE_ARGS, "--respec-learner", json.dumps(spec)]
    codes: collections.Counter = collections.Counter()
    latency: List[float] = []
    rss: List[Dict[str, Any]] = []
    with ServerProcess(server_args) as srv, httpx.Client(base_url=srv.url, timeout=120) as http:
        deadline = time.monotonic() + args.minutes * 60

        def post(rng: random.Random) -> int:
            def ids() -> List[int]:
                return [rng.randrange(3, cfg.vocab_size) for _ in range(rng.randint(1, 200))]

            batch = [
                {"prompt_ids": ids(), "response_ids": ids(), "reward": rng.random()} for _ in range(rng.randint(1, 40))
            ]
            return http.post("/respec/rollouts", json={"rollouts": batch}).status_code

        def bad(rng: random.Random) -> int:
            body = malformed(rng, cfg.vocab_size, cfg.max_position_embeddings)
            return http.post("/respec/rollouts", json=body).status_code

        def state(rng: random.Random) -> int:
            return http.get("/respec/state").status_code

        def generate(rng: random.Random) -> int:
            t0 = time.monotonic()
            body = {
                "text": "count " * rng.randint(1, 30),
                "sampling_params": {"max_new_tokens": 32, "temperature": 1.0},
            }
            code = http.post("/generate", json=body).status_code
            latency.append(time.monotonic() - t0)
            return code

        def loop(kind: str, fn: Callable[[random.Random], int], seed: int) -> None:
            rng = random.Random(seed)
            while time.monotonic() < deadline:
                try:
                    codes[(kind, str(fn(rng)))] += 1
                except httpx.HTTPError as e:
                    codes[(kind, type(e).__name__)] += 1

        def sample() -> None:
            t0 = time.monotonic()
            while time.monotonic() < deadline:
                rss.append({"t": round(time.monotonic() - t0, 1), "rss": rss_by_process(srv.proc.pid)})
                time.sleep(args.rss_every)

        kinds = [("post", post, args.posters), ("bad", bad, 1), ("state", state, args.readers)]
        kinds.append(("generate", generate, args.generators))
        threads = [threading.Thread(target=sample)]
        threads += [threading.Thread(target=loop, args=(k, f, 1000 * i + j)) for i, (k, f, n) in enumerate(kinds)
                    for j in range(n)]  # fmt: skip
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        healthy = http.get("/health").status_code == 200
        final = http.get("/respec/state").json()
    by_kind = collections.defaultdict(dict)
    for (kind, code), n in sorted(codes.items()):
        by_kind[kind][code] = n
    latency.sort()
    return {
        "minutes": args.minutes,
        "codes": by_kind,
        "server_errors": sum(n for (_, c), n in codes.items() if c.startswith("5")),
        "client_errors": sum(n for (_, c), n in codes.items() if not c.isdigit()),
        "malformed_not_4xx": sum(n for (k, c), n in codes.items() if k == "bad" and not c.startswith("4")),
        "generate_s": (
            {"p50": latency[len(latency) // 2], "p99": latency[int(len(latency) * 0.99)]} if latency else None
        ),
        "learner": {k: final[k] for k in ("version", "attempts", "buffer_size", "rollouts_received", "steps")},
        "update_outcomes": dict(collections.Counter(f"{u['outcome']}:{u['reason']}" for u in final["updates"])),
        "update_s_median": statistics.median(u["seconds"] for u in final["updates"]) if final["updates"] else None,
        "rss": summarize_rss(rss, args.warmup_s) if rss else None,
        "healthy": healthy,
    }


def main() -> None:
    stop_servers_on_sigterm()  # a `timeout` or kill still stops the servers this run started
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--minutes", type=float, default=3.0)
    ap.add_argument("--posters", type=int, default=3)
    ap.add_argument("--readers", type=int, default=2)
    ap.add_argument("--generators", type=int, default=4)
    ap.add_argument("--rss-every", type=float, default=5.0, help="seconds between RSS samples")
    ap.add_argument("--warmup-s", type=float, default=30.0, help="RSS after this many seconds is the baseline")
    ap.add_argument("--out", default="benchmark/results/bench_soak_learner.json")
    args = ap.parse_args()
    out = run(args)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1))
    summary = {k: out[k] for k in ("codes", "server_errors", "client_errors", "malformed_not_4xx", "generate_s")}
    print(json.dumps(summary, indent=1))
    print(f"learner {out['learner']}; updates {out['update_outcomes']} (median {out['update_s_median']} s)")
    if out["rss"]:
        print(f"RSS end vs after warm-up {out['rss']['end_vs_after_warmup']:+.1%}; healthy {out['healthy']}")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
