"""GRPO on a bundled task against a real CPU SGLang server, with ReSpec's online learner keeping the EAGLE-3
drafter aligned with the moving policy.

    python examples/grpo_rollouts.py --steps 5                      # tiny Llama, warm-started on toy_add 2..10
    python examples/grpo_rollouts.py --model smollm2 --toy-range 2 50 --warm-steps 0 --dtype bfloat16 \\
        --drafter ~/.cache/sglang-spex/models/SmolLM2-135M-Instruct-eagle3-respec --steps 3

Launches ``python -m sglang_spex.launch_server`` with EAGLE3 (a drafter bootstrapped on the policy's own
samples) and the learner (``--respec-learner``), then per step: G samples per prompt, verifier rewards, group-
normalised advantages, a policy step on the client's HF copy, the new weights pushed into the server
(``/update_weights_from_tensor``, selector target), rollouts posted to ``POST /respec/rollouts``.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="tiny", help="tiny | smollm2 | HF model dir")
    ap.add_argument("--task", default="toy_add", help="toy_add or rg:<reasoning_gym dataset>")
    ap.add_argument("--toy-range", type=int, nargs=2, default=[2, 10], metavar=("LO", "HI"))
    ap.add_argument("--warm-steps", type=int, default=150, help="supervised warm start (tiny random model)")
    ap.add_argument("--steps", type=int, default=5, help="policy steps")
    ap.add_argument("--prompts", type=int, default=4, help="prompts per step")
    ap.add_argument("--group", type=int, default=4, help="G: samples per prompt")
    ap.add_argument("--max-new-tokens", type=int, default=24)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--lr", type=float, default=2e-4, help="policy learning rate")
    ap.add_argument("--variant", default="reward", choices=["frozen", "unweighted", "reward"])
    ap.add_argument("--learner-mode", default="async", choices=["sync", "async"])
    ap.add_argument("--draft-vocab", type=int, default=256)
    ap.add_argument("--drafter-iters", type=int, default=150)
    ap.add_argument("--drafter-samples", type=int, default=48, help="policy samples the bootstrap drafter fits")
    ap.add_argument("--drafter", default=None, help="use this saved drafter instead of bootstrapping one")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--work-dir", default=None, help="where the policy/drafter go (default: a temp dir)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()

    import torch
    from transformers import AutoTokenizer

    from sglang_spex.respec.grpo import GRPOConfig, GRPOLoop, ServerClient
    from sglang_spex.respec.grpo_setup import eagle3_server_args, learner_spec, prepare_run, resolve_model, resolve_task
    from sglang_spex.respec.policy import Policy
    from sglang_spex.serve import ServerProcess

    torch.set_num_threads(1)
    try:
        resolve_model(args.model)
        task = resolve_task(args.task, args.toy_range)
    except (FileNotFoundError, KeyError, ValueError) as e:
        ap.error(str(e))
    work = Path(args.work_dir or tempfile.mkdtemp(prefix="grpo-"))
    t0 = time.perf_counter()
    setup = prepare_run(
        args.model, task, work, args.warm_steps, args.drafter_samples, args.drafter_iters, args.draft_vocab,
        args.max_new_tokens, args.temperature, args.seed, drafter_dir=args.drafter,
    )  # fmt: skip
    print(f"policy {setup.policy_dir}, drafter {setup.drafter_dir} ({time.perf_counter() - t0:.0f} s)")
    spec = learner_spec(setup, args.variant, args.learner_mode, lr=1e-3)
    with ServerProcess([*eagle3_server_args(setup, args.dtype), "--respec-learner", spec]) as srv:
        print(f"server {srv.url} (log {srv.log_path})")
        policy = Policy.from_pretrained(setup.policy_dir, lr=args.lr, temperature=args.temperature)
        tok = AutoTokenizer.from_pretrained(setup.policy_dir)
        cfg = GRPOConfig(args.prompts, args.group, args.max_new_tokens, args.temperature, seed=args.seed)
        loop = GRPOLoop(ServerClient(srv.url), policy, tok, task, cfg)
        for s in loop.run(args.steps):
            acc = f"{s.accept_length:.2f}" if s.accept_length else "-"
            print(
                f"step {s.step}: reward {s.reward_mean:.2f} loss {s.loss:+.3f} accept {acc} "
                f"{s.tokens_per_s:.0f} tok/s weights {s.weight_version} drafter v{s.learner['version']}"
            )
        state = loop.client.learner_state()
        print(json.dumps({k: state[k] for k in ("version", "policy_version", "steps", "last_loss")}))


if __name__ == "__main__":
    main()
