"""Training-time test (EAGLE-3): unroll the drafter for several steps on its own hidden states, with a soft
cross-entropy per step against the target's distribution restricted to the draft vocabulary, weighted 0.8^i.

Alignment (``Batch`` index j = token x_j): draft step i at position t reads x_{t+1+i} (embedding) and, at
step 0, the target's captured states after x_t; it predicts x_{t+2+i} and is scored against
``target_logp[t+1+i]`` where ``loss_mask[t+1+i]``. Step i runs at RoPE position t+i and attends to the step-0
keys at positions ≤ t plus its own chain (steps 1..i at position t), as the draft tree does at inference.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List

import torch

from sglang_spex.respec.drafter import Eagle3Drafter
from sglang_spex.respec.target import Batch

DEFAULT_STEPS = 7
DEFAULT_DECAY = 0.8


def _shift(x: torch.Tensor, k: int, length: int) -> torch.Tensor:
    """out[:, t] = x[:, t + k] for t < length (zero past the end)."""
    out = x[:, k : k + length]
    if out.shape[1] < length:
        shape = list(x.shape)
        shape[1] = length - out.shape[1]
        out = torch.cat([out, torch.zeros(shape, dtype=x.dtype, device=x.device)], 1)
    return out


@dataclass
class StepOutput:
    """One unrolled step: draft log-probs, the matching target log-probs and mask, greedy correctness."""

    log_q: torch.Tensor  # [B, T, Vd]
    target_logp: torch.Tensor  # [B, T, Vd]
    mask: torch.Tensor  # [B, T] bool
    correct: torch.Tensor  # [B, T] bool: draft argmax (as target id) == target's greedy token
    on_chain: torch.Tensor  # [B, T] bool: the data token fed at this step is the greedy token of the step before


@dataclass
class StepHidden:
    """One unrolled step before the vocabulary head (``drafter.head(hidden)`` gives its logits)."""

    hidden: torch.Tensor  # [B, T, H]: the step's output
    inputs: torch.Tensor  # [B, T] long: the data token fed at each position
    mask: torch.Tensor  # [B, T] bool
    offset: int  # position t is scored against the batch's ``target_logp[:, t + offset]``


def unroll_hidden(drafter: Eagle3Drafter, batch: Batch, steps: int = DEFAULT_STEPS) -> List[StepHidden]:
    """Run ``steps`` draft steps over every position of ``batch`` at once, without the vocabulary head."""
    ids, length = batch.input_ids, batch.input_ids.shape[1] - 1
    if length < 1:
        raise ValueError("sequences must have at least two tokens")
    dtype = next(drafter.fc.parameters()).dtype
    hidden = drafter.fuse(batch.aux_hidden[:, :length].to(dtype))
    base = torch.arange(length, device=ids.device).expand(ids.shape[0], length)
    cache: list = []
    out = []
    for i in range(steps):
        inp = _shift(ids, 1 + i, length)
        hidden = drafter.step_hidden(inp, hidden, base + i, cache)
        mask = _shift(batch.loss_mask & batch.attention_mask, 1 + i, length)
        out.append(StepHidden(hidden, inp, mask, 1 + i))
    return out


def unroll(drafter: Eagle3Drafter, batch: Batch, steps: int = DEFAULT_STEPS) -> List[StepOutput]:
    """Run ``steps`` draft steps over every position of ``batch`` at once."""
    length = batch.input_ids.shape[1] - 1
    d2t = drafter.draft_to_target
    out = []
    for i, s in enumerate(unroll_hidden(drafter, batch, steps)):
        log_q = torch.log_softmax(drafter.head(s.hidden).float(), -1)
        greedy = _shift(batch.target_argmax, 1 + i, length)
        correct = (d2t[log_q.argmax(-1)] == greedy) & s.mask
        prev_greedy = _shift(batch.target_argmax, i, length)
        on_chain = (s.inputs == prev_greedy) if i > 0 else torch.ones_like(s.mask)
        target = _shift(batch.target_logp, s.offset, length).float()
        out.append(StepOutput(log_q, target, s.mask, correct, on_chain))
    return out


def ttt_loss(drafter: Eagle3Drafter, batch: Batch, steps: int = DEFAULT_STEPS, decay: float = DEFAULT_DECAY):
    """Σ_i decay^i · mean_masked(−Σ_v p_v log q_v). Returns (loss, per-step top-1 accuracy list)."""
    total = torch.zeros(())
    accs = []
    for i, s in enumerate(unroll(drafter, batch, steps)):
        n = s.mask.sum().clamp(min=1)
        ce = -(s.target_logp.exp() * s.log_q).sum(-1)
        total = total + (decay**i) * (ce * s.mask).sum() / n
        accs.append(float(s.correct.sum() / n))
    return total, accs


@torch.no_grad()
def acceptance_length(drafter: Eagle3Drafter, batch: Batch, steps: int = DEFAULT_STEPS) -> float:
    """Chain (top-1) acceptance length estimate under greedy verification: at every trained position, 1 (the
    target's own token) + the number of leading draft steps whose top-1 equals the target's greedy token."""
    outs = unroll(drafter, batch, steps)
    alive = torch.ones_like(outs[0].mask)
    accepted = torch.zeros(outs[0].mask.shape, dtype=torch.float32)
    for s in outs:
        alive = alive & s.correct & s.on_chain
        accepted += alive.float()
    valid = outs[0].mask
    n = valid.sum()
    return float(1.0 + (accepted * valid).sum() / n) if n > 0 else float("nan")


def train_ttt(
    drafter: Eagle3Drafter,
    batch: Batch,
    iters: int,
    steps: int = DEFAULT_STEPS,
    lr: float = 1e-3,
    micro_batch: int = 8,
    seed: int = 0,
    warmup: int = 20,
) -> List[float]:
    """Train ``drafter`` in place with the TTT loss for ``iters`` AdamW steps on random micro-batches of
    ``batch`` (linear warm-up, grad-norm clip 0.5); returns the loss curve."""
    g = torch.Generator().manual_seed(seed)
    params = [p for p in drafter.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda i: min(1.0, (i + 1) / max(warmup, 1)))
    drafter.train()
    curve = []
    for _ in range(iters):
        idx = torch.randint(len(batch), (micro_batch,), generator=g).tolist()
        loss, _ = ttt_loss(drafter, batch.select(idx), steps)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 0.5)
        opt.step()
        sched.step()
        curve.append(float(loss.detach()))
    drafter.eval()
    return curve


def fit_drafter(
    target_model, pairs, draft_vocab: int, iters: int, steps: int = DEFAULT_STEPS, t2d=None, **kw
) -> Eagle3Drafter:
    """A fresh drafter for an HF target, TTT-trained on its (prompt ids, response ids) samples. The vocabulary is
    the most frequent tokens of ``pairs``, or ``t2d`` when given (a drafter hot-swapped into a running server must
    keep the served one's: the swap never sends d2t/t2d). ``kw`` goes to :func:`train_ttt`."""
    from sglang_spex.respec.target import TargetFeatures

    if t2d is not None:
        counts, draft_vocab = t2d.float(), int(t2d.sum())
    else:
        counts = torch.zeros(target_model.config.vocab_size)
        for p, r in pairs:
            for x in list(p) + list(r):
                counts[x] += 1
    drafter = Eagle3Drafter.for_target(target_model, min(draft_vocab, target_model.config.vocab_size), counts)
    batch = TargetFeatures(target_model, drafter.cfg.aux_layer_ids, drafter.t2d).batch(list(pairs))
    train_ttt(drafter, batch, iters, steps, **kw)
    return drafter
