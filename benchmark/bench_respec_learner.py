"""ReSpec online learner under a moving policy: frozen vs unweighted-KD vs reward-weighted-KD drafters, a freshly
trained drafter as the reference, and the decode stall of training in the server (async vs sync vs none).

    python benchmark/bench_respec_learner.py                          # tiny Llama warm-started on toy_add 2..10
    python benchmark/bench_respec_learner.py --steps 30 --policy-lr 3e-4 --prompts 8

Setup (once): the initial policy and a bootstrap EAGLE-3 drafter fitted on its samples (``grpo_setup``). Then one
real CPU SGLang server per variant, all up at once (EAGLE3 with that drafter, the variant's learner inside, async),
and ONE GRPO run (``respec/grpo.py``): the policy samples on the first server, every server gets each policy push
and each rollout batch, so all learners distill the same policy from the same data. After each step every server
samples that step's prompts again: acceptance length (completion tokens / verify passes, from SGLang's
``meta_info``) and tokens/s of its drafter on the current policy. After the run (learners idle) all are evaluated
on the same held-out prompts; then a drafter trained from scratch on the final policy's samples (same budget and
vocabulary as the bootstrap) is swapped into the first server and evaluated the same way.

Stall: a server whose learner runs ``--stall-train-steps`` optimizer steps per update; decode tokens/s of a fixed
greedy batch with no training, right after posting rollouts to an async learner (training in the background of
the same server), and to a sync one (the post returns when training is done: the loop waits), as the RL loop
sees it: tokens / (post + generate) seconds.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Dict, List

import requests
from overlap import stop_servers_on_sigterm
from simbench import save_figure, write_results

RESULTS = Path(__file__).parent / "results"
STALL_PROMPT = [1, 17, 42, 99, 7, 230, 5, 61]


def wait_idle(url: str, timeout: float = 600.0) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        state = requests.get(url + "/respec/state", timeout=60).json()
        if not state["updating"] or time.monotonic() > deadline:
            return state
        time.sleep(0.5)


def run_variants(a, setup, task) -> Dict:
    """One server per variant, all up at once, one GRPO run: the policy samples its rollouts on the first server,
    every server gets each policy push and each rollout batch (so every learner distills the same policy from the
    same data), and after each step every server samples the step's prompts again (its drafter's acceptance on
    the current policy). At the end: evaluation on held-out prompts, then a freshly trained drafter swapped into
    the first server and evaluated the same way."""
    import torch
    from transformers import AutoTokenizer

    from sglang_spex.respec.drafter import Eagle3Drafter
    from sglang_spex.respec.grpo import GRPOConfig, GRPOLoop, ServerClient, stats_dict
    from sglang_spex.respec.grpo_setup import eagle3_server_args, hf_samples, learner_spec
    from sglang_spex.respec.hotswap import HotSwapClient
    from sglang_spex.respec.policy import Policy
    from sglang_spex.respec.ttt import fit_drafter
    from sglang_spex.serve import ServerProcess

    torch.manual_seed(a.seed)
    out: Dict = {v: {"steps": []} for v in a.variants}
    with ExitStack() as stack:
        clients = {}
        for v in a.variants:
            spec = learner_spec(setup, v, "async", lr=a.kd_lr, train_steps=a.kd_train_steps, micro_batch=8)
            srv = stack.enter_context(ServerProcess([*eagle3_server_args(setup, a.dtype), "--respec-learner", spec]))
            clients[v] = ServerClient(srv.url)
        first, *rest = a.variants
        policy = Policy.from_pretrained(setup.policy_dir, lr=a.policy_lr, temperature=a.temperature)
        tok = AutoTokenizer.from_pretrained(setup.policy_dir)
        cfg = GRPOConfig(a.prompts, a.group, a.max_new_tokens, a.temperature, a.inner_steps, seed=a.seed)
        loop = GRPOLoop(clients[first], policy, tok, task, cfg, mirrors=[clients[v] for v in rest])
        grpo = []
        for s in loop.run(a.steps):
            grpo.append(stats_dict(s))
            for v, c in clients.items():
                ev = loop.evaluate(loop.last_questions, c)
                ev.update(step=s.step, drafter_version=c.learner_state()["version"])
                out[v]["steps"].append(ev)
        eval_qs = task.questions(a.eval_prompts, split="test", seed=a.seed)
        for v, c in clients.items():
            out[v]["learner"] = wait_idle(c.url)
            out[v]["eval"] = loop.evaluate(eval_qs, c)
        t0 = time.perf_counter()
        qs = task.questions(a.drafter_samples, split="dev", seed=a.seed + 3000)
        pairs = hf_samples(policy.model, tok, qs, a.temperature, a.max_new_tokens)
        served_vocab = Eagle3Drafter.from_pretrained(setup.drafter_dir).t2d
        drafter = fit_drafter(policy.model.eval(), pairs, a.draft_vocab, a.drafter_iters, t2d=served_vocab)
        HotSwapClient(clients[first].url).push(10_000, drafter.hot_swap_tensors(torch.float32))
        fresh = {"eval": {**loop.evaluate(eval_qs, clients[first]), "train_seconds": time.perf_counter() - t0}}
    return {"variants": out, "fresh": fresh, "grpo": grpo}


def decode_rate(url: str, post, rollouts: List[dict], a) -> Dict:
    """Greedy batch decode right after ``post(rollouts)`` (None: no post); tokens / (post + generate) seconds."""
    body = {
        "input_ids": [STALL_PROMPT[: 4 + i % 4] for i in range(a.stall_batch)],
        "sampling_params": {"temperature": 0, "max_new_tokens": a.stall_tokens, "ignore_eos": True},
    }
    t0 = time.perf_counter()
    if post is not None:
        post(rollouts)
    t1 = time.perf_counter()
    updating = requests.get(url + "/respec/state", timeout=60).json()["updating"]
    r = requests.post(url + "/generate", json=body, timeout=900)
    r.raise_for_status()
    t2 = time.perf_counter()
    tokens = sum(len(x["output_ids"]) for x in r.json())
    after = requests.get(url + "/respec/state", timeout=60).json()["updating"]
    return {
        "tokens": tokens,
        "post_s": t1 - t0,
        "generate_s": t2 - t1,
        "tok_s": tokens / (t2 - t0),
        "learner_updating_at_start": updating,
        "learner_updating_at_end": after,
    }


def run_stall(a, setup) -> Dict:
    from sglang_spex.respec.grpo import ServerClient
    from sglang_spex.respec.grpo_setup import eagle3_server_args, learner_spec
    from sglang_spex.serve import ServerProcess

    rollouts = [{"prompt_ids": p, "response_ids": r, "reward": float(i % 2)} for i, (p, r) in enumerate(setup.probe)]
    out: Dict[str, List[Dict]] = {"none": [], "async": [], "sync": []}
    for mode in ("async", "sync"):
        spec = learner_spec(setup, "reward", mode, lr=a.kd_lr, train_steps=a.stall_train_steps, micro_batch=8)
        with ServerProcess([*eagle3_server_args(setup, a.dtype), "--respec-learner", spec]) as srv:
            client = ServerClient(srv.url)
            decode_rate(srv.url, None, rollouts, a)  # warm-up
            for _ in range(a.stall_reps):
                if mode == "async":
                    out["none"].append(decode_rate(srv.url, None, rollouts, a))
                out[mode].append(decode_rate(srv.url, client.post_rollouts, rollouts, a))
                state = wait_idle(srv.url)
            out[f"{mode}_update_seconds"] = [u["seconds"] for u in state["updates"]]
    med = {k: statistics.median(x["tok_s"] for x in out[k]) for k in ("none", "async", "sync")}
    out["median_tok_s"] = med
    out["ratio_async_vs_none"] = med["async"] / med["none"]
    out["ratio_sync_vs_none"] = med["sync"] / med["none"]
    return out


def plot(variants: Dict[str, Dict], fresh: Dict, stall: Dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 4 if stall else 3, figsize=(17 if stall else 13, 4))
    for name, res in variants.items():
        xs = [s["step"] for s in res["steps"]]
        axes[0].plot(xs, [s["accept_length"] or 1.0 for s in res["steps"]], marker=".", label=name)
        axes[1].plot(xs, [s["tokens_per_s"] for s in res["steps"]], marker=".", label=name)
    axes[0].set(xlabel="policy step", ylabel="tokens per verify pass", title="acceptance on each step's prompts")
    axes[1].set(xlabel="policy step", ylabel="rollout tokens/s", title="rollout throughput (the servers share 2 cores)")
    names = list(variants) + ["fresh"]
    vals = [variants[n]["eval"]["accept_length"] or 1.0 for n in variants] + [fresh["eval"]["accept_length"] or 1.0]
    axes[2].bar(names, vals, color=["tab:blue", "tab:orange", "tab:green", "tab:grey"][: len(names)])
    axes[2].set(ylabel="tokens per verify pass", title="after the run, held-out prompts, same policy")
    if stall:
        modes = ["none", "async", "sync"]
        axes[3].bar(modes, [stall["median_tok_s"][m] for m in modes], color="tab:red", alpha=0.8)
        axes[3].set(ylabel="decode tokens/s (median)", title="decode while the learner trains")
    for ax in axes[:2]:
        ax.legend()
    save_figure(fig, path, "ReSpec online learner under GRPO (real CPU SGLang, EAGLE3)")


def main(argv=None) -> int:
    stop_servers_on_sigterm()  # a `timeout` or kill still stops the servers this run started
    from sglang_spex.respec.grpo_setup import add_run_args

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_run_args(ap, max_new_tokens=24)
    ap.add_argument("--variants", nargs="+", default=["frozen", "unweighted", "reward"])
    ap.add_argument("--steps", type=int, default=20, help="policy steps")
    ap.add_argument("--eval-prompts", type=int, default=32)
    ap.add_argument("--no-stall", action="store_true", help="skip the decode-stall section")
    ap.add_argument("--stall-batch", type=int, default=8)
    ap.add_argument("--stall-tokens", type=int, default=64)
    ap.add_argument("--stall-train-steps", type=int, default=40)
    ap.add_argument("--stall-reps", type=int, default=3)
    ap.add_argument("--out", default=str(RESULTS / "respec_learner.json"))
    a = ap.parse_args(argv)
    bad = [v for v in a.variants if v not in ("frozen", "unweighted", "reward")]
    if bad:
        ap.error(f"unknown variant(s) {bad}")

    import torch

    from sglang_spex.respec.grpo_setup import prepare_run, resolve_model, resolve_task

    torch.set_num_threads(1)
    t0 = time.monotonic()
    try:
        resolve_model(a.model)
        task = resolve_task(a.task, a.toy_range)
    except (FileNotFoundError, KeyError, ValueError) as e:
        ap.error(str(e))
    work = Path(tempfile.mkdtemp(prefix="bench-respec-learner-"))
    setup = prepare_run(
        a.model, task, work, a.warm_steps, a.drafter_samples, a.drafter_iters, a.draft_vocab, a.max_new_tokens,
        a.temperature, a.seed, drafter_dir=a.drafter,
    )  # fmt: skip
    print(f"setup: {json.dumps(setup.info)} ({time.monotonic() - t0:.0f} s)")
    run = run_variants(a, setup, task)
    variants, fresh = run["variants"], run["fresh"]
    for v, res in list(variants.items()) + [("fresh", fresh)]:
        ev, st = res["eval"], res.get("learner")
        line = f"{v:10s} eval accept {ev['accept_length']:.3f} reward {ev['reward_mean']:.2f} {ev['tokens_per_s']:.0f} tok/s"
        if st:
            rolled = sum(u["outcome"] == "rolled_back" for u in st["updates"])
            line += f"; drafter v{st['version']} ({rolled} rolled back)"
        print(line)
    stall = {} if a.no_stall else run_stall(a, setup)
    if stall:
        m = stall["median_tok_s"]
        print(
            f"decode tok/s: none {m['none']:.0f}, async {m['async']:.0f} ({stall['ratio_async_vs_none']:.2f}x), "
            f"sync {m['sync']:.0f} ({stall['ratio_sync_vs_none']:.2f}x)"
        )
    summary = {v: r["eval"]["accept_length"] for v, r in variants.items()}
    summary["fresh"] = fresh["eval"]["accept_length"]
    for v in a.variants:
        summary[f"{v}_vs_fresh"] = summary[v] / summary["fresh"]
    first_steps = {v: r["steps"][0]["accept_length"] for v, r in variants.items()}
    summary.update({f"{v}_first_step": x for v, x in first_steps.items()})
    print("acceptance: " + json.dumps({k: round(x, 3) for k, x in summary.items()}))
    out = Path(a.out)
    png = out.with_suffix(".png")
    plot(variants, fresh, stall, png)
    write_results(str(out), "real CPU SGLang server", a, t0, png, setup=setup.info, summary=summary,
                  variants=variants, fresh=fresh, grpo=run["grpo"], stall=stall)  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
