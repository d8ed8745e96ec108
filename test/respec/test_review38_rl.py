"""Review 38 (ReSpec vs. its references, RL side): the GRPO step-size diagnostics describe the step actually made,
``linear`` KD weights give no weight (and the learner skips the update) when no reward is positive, and a GRPO
loop refuses a policy whose temperature is not the sampler's."""

from __future__ import annotations

import pytest
import torch

from sglang_spex.config import LearnerConfig
from sglang_spex.respec.grpo import GRPOConfig, GRPOLoop, ServerClient
from sglang_spex.respec.kd import reward_weights
from sglang_spex.respec.learner import OnlineLearner
from sglang_spex.respec.policy import Policy
from sglang_spex.tot.tasks import ToyAdd

PAIRS = [([1, 5, 6], [7, 8, 9, 10]), ([1, 5, 6], [11, 12]), ([1, 5, 6], [13, 14, 15, 16, 17, 18]), ([1, 5, 6], [19])]
ADV = [1.0, -1.0, 1.0, -1.0]


# -- finding 1: approx_kl / clip_frac ---------------------------------------------------------------------------
@pytest.mark.parametrize("inner_steps", [1, 2])
def test_grpo_step_reports_the_move_of_the_whole_step(tiny_model, inner_steps):
    """Was: KL and clip fraction from the ratio *before* the last optimizer step, so always 0 at inner_steps = 1.
    Now: measured after it, equal to the k3 KL and the binding-clip share recomputed from the policy after the step."""
    pol = Policy.from_pretrained(tiny_model, lr=1e-2)
    with torch.no_grad():
        old, mask = pol.token_logprobs(PAIRS)
    out = pol.grpo_step(PAIRS, ADV, inner_steps=inner_steps)
    with torch.no_grad():
        new, _ = pol.token_logprobs(PAIRS)
    log_ratio = new - old
    ratio = log_ratio.exp()
    n = mask.sum()
    kl = float((((ratio - 1) - log_ratio) * mask).sum() / n)
    adv = torch.tensor(ADV)[:, None]
    binds = ((ratio > 1 + pol.clip_eps) & (adv > 0)) | ((ratio < 1 - pol.clip_eps) & (adv < 0))
    assert kl > 1e-4  # lr 1e-2 moves the tiny policy visibly
    assert out["approx_kl"] == pytest.approx(kl, rel=1e-4, abs=1e-7)
    assert out["clip_frac"] == pytest.approx(float((binds & mask).sum() / n), abs=1e-6)


def test_clip_frac_counts_only_where_the_clip_binds(tiny_model):
    """A token whose ratio left [1 − ε, 1 + ε] in the direction its advantage pushes is clipped; one that left it the
    other way is not (the min takes the unclipped term there). Was: |ρ − 1| > ε counted whatever the sign of A."""
    pol = Policy.from_pretrained(tiny_model, lr=1e-2)
    eps = pol.clip_eps
    # rows: A > 0, A < 0; tokens: ρ above, below, inside the clip range, and one masked-out token above it
    log_ratio = torch.log(torch.tensor([[1 + 2 * eps, 1 - 2 * eps, 1.0, 1 + 2 * eps]] * 2))
    mask = torch.tensor([[True, True, True, False]] * 2)
    adv = torch.tensor([[1.0], [-1.0]])
    real_logprobs, no_grad_calls = pol.token_logprobs, []

    def token_logprobs(pairs, temperature=None):  # 4 positions; after the step, ρ as set above
        logp = real_logprobs(pairs, temperature)[0][:, :4]
        if torch.is_grad_enabled():
            return logp, mask
        no_grad_calls.append(logp)
        return (logp if len(no_grad_calls) == 1 else no_grad_calls[0] + log_ratio), mask

    pol.token_logprobs = token_logprobs
    out = pol.grpo_step([([1, 5], [7, 8, 9, 10])] * 2, adv.flatten().tolist(), inner_steps=1)
    assert out["clip_frac"] == pytest.approx(2 / 6)  # row 0 token 0 (ρ > 1 + ε, A > 0), row 1 token 1
    assert len(no_grad_calls) == 2  # π_old, and the measurement after the last optimizer step
    r = log_ratio.exp()
    assert out["approx_kl"] == pytest.approx(float((((r - 1) - log_ratio) * mask).sum() / 6), rel=1e-5)


