"""The RL policy's trainable copy in the client process: an HF causal LM, trained with a GRPO objective (or a
short supervised warm start), whose weights are pushed into the serving SGLang engine after each step.

GRPO objective (one policy step = ``inner_steps`` optimizer steps on the same group of samples):

    L = − mean_b [ mean_t min(ρ_{b,t} A_b, clip(ρ_{b,t}, 1 − ε, 1 + ε) A_b) ],   ρ = π_θ(y_t | ·) / π_old(y_t | ·)

with π at the sampling temperature, π_old = the policy before the step, A_b the group-normalised advantage
(:func:`sglang_spex.respec.grpo.group_advantages`). No reference-KL term (β = 0). The input embedding is frozen
by default: SGLang's EAGLE-3 drafter reads the target's embedding, so a frozen one keeps the drafter's input
space fixed and the push smaller.

Step size: AdamW moves every weight by about ``lr`` per optimizer step whatever the size of its (small, noisy)
policy gradient. On the warm-started tiny Llama (weights of std ~0.02) lr 1e-3 moved the policy outside the clip
region within two inner steps and its accuracy fell (0.30 → 0.14 in 30 steps, same code with HF sampling); lr 1e-4
learns (0.30 → 0.43). ``grpo_step`` reports the move the whole step made, so that a too-large step shows: after
the last optimizer step it runs one more forward pass (no grad, no backward) on the same batch and, with ρ = π_new /
π_old from it, reports ``approx_kl`` = the masked mean over response tokens of ρ − 1 − log ρ (the k3 estimator of
KL(π_old ‖ π_new)) and ``clip_frac`` = the share of response tokens where the clip binds, i.e. ρ > 1 + ε with A > 0
or ρ < 1 − ε with A < 0. That forward costs about 1 / (1 + 3 · inner_steps) more compute per policy step (the
π_old forward plus inner_steps forward + backward passes; ~14 % at ``inner_steps`` = 2).

Aggregation: each sequence's token terms are averaged over its own response tokens, then sequences are averaged
(the DeepSeekMath GRPO form: a token of a response of length |o| weighs A / |o|), not a token mean over the batch.
π_old is this copy's own recomputation at the start of the step (float32), not the server's sampling log-probs.
"""

from __future__ import annotations

from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

import torch

Pair = Tuple[Sequence[int], Sequence[int]]


