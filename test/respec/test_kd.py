"""Reward-weighted KD: the weighting rule, the gradient on a hand-computed case, and the loss going down."""

from __future__ import annotations

import math

import pytest
import torch

from sglang_spex.respec.kd import kd_loss, reward_weighted_kd, reward_weights
from sglang_spex.respec.ttt import ttt_loss


def test_reward_weights_rule():
    assert torch.allclose(reward_weights([1.0, 0.0]), torch.tensor([2.0, 0.0]))  # mean .5, std .5
    assert torch.allclose(reward_weights([3.0, 3.0, 3.0]), torch.ones(3))  # equal rewards: unweighted
    zs = torch.tensor([1 - 1 / 3**0.5] * 3 + [2.0])
    assert torch.allclose(reward_weights([0.0, 0.0, 0.0, 4.0], mode="zscore"), zs, atol=1e-5)
    assert torch.allclose(reward_weights([1.0, 0.5, -1.0], mode="max"), torch.tensor([1.0, 0.5, 0.0]))
    assert torch.allclose(reward_weights([5.0, -2.0], mode="none"), torch.ones(2))
    with pytest.raises(ValueError):
        reward_weights([1.0], mode="bogus")


@pytest.mark.parametrize("mode", ["linear", "zscore", "max", "none"])
def test_reward_weights_are_scale_free_and_finite_near_floats_range(mode):
    """A reward of 1e39 (finite in JSON, inf in float32) or 1.7e308 (inf once summed) weighs like the same rewards
    scaled down: every rule is scale-free, so one huge reward cannot make an update NaN."""
    small = reward_weights([2.0, 0.0, 1.0], mode=mode)
    for scale in (1e39, 1.7e308 / 2):
        w = reward_weights([2.0 * scale, 0.0, 1.0 * scale], mode=mode)
        assert torch.isfinite(w).all() and torch.allclose(w, small, atol=1e-6), (scale, w, small)


def test_linear_weight_is_the_default_and_proportional_to_reward():
    """The paper's w(r) = r, normalised (batch mean 1) and clipped to [0, w_max]."""
    assert torch.allclose(reward_weights([1.0, 0.25]), torch.tensor([1.6, 0.4]))  # mean .625
    assert torch.allclose(reward_weights([1.0, 0.25], mode="linear"), torch.tensor([1.6, 0.4]))
    assert torch.allclose(reward_weights([0.0, 0.0, 0.0, 4.0]), torch.tensor([0.0, 0.0, 0.0, 2.0]))  # 4 → clip 2
    assert torch.allclose(reward_weights([0.0, 0.0, 0.0, 4.0], w_max=8.0), torch.tensor([0.0, 0.0, 0.0, 4.0]))
    assert torch.allclose(reward_weights([2.0, -1.0, 0.0]), torch.tensor([2.0, 0.0, 0.0]))  # negative → 0
    # a negative reward counts as 0 in the mean too (mean .5, not 1/6): weights stay proportional below the clip
    assert torch.allclose(reward_weights([1.0, 0.5, -1.0]), torch.tensor([2.0, 1.0, 0.0]))
    assert torch.equal(reward_weights([0.0, 0.0]), torch.zeros(2))  # no positive reward: no weight (update skipped)
    # zscore differs on the same rewards: (1, .25) are one std above / below → (2, 0)
    assert torch.allclose(reward_weights([1.0, 0.25], mode="zscore"), torch.tensor([2.0, 0.0]))


def test_linear_weight_loss_hand_computed_two_samples():
    """A 2-sample buffer, rewards (1, 0.25) → w = (1.6, 0.4); one token each over a 2-word vocabulary,
    q = (0.5, 0.5): L = (1.6 · KL(p0‖q) + 0.4 · KL(p1‖q)) / 2 with the KLs written out."""
    p = torch.tensor([[[0.75, 0.25]], [[0.9, 0.1]]])
    log_q = torch.log(torch.full((2, 1, 2), 0.5))
    mask = torch.ones(2, 1, dtype=torch.bool)
    kl0 = 0.75 * math.log(0.75 / 0.5) + 0.25 * math.log(0.25 / 0.5)
    kl1 = 0.9 * math.log(0.9 / 0.5) + 0.1 * math.log(0.1 / 0.5)
    expected = (1.6 * kl0 + 0.4 * kl1) / 2
    val = kd_loss(p.log(), log_q, mask, reward_weights([1.0, 0.25], mode="linear"))
    assert abs(float(val) - expected) < 1e-6
    unweighted = kd_loss(p.log(), log_q, mask, reward_weights([1.0, 0.25], mode="none"))
    assert abs(float(unweighted) - (kl0 + kl1) / 2) < 1e-6 and abs(float(val) - float(unweighted)) > 1e-3