# -- finding 3: no fallback to unweighted KD --------------------------------------------------------------------
def test_linear_weights_without_a_positive_reward_are_zero_and_continuous():
    """Was: a batch without a positive reward (or with a tiny one) fell back to w = 1 for every rollout."""
    for r in ([0.0, 0.0, 0.0, 0.0], [-1.0, -1.0, -1.0, -1.0], [-1.0, 0.0, -0.5]):
        assert torch.equal(reward_weights(r), torch.zeros(len(r))), r
    w = reward_weights([1e-6, -1.0, -1.0, -1.0])
    assert torch.allclose(w, torch.tensor([1.0, 0.0, 0.0, 0.0]))  # not all ones
    # as the one positive reward shrinks to 0 its weight goes to 0 without a jump (the mean is floored at eps = 1e-6
    # of max |r|: w = r / max(mean, eps), then clipped at w_max = 2); the negative rewards stay at 0
    expected = {1e-4: 2.0, 4e-6: 2.0, 2e-6: 2.0, 1e-6: 1.0, 5e-7: 0.5, 1e-7: 0.1, 1e-9: 1e-3, 0.0: 0.0}
    for x, want in expected.items():
        w = reward_weights([x, -1.0, -1.0, -1.0])
        assert float(w[0]) == pytest.approx(want, rel=1e-5, abs=1e-9) and torch.equal(w[1:], torch.zeros(3)), x
    # unchanged: a batch with a positive reward is normalised by its mean and clipped; zscore keeps its rule
    assert torch.allclose(reward_weights([1.0, 0.25]), torch.tensor([1.6, 0.4]))
    assert torch.equal(reward_weights([0.0, 0.0, 0.0], mode="zscore"), torch.ones(3))
    zs = torch.tensor([1 - 1 / 3**0.5] * 3 + [2.0])
    assert torch.allclose(reward_weights([0.0, 0.0, 0.0, 4.0], mode="zscore"), zs, atol=1e-5)


def _rollouts(seqs, rewards):
    return [{"prompt_ids": list(p), "response_ids": list(r), "reward": w} for (p, r), w in zip(seqs, rewards)]


def test_learner_skips_and_counts_an_update_without_a_positive_reward(tiny_drafter, tiny_features, tiny_seqs):
    """Was: an all-zero-reward step trained unweighted KD on failed rollouts and published it. Now: skipped with
    reason ``zero_weight``, nothing published, counted in the state; the unweighted variant still trains."""
    published = []
    cfg = LearnerConfig(mode="sync", update_interval=1, train_steps=2, micro_batch=2, kd_steps=1, lr=1e-3)
    lrn = OnlineLearner(tiny_drafter, tiny_features.batch, cfg, publish=lambda v, t: published.append(v))
    assert lrn.weight_mode == "linear"
    lrn.submit(_rollouts(tiny_seqs[:3], (0.0, 0.0, 0.0)))
    lrn.submit(_rollouts(tiny_seqs[:3], (-1.0, -1.0, 0.0)))
    assert [r.reason for r in lrn.history] == ["zero_weight"] * 2 and published == [] and lrn.version == 0
    state = lrn.state()
    assert state["zero_weight_updates"] == 2 and state["updates"][-1]["outcome"] == "rolled_back"
    lrn.submit(_rollouts(tiny_seqs[:3], (1.0, 1.0, 1.0)))  # a positive reward: trains and publishes
    assert published == [1] and lrn.state()["zero_weight_updates"] == 2

    unweighted = LearnerConfig(variant="unweighted", mode="sync", update_interval=1, train_steps=1, micro_batch=2)
    lrn = OnlineLearner(tiny_drafter, tiny_features.batch, unweighted, publish=lambda v, t: published.append(v))
    lrn.submit(_rollouts(tiny_seqs[:3], (0.0, 0.0, 0.0)))
    assert lrn.history[-1].outcome == "published" and lrn.state()["zero_weight_updates"] == 0


# -- finding 4: GRPO at the sampler's temperature ---------------------------------------------------------------
def test_grpo_loop_refuses_a_policy_at_another_temperature(tiny_model):
    """Was: accepted silently (ratios and gradients at the wrong temperature: an off-policy objective)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model)
    cfg = GRPOConfig(prompts_per_step=1, group_size=2, temperature=1.0)
    with pytest.raises(ValueError, match="temperature"):
        GRPOLoop(ServerClient("http://unused"), Policy.from_pretrained(tiny_model, temperature=0.7), tok, ToyAdd(), cfg)
    hot = GRPOConfig(prompts_per_step=1, group_size=2, temperature=0.7)
    loop = GRPOLoop(
        ServerClient("http://unused"), Policy.from_pretrained(tiny_model, temperature=0.7), tok, ToyAdd(), hot
    )
    assert loop.policy.temperature == loop.config.temperature == 0.7