def _pack(pairs: Sequence[Pair]) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-padded ids, attention mask, and the mask of positions whose *next* token is a response token."""
    if not pairs:
        raise ValueError("no sequences")
    seqs = [list(p) + list(r) for p, r in pairs]
    if any(not p or not r for p, r in pairs):
        raise ValueError("every sequence needs a non-empty prompt and response")
    length = max(len(s) for s in seqs)
    ids = torch.zeros(len(seqs), length, dtype=torch.long)
    attn = torch.zeros(len(seqs), length, dtype=torch.long)
    resp = torch.zeros(len(seqs), length - 1, dtype=torch.bool)
    for i, ((prompt, _), s) in enumerate(zip(pairs, seqs)):
        ids[i, : len(s)] = torch.tensor(s)
        attn[i, : len(s)] = 1
        resp[i, len(prompt) - 1 : len(s) - 1] = True
    return ids, attn, resp


class Policy:
    """Trainable HF copy of the served policy (float32, CPU)."""

    def __init__(
        self,
        model,
        lr: float = 1e-5,
        temperature: float = 1.0,
        clip_eps: float = 0.2,
        grad_clip: float = 1.0,
        freeze_embeddings: bool = True,
    ):
        if lr <= 0 or temperature <= 0 or clip_eps <= 0:
            raise ValueError("lr, temperature and clip_eps must be > 0")
        self.model = model.float().train()
        self.temperature = temperature
        self.clip_eps = clip_eps
        self.grad_clip = grad_clip
        if freeze_embeddings:
            self.model.get_input_embeddings().weight.requires_grad_(False)
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.opt = torch.optim.AdamW(self.params, lr=lr, weight_decay=0.0)
        self.version = 0

    @classmethod
    def from_pretrained(cls, path, **kw) -> "Policy":
        from transformers import AutoModelForCausalLM

        return cls(AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32), **kw)

    # -- log-probs ------------------------------------------------------------------------------------------------
    def token_logprobs(self, pairs: Sequence[Pair], temperature: Optional[float] = None) -> Tuple[torch.Tensor, ...]:
        """log π(response token | prefix) at ``temperature`` (default: the sampling one): ([B, L-1], mask)."""
        ids, attn, resp = _pack(pairs)
        logits = self.model(input_ids=ids, attention_mask=attn).logits[:, :-1].float()
        logp = torch.log_softmax(logits / (temperature or self.temperature), -1)
        return logp.gather(-1, ids[:, 1:, None]).squeeze(-1), resp

    # -- updates --------------------------------------------------------------------------------------------------
    def _apply(self, loss: torch.Tensor) -> float:
        if not torch.isfinite(loss):
            raise FloatingPointError(f"non-finite policy loss {float(loss)}")
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.params, self.grad_clip)
        self.opt.step()
        return float(loss.detach())

    def grpo_step(self, pairs: Sequence[Pair], advantages: Sequence[float], inner_steps: int = 1) -> Dict[str, float]:
        """One policy step on a batch of samples with their advantages (clipped surrogate, see module doc)."""
        if len(pairs) != len(advantages):
            raise ValueError(f"{len(pairs)} samples but {len(advantages)} advantages")
        if inner_steps < 1:
            raise ValueError("inner_steps must be >= 1")
        adv = torch.as_tensor(list(advantages), dtype=torch.float32)[:, None]
        self.model.train()
        with torch.no_grad():
            old, mask = self.token_logprobs(pairs)
        n_tok = mask.sum(-1).clamp(min=1)
        losses = []
        for _ in range(inner_steps):
            new, _ = self.token_logprobs(pairs)
            ratio = torch.exp(new - old)
            surr = torch.minimum(ratio * adv, ratio.clamp(1 - self.clip_eps, 1 + self.clip_eps) * adv)
            loss = -((surr * mask).sum(-1) / n_tok).mean()
            losses.append(self._apply(loss))
        self.version += 1
        with torch.no_grad():  # the step's actual move: one more forward after the last optimizer step
            new, _ = self.token_logprobs(pairs)
        return {"loss": losses[-1], **self._step_size(new - old, adv, mask), "version": self.version}

    def _step_size(self, log_ratio: torch.Tensor, adv: torch.Tensor, mask: torch.Tensor) -> Dict[str, float]:
        """``approx_kl`` (masked mean of ρ − 1 − log ρ) and ``clip_frac`` (share of masked tokens where the clip
        binds: ρ > 1 + ε with A > 0, or ρ < 1 − ε with A < 0). ``adv``: [B, 1]; ``log_ratio``, ``mask``: [B, L-1]."""
        ratio = log_ratio.exp()
        n = mask.sum().clamp(min=1)
        binds = ((ratio > 1 + self.clip_eps) & (adv > 0)) | ((ratio < 1 - self.clip_eps) & (adv < 0))
        return {
            "clip_frac": float((binds & mask).sum() / n),
            "approx_kl": float((((ratio - 1) - log_ratio) * mask).sum() / n),
        }

    def sft_step(self, pairs: Sequence[Pair]) -> float:
        """One supervised step (mean response-token NLL at temperature 1): the warm start of a tiny policy."""
        self.model.train()
        logp, mask = self.token_logprobs(pairs, temperature=1.0)
        return self._apply(-(logp * mask).sum() / mask.sum().clamp(min=1))

    # -- export ---------------------------------------------------------------------------------------------------
    def named_tensors(self, dtype: torch.dtype = torch.float32) -> List[Tuple[str, torch.Tensor]]:
        """The trainable weights by HF name (what SGLang's ``LlamaForCausalLM.load_weights`` takes)."""
        return [(n, p.detach().to(dtype).contiguous()) for n, p in self.model.named_parameters() if p.requires_grad]

    def save_pretrained(self, out_dir, tokenizer=None) -> Path:
        out = Path(out_dir)
        self.model.save_pretrained(str(out))
        if tokenizer is not None:
            tokenizer.save_pretrained(str(out))
        return out
