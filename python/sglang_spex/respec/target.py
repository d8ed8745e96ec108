"""Target-side features for drafter training: captured hidden states and logits from an HF Llama copy of the
served model (``output_hidden_states``), restricted to the draft vocabulary and packed into a :class:`Batch`.

HF ``hidden_states[i]`` is the input of decoder layer i, the same tensor SGLang captures for EAGLE-3 at
``layers_to_capture = [i]``.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

import torch


@dataclass
class Batch:
    """Right-padded training batch. Index j is token x_j; ``target_logp[:, j]`` is the target's next-token
    distribution after x_j (log-softmax over the draft vocabulary), ``loss_mask[:, j]`` says whether that
    prediction is trained (response tokens), ``target_argmax`` is the full-vocabulary greedy token."""

    input_ids: torch.Tensor  # [B, L] long
    attention_mask: torch.Tensor  # [B, L] bool
    loss_mask: torch.Tensor  # [B, L] bool
    aux_hidden: torch.Tensor  # [B, L, k*H]
    target_logp: torch.Tensor  # [B, L, Vd]
    target_argmax: torch.Tensor  # [B, L] long

    def __len__(self) -> int:
        return self.input_ids.shape[0]

    def select(self, idx: Sequence[int]) -> "Batch":
        idx = torch.as_tensor(list(idx), dtype=torch.long)
        return Batch(*(getattr(self, f)[idx] for f in self.__dataclass_fields__))

    def to(self, dtype: torch.dtype) -> "Batch":
        return Batch(
            self.input_ids,
            self.attention_mask,
            self.loss_mask,
            self.aux_hidden.to(dtype),
            self.target_logp.to(dtype),
            self.target_argmax,
        )

    @staticmethod
    def cat(batches: Sequence["Batch"]) -> "Batch":
        """Concatenate along the batch axis, right-padding to the longest."""
        length = max(b.input_ids.shape[1] for b in batches)

        def pad(t: torch.Tensor) -> torch.Tensor:
            extra = length - t.shape[1]
            if extra == 0:
                return t
            shape = list(t.shape)
            shape[1] = extra
            return torch.cat([t, torch.zeros(shape, dtype=t.dtype)], 1)

        fields = list(Batch.__dataclass_fields__)
        return Batch(*(torch.cat([pad(getattr(b, f)) for b in batches], 0) for f in fields))


class TargetFeatures:
    """Runs an HF causal LM (the target / policy copy) and returns what drafter training needs."""

    def __init__(self, model, aux_layer_ids: Sequence[int], t2d: torch.Tensor, feature_dtype=torch.bfloat16):
        self.model = model.eval()
        self.aux_layer_ids = list(aux_layer_ids)
        self.t2d = t2d.bool()
        self.feature_dtype = feature_dtype
        self._lock = threading.RLock()  # a policy update never lands in the middle of a feature batch

    def load_weights(self, named: Sequence[Tuple[str, torch.Tensor]]) -> int:
        """Copy new policy weights (HF names, e.g. from the RL trainer's push) into the copy; returns the count.
        Unknown names or shapes raise before anything is copied."""
        state = self.model.state_dict()
        for name, t in named:
            if name not in state:
                raise KeyError(f"unknown policy tensor {name!r}")
            if tuple(t.shape) != tuple(state[name].shape):
                raise ValueError(f"{name}: shape {tuple(t.shape)} != {tuple(state[name].shape)}")
            if not torch.isfinite(t).all():
                raise ValueError(f"{name}: non-finite values")
        with self._lock, torch.no_grad():
            for name, t in named:
                state[name].copy_(t.to(state[name].dtype))
        return len(named)

    @torch.no_grad()
    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> Tuple[torch.Tensor, ...]:
        out = self.model(input_ids=input_ids, attention_mask=attention_mask.long(), output_hidden_states=True)
        aux = torch.cat([out.hidden_states[i] for i in self.aux_layer_ids], -1).to(self.feature_dtype)
        logits = out.logits.float()
        logp = torch.log_softmax(logits[..., self.t2d], -1).to(self.feature_dtype)
        return aux, logp, logits.argmax(-1)

    def batch(
        self,
        sequences: Sequence[Tuple[Sequence[int], Sequence[int]]],
        max_len: Optional[int] = None,
        chunk: int = 8,
    ) -> Batch:
        """Features for (prompt_ids, response_ids) pairs; loss on the predictions of response tokens."""
        with self._lock:
            return self._batch(sequences, max_len, chunk)

    def _batch(self, sequences, max_len, chunk) -> Batch:
        parts: List[Batch] = []
        for s in range(0, len(sequences), chunk):
            group = sequences[s : s + chunk]
            seqs = [list(p) + list(r) for p, r in group]
            if max_len is not None:
                seqs = [q[:max_len] for q in seqs]
            length = max(len(q) for q in seqs)
            ids = torch.zeros(len(seqs), length, dtype=torch.long)
            attn = torch.zeros(len(seqs), length, dtype=torch.bool)
            loss = torch.zeros(len(seqs), length, dtype=torch.bool)
            for i, ((prompt, _), q) in enumerate(zip(group, seqs)):
                ids[i, : len(q)] = torch.tensor(q)
                attn[i, : len(q)] = True
                # position j predicts x_{j+1}: train where x_{j+1} is a response token
                loss[i, max(len(prompt) - 1, 0) : len(q) - 1] = True
            aux, logp, argmax = self.forward(ids, attn)
            parts.append(Batch(ids, attn, loss, aux, logp, argmax))
        return Batch.cat(parts)
