"""Reward-weighted knowledge distillation (ReSpec): L = Σ_b w(r_b) · Σ_t m_{b,t} · KL(p_target ‖ q_drafter) / N.

Weighting, ``mode="linear"`` (the paper's w(r) = r, normalised and clipped; the learner's default once
``LearnerConfig.weight_mode`` defaults to it):

    w_b = clip(max(r_b, 0) / max(mean_b max(r_b, 0), eps), 0, w_max)      (r first divided by max_b |r_b|)

so w is proportional to the reward, the batch-mean weight is 1 before the clip (the loss scale of unweighted KD;
while the mean is at least the floor), a zero or negative reward gives 0 (the drafter is never pushed *away* from a
rollout) and no rollout counts more than ``w_max`` times. A batch without any positive reward (all 0, all
negative) gets w = 0 for every rollout: the learner then skips the update (``UpdateRecord.reason ==
"zero_weight"``, counted in ``state()["zero_weight_updates"]``) instead of distilling failed rollouts. The floor
``eps`` on the mean (relative to max |r|) keeps the rule continuous as the positive rewards vanish:
r = (1e-6, −1, −1, −1) gives (1, 0, 0, 0), r = (1e-7, −1, −1, −1) gives (0.1, 0, 0, 0), r = (0, −1, −1, −1) gives
(0, 0, 0, 0).

``mode="zscore"``: w_b = clip(1 + (r_b − mean(r)) / std(r), 0, w_max) (population std; std ≤ eps → w = 1).
``mode="max"``: w_b = clip(r_b / max_b |r_b|, 0, w_max). ``mode="none"``: w_b = 1 (unweighted KD).

N is the number of trained tokens in the batch (not a function of the weights: it keeps the loss scale independent
of length and does not change the relative weighting). Only q (the current drafter) carries gradient.
With several draft steps the per-step KD terms are summed with the TTT decay 0.8^i, each over its own N (step i
scores the positions that have a target i tokens ahead).
"""

from __future__ import annotations

from typing import Optional, Sequence, Tuple

import torch

from sglang_spex.respec.drafter import Eagle3Drafter, run_block
from sglang_spex.respec.target import Batch
from sglang_spex.respec.ttt import DEFAULT_DECAY, unroll_hidden

WEIGHT_MODES = ("linear", "zscore", "max", "none")
DEFAULT_WEIGHT_MODE = "linear"


def reward_weights(rewards, mode: str = DEFAULT_WEIGHT_MODE, w_max: float = 2.0, eps: float = 1e-6) -> torch.Tensor:
    """Per-rollout weights w(r) (see the module docstring)."""
    r = torch.as_tensor(rewards, dtype=torch.float64)
    top = r.abs().max() if r.numel() else torch.zeros(())
    if float(top) > 0:  # every mode is scale-free; scaled first, a reward near float's range cannot overflow
        r = r / top
    if mode == "none":
        return torch.ones_like(r, dtype=torch.float32)
    if mode == "linear":
        pos = r.clamp(min=0.0)
        mean = pos.mean() if pos.numel() else torch.zeros(())
        w = pos / max(float(mean), eps)  # no positive reward → 0 everywhere (no fallback to unweighted KD)
    elif mode == "zscore":
        std = r.std(unbiased=False) if r.numel() > 1 else torch.zeros(())
        w = 1.0 + (r - r.mean()) / std if float(std) > eps else torch.ones_like(r)
    elif mode == "max":
        top = r.abs().max()
        w = r / top if float(top) > 0 else torch.ones_like(r)
    else:
        raise ValueError(f"unknown weight mode {mode!r}; choose from {WEIGHT_MODES}")
    return w.clamp(0.0, w_max).float()


def token_kl(log_p: torch.Tensor, log_q: torch.Tensor) -> torch.Tensor:
    """KL(p ‖ q) per token over the last axis."""
    return (log_p.exp() * (log_p - log_q)).sum(-1)


def kd_loss(log_p: torch.Tensor, log_q: torch.Tensor, mask: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Σ_b w_b Σ_t m_{b,t} KL(p_{b,t} ‖ q_{b,t}) / Σ m. Shapes: [B, T, V], [B, T, V], [B, T], [B]."""
    kl = token_kl(log_p.float(), log_q) * mask
    n = mask.sum().clamp(min=1)
    return (weights.to(kl.dtype) * kl.sum(-1)).sum() / n


KD_BLOCK_LOGITS = 1 << 24  # draft-vocabulary logits computed at once in the KD loss (16M floats, 64 MB)


def _block_kl(drafter: Eagle3Drafter, hidden: torch.Tensor, log_p: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Σ_t m_{b,t} KL(p_{b,t} ‖ q_{b,t}) over a block of positions, per row: [B]."""
    log_q = torch.log_softmax(drafter.head(hidden).float(), -1)
    return (token_kl(log_p.float(), log_q) * mask).sum(-1)


def reward_weighted_kd(
    drafter: Eagle3Drafter,
    batch: Batch,
    rewards: Sequence[float],
    mode: str = DEFAULT_WEIGHT_MODE,
    steps: int = 1,
    decay: float = DEFAULT_DECAY,
    w_max: float = 2.0,
    weights: Optional[torch.Tensor] = None,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """The drafter's KD loss on a batch of rollouts, unrolled ``steps`` draft steps. Returns (loss, weights).
    ``weights`` overrides w(r) (e.g. weights normalised over a whole update batch, applied to a micro-batch).
    The value is :func:`kd_loss` of each step's full log q; the vocabulary head runs on blocks of positions
    (``KD_BLOCK_LOGITS`` logits at a time, recomputed in backward), so its [B, T, Vd] tensors never exist at once."""
    w = reward_weights(rewards, mode, w_max) if weights is None else weights
    loss = torch.zeros(())
    bsz, vd = batch.target_logp.shape[0], batch.target_logp.shape[2]
    cols = max(1, KD_BLOCK_LOGITS // max(1, bsz * vd))
    for i, s in enumerate(unroll_hidden(drafter, batch, steps)):
        # position t is scored against target_logp[:, t + offset]; past the batch's end the mask is 0
        scored = batch.target_logp.shape[1] - s.offset
        recompute = torch.is_grad_enabled() and cols < scored
        per_row = torch.zeros(bsz)
        for a in range(0, scored, cols):
            b = min(a + cols, scored)
            part = (drafter, s.hidden[:, a:b], batch.target_logp[:, a + s.offset : b + s.offset], s.mask[:, a:b])
            per_row = per_row + run_block(_block_kl, *part, recompute=recompute)
        loss = loss + (decay**i) * (w.to(per_row.dtype) * per_row).sum() / s.mask.sum().clamp(min=1)
    return loss, w
