"""Target-side features for drafter training: captured hidden states and logits from an HF Llama copy of the
served model (``output_hidden_states``), restricted to the draft vocabulary and packed into a :class:`Batch`.

HF ``hidden_states[i]`` is the input of decoder layer i, the same tensor SGLang captures for EAGLE-3 at
``layers_to_capture = [i]``. The copy is always run: the drafter's input features (aux hidden states) come only
from it. Its KD target (``target_logp``) can be replaced by the served target's top-k log-probs
(:func:`served_target`), and :func:`sampled_logp_gap` measures how far the copy's log p is from the served one.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import threading
from dataclasses import dataclass
from typing import Dict, Iterator, List, Optional, Sequence, Tuple

import numpy as np
import torch

from sglang_spex.respec.buffer import PAD_ID, TopK

LOG_ZERO = -1e4  # log p of a draft token outside the served top-k (exp() is exactly 0, the KL term is 0)


CHUNK_TOKENS = 4096  # padded tokens per forward of the copy: its fp32 logits are CHUNK_TOKENS x vocab x 4 bytes


def _chunks(lengths: Sequence[int], rows: int, tokens: int) -> List[Tuple[int, int]]:
    """Consecutive ``[start, end)`` groups of at most ``rows`` sequences whose padded size (count x longest) stays
    within ``tokens``; a sequence longer than ``tokens`` is a group of its own."""
    out: List[Tuple[int, int]] = []
    start, longest = 0, 0
    for i, n in enumerate(lengths):
        wider = max(longest, n)
        if i > start and (i - start >= rows or (i - start + 1) * wider > tokens):
            out.append((start, i))
            start, wider = i, n
        longest = wider
    if lengths:
        out.append((start, len(lengths)))
    return out


@dataclass
class Batch:
    """Right-padded training batch. Index j is token x_j; ``target_logp[:, j]`` is the target's next-token
    distribution after x_j (log-softmax over the draft vocabulary), ``loss_mask[:, j]`` says whether that
    prediction is trained (response tokens), ``target_argmax`` is the full-vocabulary greedy token,
    ``token_logp[:, j]`` the copy's full-vocabulary log-prob of the next data token x_{j+1} (0 at the last index;
    None in batches saved before it existed)."""

    input_ids: torch.Tensor  # [B, L] long
    attention_mask: torch.Tensor  # [B, L] bool
    loss_mask: torch.Tensor  # [B, L] bool
    aux_hidden: torch.Tensor  # [B, L, k*H]
    target_logp: torch.Tensor  # [B, L, Vd]
    target_argmax: torch.Tensor  # [B, L] long
    token_logp: Optional[torch.Tensor] = None  # [B, L] float32

    def __len__(self) -> int:
        return self.input_ids.shape[0]

    def select(self, idx: Sequence[int]) -> "Batch":
        idx = torch.as_tensor(list(idx), dtype=torch.long)
        return Batch(*(None if (t := getattr(self, f)) is None else t[idx] for f in self.__dataclass_fields__))

    def span(self, start: int, end: int) -> "Batch":
        """Tokens ``start .. end`` of every row (features were computed with the context before ``start``)."""
        return Batch(*(None if (t := getattr(self, f)) is None else t[:, start:end] for f in self.__dataclass_fields__))

    def to(self, dtype: torch.dtype) -> "Batch":
        return dataclasses.replace(self, aux_hidden=self.aux_hidden.to(dtype), target_logp=self.target_logp.to(dtype))

    @staticmethod
    def cat(batches: Sequence["Batch"]) -> "Batch":
        """Concatenate along the batch axis, right-padding (zeros) to the longest; each part is copied once into
        the result (no padded intermediate copies)."""
        length = max(b.input_ids.shape[1] for b in batches)
        rows = sum(len(b) for b in batches)

        def cat(ts: List[Optional[torch.Tensor]]) -> Optional[torch.Tensor]:
            if any(t is None for t in ts):
                return None
            out = ts[0].new_zeros((rows, length, *ts[0].shape[2:]))
            row = 0
            for t in ts:
                out[row : row + t.shape[0], : t.shape[1]] = t
                row += t.shape[0]
            return out

        return Batch(*(cat([getattr(b, f) for b in batches]) for f in Batch.__dataclass_fields__))


def served_target(
    batch: Batch, prompt_lens: Sequence[int], top: Sequence[TopK], t2d: torch.Tensor
) -> Tuple[Batch, int]:
    """``batch`` with its KD target taken from the served target's top-k instead of the copy's logits (the copy's
    aux hidden states are kept: the drafter reads them). Row i of ``top[b]``: (target token id, log p) pairs of the
    distribution response token i of rollout b was sampled from, i.e. ``target_logp[b, prompt_lens[b] - 1 + i]``.
    Ids outside the draft vocabulary (``t2d``) are dropped, the rest renormalised; every other draft token gets
    p = 0. A trained position whose top-k has no draft token has no target and leaves the loss mask. Returns
    (batch, number of positions so masked)."""
    bsz, length, vd = batch.target_logp.shape
    to_draft = torch.full((t2d.numel(),), -1, dtype=torch.long)
    to_draft[t2d.bool()] = torch.arange(int(t2d.sum()))
    cells = []  # (flat position, target token id, log p) of every top-k cell inside the batch's rows
    for b, (plen, rows) in enumerate(zip(prompt_lens, top)):
        at = plen - 1 + np.arange(len(rows))
        inside = (at >= 0) & (at < length)
        ids, lps = rows.ids[inside], rows.logp[inside]
        cell = ids != PAD_ID
        cells.append((np.broadcast_to((b * length + at[inside])[:, None], ids.shape)[cell], ids[cell], lps[cell]))
    pos, tok, lps = (torch.from_numpy(np.concatenate(c)) for c in zip(*cells))
    pos, draft, lps = pos.long(), to_draft[tok.long()], lps.double()
    keep = draft >= 0
    pos, draft, lps = pos[keep], draft[keep], lps[keep]
    peak = torch.full((bsz * length,), -math.inf, dtype=torch.float64).scatter_reduce(0, pos, lps, "amax")
    mass = torch.zeros(bsz * length, dtype=torch.float64).index_add_(0, pos, (lps - peak[pos]).exp())
    logp = torch.full((bsz * length, vd), LOG_ZERO, dtype=batch.target_logp.dtype)
    logp[pos, draft] = (lps - peak[pos] - mass[pos].log()).to(logp.dtype)
    covered = torch.zeros(bsz * length, dtype=torch.bool)
    covered[pos] = True
    trained = batch.loss_mask & batch.attention_mask
    mask = trained & covered.view(bsz, length)
    target = logp.view(bsz, length, vd)
    return dataclasses.replace(batch, target_logp=target, loss_mask=mask), int((trained & ~mask).sum())


def sampled_logp_gap(
    batch: Batch, prompt_lens: Sequence[int], served: Sequence[Optional[Sequence[Optional[float]]]]
) -> Optional[float]:
    """Mean |copy log p − served log p| of the sampled response tokens where both exist (``served[b][i]``: the
    served log-prob of response token i of rollout b, or None); None when there is no such token. A gap well
    above numerical noise says the copy no longer matches the served policy (or, with sampling temperature ≠ 1,
    that the server returned tempered log-probs)."""
    if batch.token_logp is None:
        return None
    length = batch.token_logp.shape[1]
    gaps = [
        abs(float(batch.token_logp[b, plen - 1 + i]) - lp)
        for b, (plen, values) in enumerate(zip(prompt_lens, served))
        for i, lp in enumerate(values or ())
        if lp is not None and 0 <= plen - 1 + i < length - 1
    ]
    return sum(gaps) / len(gaps) if gaps else None


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
        Unknown names or shapes, and values not finite in the copy's dtype (a float64 1e300 is inf in float32),
        raise before anything is copied."""
        state = self.model.state_dict()
        converted = []
        for name, t in named:
            if name not in state:
                raise KeyError(f"unknown policy tensor {name!r}")
            if tuple(t.shape) != tuple(state[name].shape):
                raise ValueError(f"{name}: shape {tuple(t.shape)} != {tuple(state[name].shape)}")
            c = t.to(state[name].dtype)
            if not torch.isfinite(c).all():
                raise ValueError(f"{name}: non-finite values (in the copy's {state[name].dtype})")
            converted.append((name, c))
        with self._lock, torch.no_grad():
            for name, c in converted:
                state[name].copy_(c)
        return len(named)

    @torch.no_grad()
    def forward(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor, start: int = 0
    ) -> Tuple[torch.Tensor, ...]:
        """(aux hidden, draft-vocab log p, full-vocab argmax, full-vocab log p of the next input token) at the
        positions from ``start`` on (the logits are computed only there, and only the aux layers' inputs kept)."""
        keep = torch.arange(start, input_ids.shape[1]) if start else 0
        # no padding: no mask, so the model's attention can take its causal kernel instead of materialising one
        mask = None if bool(attention_mask.all()) else attention_mask.long()
        with self._aux_inputs(start) as captured:
            out = self.model(
                input_ids=input_ids, attention_mask=mask, output_hidden_states=captured is None, logits_to_keep=keep
            )
        states = captured if captured is not None else {i: out.hidden_states[i][:, start:] for i in self.aux_layer_ids}
        aux = torch.cat([states[i] for i in self.aux_layer_ids], -1).to(self.feature_dtype)
        logits = out.logits.float()
        logp = torch.log_softmax(logits[..., self.t2d], -1).to(self.feature_dtype)
        nxt = torch.cat([input_ids[:, start + 1 :], torch.zeros_like(input_ids[:, :1])], 1)
        token = logits.gather(-1, nxt[..., None])[..., 0] - logits.logsumexp(-1)
        token[:, -1] = 0.0
        return aux, logp, logits.argmax(-1), token

    @contextlib.contextmanager
    def _aux_inputs(self, start: int) -> Iterator[Optional[Dict[int, torch.Tensor]]]:
        """The inputs of the aux decoder layers (HF ``hidden_states[i]``) from ``start`` on, captured by pre-hooks,
        so the copy never holds every layer's states (``output_hidden_states``); None where the model's decoder
        layers are not found (then the caller asks for ``output_hidden_states``)."""
        decoder = self.model.get_decoder() if hasattr(self.model, "get_decoder") else None
        layers = getattr(decoder, "layers", None)
        if layers is None or max(self.aux_layer_ids) >= len(layers):
            yield None
            return
        captured: Dict[int, torch.Tensor] = {}

        def capture(i: int):
            def hook(module, args, kwargs):
                hidden = args[0] if args else kwargs["hidden_states"]
                captured[i] = hidden[:, start:].clone()

            return hook

        handles = [layers[i].register_forward_pre_hook(capture(i), with_kwargs=True) for i in set(self.aux_layer_ids)]
        try:
            yield captured
        finally:
            for h in handles:
                h.remove()

    def batch(
        self,
        sequences: Sequence[Tuple[Sequence[int], Sequence[int]]],
        max_len: Optional[int] = None,
        chunk: int = 8,
        chunk_tokens: int = CHUNK_TOKENS,
        windows: Optional[Sequence[Optional[Tuple[int, int]]]] = None,
    ) -> Batch:
        """Features for (prompt_ids, response_ids) pairs; loss on the predictions of response tokens. The copy runs
        on at most ``chunk`` sequences at a time, fewer where their padded tokens would pass ``chunk_tokens`` (its
        full-vocabulary logits grow with them); a longer sequence runs alone. ``windows[i]`` = (start, end): row i
        holds only tokens ``start .. end`` of its sequence, their features computed with the whole context before
        them (None: the whole sequence)."""
        with self._lock:
            return self._batch(sequences, max_len, chunk, chunk_tokens, windows)

    def _batch(self, sequences, max_len, chunk, chunk_tokens, windows) -> Batch:
        seqs_all = [
            np.concatenate((np.asarray(p, dtype=np.int64), np.asarray(r, dtype=np.int64))) for p, r in sequences
        ]
        if max_len is not None:
            seqs_all = [q[:max_len] for q in seqs_all]
        spans = [(0, len(q)) if w is None else w for q, w in zip(seqs_all, windows or [None] * len(seqs_all))]
        full = [len(q) for q in seqs_all]
        seqs_all = [q[:end] for q, (_, end) in zip(seqs_all, spans)]  # later tokens never reach a causal feature
        parts: List[Batch] = []
        for s, e in _chunks([len(q) for q in seqs_all], chunk, chunk_tokens):
            group, seqs = sequences[s:e], seqs_all[s:e]
            length = max(len(q) for q in seqs)
            ids = torch.zeros(len(seqs), length, dtype=torch.long)
            attn = torch.zeros(len(seqs), length, dtype=torch.bool)
            loss = torch.zeros(len(seqs), length, dtype=torch.bool)
            for i, ((prompt, _), q, n) in enumerate(zip(group, seqs, full[s:e])):
                ids[i, : len(q)] = torch.from_numpy(q)
                attn[i, : len(q)] = True
                # position j predicts x_{j+1}: train where x_{j+1} is a response token (of the whole sequence)
                loss[i, max(len(prompt) - 1, 0) : min(n - 1, len(q))] = True
            starts = [start for start, _ in spans[s:e]]
            if len(seqs) == 1:  # a sequence alone: the copy's logits only where the row keeps them
                a = starts[0]
                parts.append(Batch(ids[:, a:], attn[:, a:], loss[:, a:], *self.forward(ids, attn, a)))
                continue
            part = Batch(ids, attn, loss, *self.forward(ids, attn))
            if any(starts):
                parts.extend(part.select([i]).span(a, len(q)) for i, (a, q) in enumerate(zip(starts, seqs)))
            else:
                parts.append(part)
        return Batch.cat(parts)
