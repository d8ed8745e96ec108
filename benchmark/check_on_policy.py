"""On-policy check of speculative sampling where an RL loop uses it: the GRPO loop's own rollout requests (chat
prompts of the task, T = 1, ``max_new_tokens``; with or without a ``sampling_seed`` per request; arm ``logprobs``:
seeded and asking for the top-20 log-probs, as the rollouts do while a learner trains) sent to a server
without speculation and to naive always-on EAGLE3 with the run's drafter, one server at a time. Per prompt: the
chi-square homogeneity p-value of the first ``--tokens`` generated tokens (token 1 is sampled at prefill, the
rest by the speculative verify) and, over all prompts, the mean verifier reward of each server and their gap with
its standard error. A sampler that is exactly on-policy shows uniform p-values and a gap within ~2 standard errors.

Both tests assume two *independent* samples. The seeded arms therefore give each server its own, disjoint range of
``sampling_seed`` values (:func:`request_seeds`: server ``k`` adds ``k * SEED_BLOCK``): with the same seeds on both
servers, a server that samples by the seed would draw the same random numbers in both (token 1, sampled at prefill
from the same logits, would agree by construction), the p-values would pile up near 1 and the standard error would be
too large, so an off-policy verify could not be rejected. The seeded code path is still exercised on both servers.

    python benchmark/check_on_policy.py --work-dir /tmp/respec-rl --samples 1500 --questions 3

``--work-dir``: a ``bench_respec_rl.py`` setup (its ``setup.json`` names the policy and drafter).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time
from collections import Counter
from pathlib import Path
from typing import Dict, List, Sequence, Tuple

import numpy as np
from scipy import stats
from simbench import write_results

Sample = Tuple[int, ...]
ARMS = ("seeded", "unseeded", "logprobs")
# "logprobs": seeded, and asking for the top-20 log-probs per token, as the GRPO loop's rollouts do while a learner trains
LOGPROBS = {"return_logprob": True, "top_logprobs_num": 20}
SERVERS = ("none", "naive")  # server k gets the seeds of block k
SEED_BLOCK = 10**9  # the seeds of one server: 7919 * prompt + sample, below this (checked in main); int64-safe


def request_seeds(server: int, qi: int, samples: int) -> List[int]:
    """The ``sampling_seed`` of each of ``samples`` requests of prompt ``qi`` to server number ``server``: disjoint
    between servers (block ``server`` of :data:`SEED_BLOCK`), so the two servers' samples are independent."""
    return [server * SEED_BLOCK + 7919 * qi + i for i in range(samples)]


def request_params(arm: str, server: int, qi: int, samples: int, max_new_tokens: int):
    """Sampling params of one prompt's requests in ``arm``: one shared dict when unseeded, else one per request."""
    base = {"temperature": 1.0, "max_new_tokens": max_new_tokens}
    if arm == "unseeded":
        return base
    return [{**base, "sampling_seed": s} for s in request_seeds(server, qi, samples)]


def homogeneity_pvalue(a: Sequence[Sample], b: Sequence[Sample], min_cell: int = 10) -> float:
    """Chi-square homogeneity p-value of two samples of token tuples (rare cells pooled into one)."""
    ca, cb = Counter(a), Counter(b)
    cells = sorted(c for c in set(ca) | set(cb) if ca[c] + cb[c] >= min_cell)
    rows = [[cnt[c] for c in cells] + [len(s) - sum(cnt[c] for c in cells)] for cnt, s in ((ca, a), (cb, b))]
    table = np.array(rows)
    table = table[:, table.sum(0) > 0]
    if table.shape[1] < 2:
        return 1.0
    return float(stats.chi2_contingency(table).pvalue)


def reward_gap(base: Sequence[float], other: Sequence[float]) -> Dict[str, float]:
    """Mean reward of each sample, ``other`` − ``base`` and the gap's standard error (independent samples)."""
    se = math.sqrt(statistics.pvariance(base) / len(base) + statistics.pvariance(other) / len(other))
    return {"base": statistics.mean(base), "other": statistics.mean(other), "gap": statistics.mean(other) -
            statistics.mean(base), "se": se}  # fmt: skip


