"""The RL loop learns: GRPO rollouts through a real CPU SGLang server (no speculation, tiny random Llama), policy
pushed back through SGLang's update_weights_from_tensor each step, a dense rule reward (digit share), temperature 1,
fixed seeds. The reward rises over 10 steps; each step's wall-clock split adds up; the final policy is saved."""

from __future__ import annotations

import pytest
import torch
from workloads import COMMON

from sglang_spex.respec.grpo import GRPOConfig
from sglang_spex.respec.policy import Policy
from sglang_spex.respec.rl_loop import digit_share_reward, mode_server_args, run_rl
from sglang_spex.tot.tasks import ToyAdd

STEPS = 10


def test_digit_share_reward():
    assert digit_share_reward("a1 2b") == 0.5 and digit_share_reward("  ") == 0.0 and digit_share_reward("42") == 1.0


def test_mode_server_args(tmp_path):
    assert "--speculative-algorithm" not in mode_server_args("none", tmp_path)
    naive = mode_server_args("naive", tmp_path, tmp_path / "d")
    assert "EAGLE3" in naive and "--respec-adaptive" not in naive
    respec = mode_server_args("respec", tmp_path, tmp_path / "d", respec_profile="p.json", learner_json="{}")
    assert "--respec-adaptive" in respec and "--respec-learner" in respec
    learner = mode_server_args("learner", tmp_path, tmp_path / "d", learner_json="{}")
    assert "EAGLE3" in learner and "--respec-learner" in learner and "--respec-adaptive" not in learner
    with pytest.raises(ValueError):
        mode_server_args("respec", tmp_path, tmp_path / "d")
    with pytest.raises(ValueError):
        mode_server_args("respec", tmp_path, tmp_path / "d", learner_json="{}")  # no profile
    with pytest.raises(ValueError):
        mode_server_args("learner", tmp_path, tmp_path / "d")
    with pytest.raises(ValueError):
        mode_server_args("bogus", tmp_path)


def test_reward_rises_without_speculation(tiny_model, tmp_path):
    cfg = GRPOConfig(prompts_per_step=4, group_size=4, max_new_tokens=16, temperature=1.0, inner_steps=2, seed=0)
    args = mode_server_args("none", tiny_model, extra=COMMON[2:])  # COMMON[:2] is the dtype
    run = run_rl(
        args, tiny_model, ToyAdd(2, 10), cfg, STEPS, policy_lr=1e-2, reward_fn=digit_share_reward,
        save_dir=tmp_path / "final",
    )  # fmt: skip
    rewards = [s["reward_mean"] for s in run["steps"]]
    first, last = sum(rewards[:3]) / 3, sum(rewards[-3:]) / 3
    assert last > first + 0.1 and last > 2 * first, rewards
    assert [s["weight_version"] for s in run["steps"]] == [f"policy-{i + 1}" for i in range(STEPS)]  # pushes landed
    for s in run["steps"]:
        parts = s["generation_s"] + s["policy_update_s"] + s["push_s"] + s["drafter_update_s"]
        assert 0 < parts <= s["seconds"] and 1.0 <= s["active_batch"] <= 16.0, s
        assert s["accept_length"] is None  # no speculation
    saved = Policy.from_pretrained(run["policy_dir"])  # the final policy: moved from the start
    start = Policy.from_pretrained(tiny_model)
    moved = [n for (n, t), (_, t0) in zip(saved.named_tensors(), start.named_tensors()) if not torch.equal(t, t0)]
    assert moved and (tmp_path / "final" / "tokenizer_config.json").exists()