def test_gradient_hand_computed():
    """Two sequences of one token over a 2-word vocabulary. d/dz KL(p‖softmax(z)) = softmax(z) − p, so
    dL/dz_b = w_b (q_b − p_b) / N with N = 2 masked tokens."""
    p = torch.tensor([[[0.75, 0.25]], [[0.5, 0.5]]])
    z = torch.zeros(2, 1, 2, requires_grad=True)  # q = (0.5, 0.5) for both
    mask = torch.ones(2, 1, dtype=torch.bool)
    w = reward_weights([1.0, 0.0])  # → (2, 0)
    kd_loss(p.log(), torch.log_softmax(z, -1), mask, w).backward()
    expected = torch.tensor([[[2 * (0.5 - 0.75) / 2, 2 * (0.5 - 0.25) / 2]], [[0.0, 0.0]]])
    assert torch.allclose(z.grad, expected)
    # unweighted: both sequences pull, with weight 1
    z.grad = None
    kd_loss(p.log(), torch.log_softmax(z, -1), mask, reward_weights([1.0, 0.0], "none")).backward()
    assert torch.allclose(z.grad, torch.tensor([[[-0.125, 0.125]], [[0.0, 0.0]]]))
    # the second sequence's q already equals p: it contributes no gradient either way; the loss value
    # is w_0 · KL(p_0 ‖ q_0) / 2
    kl0 = float((p[0, 0] * (p[0, 0] / 0.5).log()).sum())
    val = kd_loss(p.log(), torch.log_softmax(z.detach(), -1), mask, w)
    assert abs(float(val) - 2 * kl0 / 2) < 1e-6


def test_kd_loss_decreases_on_fixed_buffer(tiny_drafter, tiny_batch):
    torch.manual_seed(0)
    rewards = [1.0, 0.0, 0.5, 1.0, 0.0, 0.2]
    params = [p for p in tiny_drafter.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=3e-3)
    losses = []
    for _ in range(12):
        loss, w = reward_weighted_kd(tiny_drafter, tiny_batch, rewards, steps=2)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    assert losses[-1] < 0.8 * losses[0], losses
    assert float(w[1]) == 0.0 and float(w[0]) > 1.0


def test_zero_weight_rollout_has_no_gradient(tiny_drafter, tiny_batch):
    """A rollout with w = 0 changes nothing: the gradient equals that of the batch without it."""
    sub = tiny_batch.select([0, 1])
    loss, w = reward_weighted_kd(tiny_drafter, sub, [1.0, 0.0], steps=1)
    assert torch.equal(w, torch.tensor([2.0, 0.0]))
    loss.backward()
    g_pair = tiny_drafter.fc.weight.grad.clone()
    tiny_drafter.zero_grad()
    n_pair = float(sub.loss_mask[:, 1:].sum())  # both sequences' trained tokens normalise the pair's loss
    only = tiny_batch.select([0])
    loss1, _ = reward_weighted_kd(tiny_drafter, only, [1.0], steps=1, weights=torch.tensor([2.0]))
    loss1.backward()
    n_one = float(only.loss_mask[:, 1:].sum())
    assert torch.allclose(g_pair, tiny_drafter.fc.weight.grad * n_one / n_pair, atol=1e-6)


def test_ttt_loss_runs_seven_steps(tiny_drafter, tiny_batch):
    loss, accs = ttt_loss(tiny_drafter, tiny_batch, steps=7)
    assert torch.isfinite(loss) and len(accs) == 7