def sample_server(
    args: Sequence[str], server: int, prompts: List[List[int]], arms: Sequence[str], a, decode, reward
) -> Dict:
    """Per arm and prompt: (first-token tuples, rewards) of ``a.samples`` rollout requests; seeded arms use server
    number ``server``'s seeds (:func:`request_seeds`)."""
    from sglang_spex.respec.grpo import ServerClient
    from sglang_spex.serve import ServerProcess

    out: Dict = {}
    with ServerProcess(list(args)) as srv:
        client = ServerClient(srv.url)
        for arm in arms:
            for qi, ids in enumerate(prompts):
                params = request_params(arm, server, qi, a.samples, a.max_new_tokens)
                extra = LOGPROBS if arm == "logprobs" else None
                outs = client.generate([ids] * a.samples, params, concurrency=a.concurrency, extra=extra)
                out[(arm, qi)] = (
                    [tuple(o["output_ids"][: a.tokens]) for o in outs],
                    [reward(decode(o["output_ids"]), qi) for o in outs],
                )
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--work-dir", required=True, help="a bench_respec_rl.py setup (setup.json)")
    ap.add_argument(
        "--policy-dir",
        default=None,
        help="the policy to serve (default: the setup's initial one; e.g. a run's final policy from "
        "bench_respec_rl.py --save-policies)",
    )
    ap.add_argument("--task", default="toy_add")
    ap.add_argument("--toy-range", type=int, nargs=2, default=[2, 10])
    ap.add_argument("--questions", type=int, default=3)
    ap.add_argument("--samples", type=int, default=1000, help="requests per prompt, arm and server")
    ap.add_argument("--tokens", type=int, default=2, help="generated tokens compared by the chi-square test")
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--arms", nargs="+", default=["seeded", "unseeded"], choices=ARMS)
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "check_on_policy.json"))
    a = ap.parse_args(argv)
    if min(a.questions, a.samples) < 1 or 7919 * (a.questions - 1) + a.samples > SEED_BLOCK:
        ap.error(f"--questions/--samples: need >= 1 and 7919 * (questions - 1) + samples <= {SEED_BLOCK}")

    from transformers import AutoTokenizer

    from sglang_spex.respec.grpo import chat_prompt_ids, verifier_reward
    from sglang_spex.respec.grpo_setup import resolve_task
    from sglang_spex.respec.rl_loop import mode_server_args

    t0 = time.monotonic()
    setup = json.loads((Path(a.work_dir) / "setup.json").read_text())
    policy, drafter = Path(a.policy_dir or setup["policy_dir"]), Path(setup["drafter_dir"])
    task = resolve_task(a.task, a.toy_range)
    questions = task.questions(a.questions, split="dev", seed=7)
    tok = AutoTokenizer.from_pretrained(str(policy))
    prompts = [chat_prompt_ids(tok, q.text) for q in questions]
    check = verifier_reward(task)

    def decode(ids):
        return tok.decode(ids, skip_special_tokens=True)

    def reward(text, qi):
        return check(text, questions[qi])

    extra = ["--attention-backend", "spex_cpu"]
    got = {
        mode: sample_server(mode_server_args(mode, policy, drafter, extra=extra), k, prompts, a.arms, a, decode, reward)
        for k, mode in enumerate(SERVERS)
    }
    summary: Dict = {}
    for arm in a.arms:
        pvals = [homogeneity_pvalue(got["none"][(arm, q)][0], got["naive"][(arm, q)][0]) for q in range(len(prompts))]
        gap = reward_gap(*(sum((got[m][(arm, q)][1] for q in range(len(prompts))), []) for m in ("none", "naive")))
        summary[arm] = {"first_tokens_pvalues": pvals, "reward": gap}
        print(f"{arm}: first {a.tokens} tokens, p per prompt {[round(p, 4) for p in pvals]}; reward none "
              f"{gap['base']:.3f} naive {gap['other']:.3f} gap {gap['gap']:+.3f} (se {gap['se']:.3f})")  # fmt: skip
    seeds = {m: f"{k * SEED_BLOCK} + 7919 * prompt + sample" for k, m in enumerate(SERVERS)}
    write_results(a.out, __file__, a, t0, None, summary=summary, sampling_seeds=seeds)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
