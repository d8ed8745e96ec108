"""End to end on a live CPU SGLang server (tiny Llama, EAGLE3 with a drafter, the online learner inside): GRPO's
rollout requests return the served top-k log-probs (SGLang 0.5.23's real ``meta_info`` shape, through speculative
decoding), the learner builds its KD target from them, and the copy/served gap shows a stale policy copy."""

from __future__ import annotations

import json

import requests
import torch

from sglang_spex.respec.drafter import Eagle3Drafter
from sglang_spex.respec.grpo import GRPOConfig, GRPOLoop, ServerClient
from sglang_spex.respec.grpo_setup import EAGLE_ARGS
from sglang_spex.respec.policy import Policy
from sglang_spex.serve import ServerProcess
from sglang_spex.tot.tasks import ToyAdd


def test_grpo_rollouts_feed_served_kd_targets(tiny_model, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(1)
    target = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    drafter = Eagle3Drafter.for_target(target, 128, torch.arange(target.config.vocab_size).float())
    drafter_dir = drafter.save_pretrained(tmp_path / "drafter", dtype=torch.float32)
    learner = {"variant": "reward", "mode": "sync", "lr": 1e-3, "train_steps": 1}
    spec = {"drafter": str(drafter_dir), "target": tiny_model, "learner": learner}
    args = ["--model-path", tiny_model, "--dtype", "float32", "--speculative-algorithm", "EAGLE3"]
    args += ["--speculative-draft-model-path", str(drafter_dir), *EAGLE_ARGS, "--respec-learner", json.dumps(spec)]
    # the learner's copy is never synced: it stays at the policy the first step's rollouts were sampled from
    cfg = GRPOConfig(prompts_per_step=2, group_size=2, max_new_tokens=8, top_logprobs_num=4, sync_learner_policy=False)

    def reward(text, q):  # varies between samples of a random model
        return (sum(map(ord, text)) % 7) / 7.0

    with ServerProcess(args) as srv:
        tok = AutoTokenizer.from_pretrained(tiny_model)
        policy = Policy.from_pretrained(tiny_model, lr=1e-2)
        loop = GRPOLoop(ServerClient(srv.url), policy, tok, ToyAdd(2, 10), cfg, reward_fn=reward)
        steps = list(loop.run(2, progress=False))
        state = requests.get(srv.url + "/respec/state", timeout=60).json()
    assert all(s.accept_length is not None for s in steps)  # the rollouts went through speculative decoding
    fresh, stale = state["updates"]
    assert fresh["target_source"] == stale["target_source"] == "served", state["updates"]
    # step 1: copy == served policy (noise only); step 2: the server runs the pushed policy, the copy does not
    assert fresh["target_logp_gap"] < 1e-3 and stale["target_logp_gap"] > 10 * max(fresh["target_logp_gap"], 1e-4)
