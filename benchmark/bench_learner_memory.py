"""Peak memory and time of one ReSpec learner update, by rollout length.

Each case runs in its own process (its peak RSS is its own): SmolLM2-135M as the policy copy (fp32, CPU, as
``build_learner`` loads it), a fresh EAGLE-3 drafter with a ``--draft-vocab``-token draft vocabulary, a sync
learner with the default ``LearnerConfig`` (``--train-window`` overrides the window), ``--rollouts`` random rollouts
of a 32-token prompt and a ``length``-token response posted at once, one update. Reports the process's peak RSS
over the model-loaded baseline, the update's seconds and its outcome; writes JSON (``--out``).

    .venv/bin/python benchmark/bench_learner_memory.py --lengths 512,2048,8000
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Dict

PROMPT_TOKENS = 32


def one(length: int, args: argparse.Namespace) -> Dict[str, Any]:
    """One update in this process; returns its numbers."""
    import torch
    from transformers import AutoModelForCausalLM

    from sglang_spex.config import LearnerConfig
    from sglang_spex.models import default_model_path
    from sglang_spex.respec.drafter import Eagle3Drafter
    from sglang_spex.respec.learner import OnlineLearner
    from sglang_spex.respec.target import TargetFeatures

    torch.set_num_threads(args.threads)
    target = AutoModelForCausalLM.from_pretrained(str(default_model_path()), dtype=torch.float32)
    vocab = target.config.vocab_size
    drafter = Eagle3Drafter.for_target(target, args.draft_vocab, torch.arange(vocab).float()).float()
    features = TargetFeatures(target, drafter.cfg.aux_layer_ids, drafter.t2d)
    cfg = LearnerConfig(mode="sync", **({"train_window": args.train_window} if args.train_window else {}))
    learner = OnlineLearner(drafter, features.batch, cfg)
    g = torch.Generator().manual_seed(0)
    rollouts = [
        {
            "prompt_ids": torch.randint(3, vocab, (PROMPT_TOKENS,), generator=g).tolist(),
            "response_ids": torch.randint(3, vocab, (length,), generator=g).tolist(),
            "reward": float(i % 2),
        }
        for i in range(args.rollouts)
    ]
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6  # kB -> GB (Linux)
    t0 = time.perf_counter()
    learner.submit(rollouts)
    seconds = time.perf_counter() - t0
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6
    (record,) = learner.history
    return {
        "length": length,
        "tokens": PROMPT_TOKENS + length,
        "train_window": getattr(cfg, "train_window", None),
        "draft_vocab": args.draft_vocab,
        "rollouts": args.rollouts,
        "outcome": record.outcome,
        "reason": record.reason,
        "trained_tokens": record.tokens,
        "seconds": round(seconds, 1),
        "base_rss_gb": round(base, 2),
        "peak_rss_gb": round(peak, 2),
        "update_peak_gb": round(peak - base, 2),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--lengths", default="512,2048", help="response lengths, comma-separated")
    ap.add_argument("--rollouts", type=int, default=16)
    ap.add_argument("--draft-vocab", type=int, default=32000)
    ap.add_argument("--train-window", type=int, default=0, help="0: the config's default")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default="benchmark/results/learner_memory.json")
    ap.add_argument("--one", type=int, default=None, help=argparse.SUPPRESS)  # a child process: this length only
    args = ap.parse_args()
    if args.one is not None:
        print(json.dumps(one(args.one, args)))
        return
    rows = []
    for length in (int(x) for x in args.lengths.split(",")):
        cmd = [sys.executable, __file__, "--one", str(length), *sys.argv[1:]]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            row = {"length": length, "error": f"exit {proc.returncode}: {proc.stderr.strip()[-400:]}"}
        else:
            row = json.loads(proc.stdout.strip().splitlines()[-1])
        rows.append(row)
        print(json.dumps(row), flush=True)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
