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
learns (0.30 → 0.43). ``grpo_step`` reports ``approx_kl`` (mean of ρ − 1 − log ρ over response tokens, last inner
step) and ``clip_frac`` so that a too-large step shows.
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
        losses, clipped, kl = [], 0.0, 0.0
        for _ in range(inner_steps):
            new, _ = self.token_logprobs(pairs)
            ratio = torch.exp(new - old)
            surr = torch.minimum(ratio * adv, ratio.clamp(1 - self.clip_eps, 1 + self.clip_eps) * adv)
            loss = -((surr * mask).sum(-1) / n_tok).mean()
            losses.append(self._apply(loss))
            n = mask.sum().clamp(min=1)
            clipped = float((((ratio - 1).abs() > self.clip_eps) & mask).sum() / n)
            kl = float((((ratio - 1) - (new - old)).detach() * mask).sum() / n)
        self.version += 1
        return {"loss": losses[-1], "clip_frac": clipped, "approx_kl": kl, "version": self.version}

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
