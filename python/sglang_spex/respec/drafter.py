"""EAGLE-3 draft model for a Llama-family target, in the checkpoint format SGLang's ``LlamaForCausalLMEagle3`` loads.

Architecture (mirrors ``sglang/srt/models/llama_eagle3.py``):

- ``fc``: Linear(k·H_target → H, no bias) fusing the target's hidden states captured at ``aux_layer_ids``
  (SGLang capture indices = HF ``output_hidden_states`` indices = the *input* of that target layer; default
  ``{2, N/2, N−3}``);
- one decoder layer whose attention input is ``cat(input_layernorm(embed), hidden_norm(fused))`` (2H);
- final ``norm``; its own ``lm_head`` over a reduced draft vocabulary with ``d2t`` (draft id → target id offset)
  and ``t2d`` (bool mask over the target vocabulary).

The embedding is the target's (frozen; SGLang replaces the draft's with the target's via ``set_embed``).
Checkpoint names: ``embed_tokens.weight``, ``fc.weight``, ``layers.0.self_attn.{q,k,v,o}_proj.weight``,
``layers.0.mlp.{gate,up,down}_proj.weight``, ``layers.0.{input_layernorm,hidden_norm,post_attention_layernorm}
.weight``, ``norm.weight``, ``lm_head.weight``, ``d2t``, ``t2d`` — SGLang's ``load_weights`` prefixes ``model.``
and stacks q/k/v and gate/up itself. Files on disk (ours, SpecForge's ``midlayer.*`` layout): ``respec/checkpoint.py``.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from sglang_spex.respec.checkpoint import read_config, read_tensors, vocab_tensors, write_checkpoint

ARCH = "LlamaForCausalLMEagle3"
# Parameters never pushed by a hot-swap: the embedding is shared with the target inside SGLang, and the vocabulary
# mapping (d2t/t2d) is read once when the draft worker starts.
NOT_HOT_SWAPPED = ("embed_tokens.weight", "d2t", "t2d")


def default_aux_layers(num_layers: int) -> List[int]:
    """EAGLE-3's capture layers {2, N/2, N−3}; for very shallow targets, every layer input up to three."""
    ids = [2, num_layers // 2, num_layers - 3]
    if num_layers >= 6 and len(set(ids)) == 3:
        return ids
    return sorted(set(range(num_layers)))[:3]


@dataclass
class DrafterConfig:
    """Shape of the draft model; ``from_target`` copies the attention/MLP shape from a target HF config."""

    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int  # target vocabulary
    draft_vocab_size: int
    target_hidden_size: int
    aux_layer_ids: List[int] = field(default_factory=list)
    target_num_layers: int = 0
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    max_position_embeddings: int = 2048
    bos_token_id: Optional[int] = None
    eos_token_id: Optional[int] = None
    pad_token_id: Optional[int] = None
    # config.json's draft_vocab_size is null: SGLang's drafter then uses the target's lm_head *tensor* itself
    # (``load_lm_head_from_target``, ``set_embed_and_head``), so the head is the target's, frozen, and never pushed
    head_from_target: bool = False

    @classmethod
    def from_target(cls, target_cfg, draft_vocab_size: int, aux_layer_ids: Optional[Sequence[int]] = None):
        n = target_cfg.num_hidden_layers
        head_dim = getattr(target_cfg, "head_dim", None) or target_cfg.hidden_size // target_cfg.num_attention_heads
        rope = getattr(target_cfg, "rope_parameters", None) or {}
        theta = rope.get("rope_theta", getattr(target_cfg, "rope_theta", 10000.0))
        ids = list(aux_layer_ids) if aux_layer_ids is not None else default_aux_layers(n)
        if any(not 0 <= i < n for i in ids):
            raise ValueError(f"aux_layer_ids {ids} must lie in [0, {n}) for a {n}-layer target")
        return cls(
            hidden_size=target_cfg.hidden_size,
            intermediate_size=target_cfg.intermediate_size,
            num_attention_heads=target_cfg.num_attention_heads,
            num_key_value_heads=target_cfg.num_key_value_heads,
            head_dim=head_dim,
            vocab_size=target_cfg.vocab_size,
            draft_vocab_size=min(draft_vocab_size, target_cfg.vocab_size),
            target_hidden_size=target_cfg.hidden_size,
            aux_layer_ids=ids,
            target_num_layers=n,
            rms_norm_eps=target_cfg.rms_norm_eps,
            rope_theta=float(theta),
            max_position_embeddings=target_cfg.max_position_embeddings,
            bos_token_id=getattr(target_cfg, "bos_token_id", None),
            eos_token_id=getattr(target_cfg, "eos_token_id", None),
            pad_token_id=getattr(target_cfg, "pad_token_id", None),
        )

    def to_hf_dict(self) -> dict:
        """The config.json SGLang reads (a LlamaConfig plus the EAGLE-3 fields)."""
        return {
            "architectures": [ARCH],
            "model_type": "llama",
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "num_hidden_layers": 1,
            "hidden_act": "silu",
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_parameters": {"rope_theta": self.rope_theta, "rope_type": "default"},
            "max_position_embeddings": self.max_position_embeddings,
            "vocab_size": self.vocab_size,
            "draft_vocab_size": None if self.head_from_target else self.draft_vocab_size,
            "target_hidden_size": self.target_hidden_size,
            "num_aux_hidden_states": len(self.aux_layer_ids),
            "tie_word_embeddings": False,
            "attention_bias": False,
            "mlp_bias": False,
            "torch_dtype": "bfloat16",
            "bos_token_id": self.bos_token_id,
            "eos_token_id": self.eos_token_id,
            "pad_token_id": self.pad_token_id,
            # SGLang adds 1 to each id (capture at the *input* of layer id+1), so store capture index − 1.
            "eagle_config": {
                "eagle_aux_hidden_state_layer_ids": [i - 1 for i in self.aux_layer_ids],
                "use_aux_hidden_state": True,
            },
            "respec": {"aux_layer_ids": self.aux_layer_ids, "target_num_layers": self.target_num_layers},
        }

    @classmethod
    def from_hf_dict(cls, d: dict, target_config=None) -> "DrafterConfig":
        """From a config.json of ours or of SpecForge / SGLang's EAGLE-3 drafters. Without ``eagle_config`` the
        capture layers are SGLang's default {2, N/2, N−3} of the target (``target_config`` gives N); without
        ``draft_vocab_size`` (or with null) the draft vocabulary is the target's and so is the lm_head
        (``head_from_target``). Variants our drafter does not implement
        (more than one layer, fc_norm, norm_before_fc, tied or biased weights) raise ValueError."""
        if ARCH not in (d.get("architectures") or []):
            raise ValueError(f"not an EAGLE-3 drafter config (architectures={d.get('architectures')})")
        eagle = d.get("eagle_config") or {}
        unsupported = [
            k
            for k, bad in (
                ("num_hidden_layers", d.get("num_hidden_layers", 1) != 1),
                ("fc_norm", bool(d.get("fc_norm") or d.get("use_aux_norm"))),
                ("norm_before_fc", bool(eagle.get("norm_before_fc", d.get("norm_before_fc", False)))),
                ("tie_word_embeddings", bool(d.get("tie_word_embeddings", False))),
                ("bias", bool(d.get("bias") or d.get("attention_bias") or d.get("mlp_bias"))),
            )
            if bad
        ]
        if unsupported:
            raise ValueError(f"EAGLE-3 drafter variant not supported here: {unsupported}")
        n_target = d.get("respec", {}).get("target_num_layers") or (
            target_config.num_hidden_layers if target_config is not None else 0
        )
        if eagle.get("eagle_aux_hidden_state_layer_ids"):
            aux = [i + 1 for i in eagle["eagle_aux_hidden_state_layer_ids"]]
        elif n_target:
            aux = [2, n_target // 2, n_target - 3]  # SGLang's capture default without eagle_config
            if any(not 0 <= i < n_target for i in aux):
                raise ValueError(f"SGLang's default capture layers {aux} do not fit a {n_target}-layer target")
        else:
            raise ValueError("config has no eagle_config layer ids: pass the target's config to pick SGLang's default")
        return cls(
            hidden_size=d["hidden_size"],
            intermediate_size=d["intermediate_size"],
            num_attention_heads=d["num_attention_heads"],
            num_key_value_heads=d.get("num_key_value_heads") or d["num_attention_heads"],
            head_dim=d.get("head_dim") or d["hidden_size"] // d["num_attention_heads"],
            vocab_size=d["vocab_size"],
            draft_vocab_size=d.get("draft_vocab_size") or d["vocab_size"],
            head_from_target=shares_target_head(d),
            target_hidden_size=d.get("target_hidden_size") or d["hidden_size"],
            aux_layer_ids=aux,
            target_num_layers=n_target,
            rms_norm_eps=d.get("rms_norm_eps", 1e-6),
            rope_theta=d.get("rope_theta") or (d.get("rope_parameters") or {}).get("rope_theta", 10000.0),
            max_position_embeddings=d.get("max_position_embeddings", 2048),
            bos_token_id=d.get("bos_token_id"),
            eos_token_id=d.get("eos_token_id"),
            pad_token_id=d.get("pad_token_id"),
        )


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def _rope(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """Neox-style rotary embedding (HF Llama's rotate_half) on x: [B, heads, T, D], positions: [B, T]."""
    d = x.shape[-1]
    inv = 1.0 / (theta ** (torch.arange(0, d, 2, dtype=torch.float32, device=x.device) / d))
    ang = positions.float()[..., None] * inv  # [B, T, D/2]
    cos = torch.cat([ang.cos(), ang.cos()], -1)[:, None].to(x.dtype)
    sin = torch.cat([ang.sin(), ang.sin()], -1)[:, None].to(x.dtype)
    x1, x2 = x[..., : d // 2], x[..., d // 2 :]
    return x * cos + torch.cat([-x2, x1], -1) * sin


ATTN_BLOCK_SCORES = 1 << 24  # attention scores held at once in training (16M floats, 64 MB)


def run_block(fn: Callable[..., torch.Tensor], *args: Any, recompute: bool) -> torch.Tensor:
    """``fn(*args)``; with ``recompute``, its intermediates are not kept but recomputed in backward (checkpoint)."""
    return checkpoint(fn, *args, use_reentrant=False) if recompute else fn(*args)


def _attend_rows(q, k0, v0, start: int, kd=None, vd=None) -> torch.Tensor:
    """Attention of the query rows ``start .. start + rows`` (q: [B, nh, rows, D]): causal over the step-0 keys
    ``k0``/``v0`` [B, nh, T, D] and, with ``kd``/``vd`` [B, nh, rows, i, D], the row's own draft chain."""
    rows, scale = q.shape[2], 1.0 / math.sqrt(q.shape[-1])
    end = start + rows
    s0 = (q @ k0[:, :, :end].transpose(-1, -2)) * scale  # [B, nh, rows, end]
    pos = torch.arange(start, end, device=q.device)[:, None]
    s0 = s0.masked_fill(torch.arange(end, device=q.device)[None, :] > pos, float("-inf"))
    if kd is None:
        return torch.softmax(s0.float(), -1).to(q.dtype) @ v0[:, :, :end]
    sd = (q.unsqueeze(3) * kd).sum(-1) * scale  # [B, nh, rows, i]
    p = torch.softmax(torch.cat([s0, sd], -1).float(), -1).to(q.dtype)
    return p[..., :end] @ v0[:, :, :end] + (p[..., end:].unsqueeze(-1) * vd).sum(3)


class Eagle3Attention(nn.Module):
    """Attention over a 2H input. ``forward`` supports the training-time-test layout: step 0 is causal over the
    sequence; at step i > 0 position t also sees the keys of steps 1..i at position t (its own draft chain)."""

    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        self.cfg = cfg
        h, nh, nkv, hd = cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.q_proj = nn.Linear(2 * h, nh * hd, bias=False)
        self.k_proj = nn.Linear(2 * h, nkv * hd, bias=False)
        self.v_proj = nn.Linear(2 * h, nkv * hd, bias=False)
        self.o_proj = nn.Linear(nh * hd, h, bias=False)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, cache: List[Tuple[torch.Tensor, torch.Tensor]]):
        """x: [B, T, 2H]; positions: [B, T]; cache: (k, v) of earlier steps, appended to in place."""
        cfg = self.cfg
        b, t, _ = x.shape
        rep = cfg.num_attention_heads // cfg.num_key_value_heads
        q = self.q_proj(x).view(b, t, cfg.num_attention_heads, cfg.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, t, cfg.num_key_value_heads, cfg.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, t, cfg.num_key_value_heads, cfg.head_dim).transpose(1, 2)
        q, k = _rope(q, positions, cfg.rope_theta), _rope(k, positions, cfg.rope_theta)
        k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
        cache.append((k, v))
        k0, v0 = cache[0]
        extra = None
        if len(cache) > 1:  # steps 1..i at each position: [B, nh, T, i, D]
            extra = (torch.stack([kk for kk, _ in cache[1:]], 3), torch.stack([vv for _, vv in cache[1:]], 3))
        # query rows in blocks: the scores are [B, nh, rows, T], never [B, nh, T, T]; with gradients each block is
        # recomputed in backward (checkpoint), so a long training sequence keeps only the block outputs
        rows = max(1, ATTN_BLOCK_SCORES // max(1, b * cfg.num_attention_heads * t))
        recompute = torch.is_grad_enabled() and rows < t
        blocks = []
        for a in range(0, t, rows):
            args = (q[:, :, a : a + rows], k0, v0, a, *(e[:, :, a : a + rows] for e in extra or ()))
            blocks.append(run_block(_attend_rows, *args, recompute=recompute))
        out = torch.cat(blocks, 2)
        return self.o_proj(out.transpose(1, 2).reshape(b, t, -1))


class Eagle3MLP(nn.Module):
    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Eagle3DecoderLayer(nn.Module):
    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Eagle3Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = Eagle3MLP(cfg)

    def forward(self, embeds, hidden, positions, cache):
        """Returns the pre-norm residual stream (SGLang's aux output, fed to the next draft step)."""
        residual = hidden
        x = torch.cat([self.input_layernorm(embeds), self.hidden_norm(hidden)], -1)
        h = self.self_attn(x, positions, cache) + residual
        return self.mlp(self.post_attention_layernorm(h)) + h


class Eagle3Drafter(nn.Module):
    """The draft model. ``step`` runs one (unrolled) draft step; ``fuse`` maps captured target states to H."""

    def __init__(self, cfg: DrafterConfig, t2d: Optional[torch.Tensor] = None):
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.embed_tokens.weight.requires_grad_(False)
        self.fc = nn.Linear(len(cfg.aux_layer_ids) * cfg.target_hidden_size, cfg.hidden_size, bias=False)
        self.layers = nn.ModuleList([Eagle3DecoderLayer(cfg)])
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.draft_vocab_size, bias=False)
        if t2d is None:
            t2d = torch.zeros(cfg.vocab_size, dtype=torch.bool)
            t2d[: cfg.draft_vocab_size] = True
        self.register_buffer("t2d", t2d.bool().clone(), persistent=True)
        self.register_buffer("d2t", torch.zeros(cfg.draft_vocab_size, dtype=torch.long), persistent=True)
        self.set_vocab(self.t2d)

    # -- vocabulary -------------------------------------------------------------------------------------------
    def set_vocab(self, t2d: torch.Tensor) -> None:
        """Use the target ids where ``t2d`` is True (ascending) as the draft vocabulary."""
        t2d = t2d.bool()
        ids = torch.nonzero(t2d).flatten()
        if ids.numel() != self.cfg.draft_vocab_size:
            raise ValueError(f"t2d selects {ids.numel()} tokens, draft_vocab_size is {self.cfg.draft_vocab_size}")
        self.t2d.copy_(t2d)
        self.d2t.copy_(ids - torch.arange(ids.numel()))

    @property
    def draft_to_target(self) -> torch.Tensor:
        """Target token id of each draft id (what SGLang calls ``hot_token_id``)."""
        return self.d2t + torch.arange(self.d2t.numel(), device=self.d2t.device)

    @staticmethod
    def select_vocab(counts: torch.Tensor, draft_vocab_size: int) -> torch.Tensor:
        """t2d mask of the ``draft_vocab_size`` most frequent target tokens (ties → lower id)."""
        order = sorted(range(counts.numel()), key=lambda i: (-float(counts[i]), i))[:draft_vocab_size]
        mask = torch.zeros(counts.numel(), dtype=torch.bool)
        mask[order] = True
        return mask

    # -- forward ----------------------------------------------------------------------------------------------
    def fuse(self, aux_hidden: torch.Tensor) -> torch.Tensor:
        return self.fc(aux_hidden)

    def step(self, input_ids, hidden, positions, cache) -> Tuple[torch.Tensor, torch.Tensor]:
        """One draft step. hidden: fused target states (step 0) or the previous step's output ([B, T, H]).
        Returns (next hidden = pre-norm output, draft-vocab logits)."""
        out = self.step_hidden(input_ids, hidden, positions, cache)
        return out, self.head(out)

    def step_hidden(self, input_ids, hidden, positions, cache) -> torch.Tensor:
        """:meth:`step` without the vocabulary head: the next hidden (pre-norm output) only."""
        embeds = self.embed_tokens(input_ids).to(hidden.dtype)
        return self.layers[0](embeds, hidden, positions, cache)

    def head(self, hidden: torch.Tensor) -> torch.Tensor:
        """Draft-vocabulary logits of a step's output."""
        return self.lm_head(self.norm(hidden))

    # -- checkpoints ------------------------------------------------------------------------------------------
    def checkpoint_tensors(self, dtype: torch.dtype = torch.bfloat16) -> Dict[str, torch.Tensor]:
        """All tensors in SGLang's checkpoint naming (d2t int64, t2d bool, weights in ``dtype``)."""
        out = {}
        for name, t in self.state_dict().items():
            out[name] = t.detach().clone() if name in ("d2t", "t2d") else t.detach().to(dtype).contiguous()
        return out

    def hot_swap_tensors(self, dtype: torch.dtype = torch.bfloat16) -> List[Tuple[str, torch.Tensor]]:
        """The trainable weights, as (name, tensor) for SGLang's ``update_weights_from_tensor``: never the embedding
        or the vocabulary maps, nor an lm_head the served drafter shares with the target (a push would rewrite the
        policy's own output head)."""
        skip = (*NOT_HOT_SWAPPED, *(("lm_head.weight",) if self.cfg.head_from_target else ()))
        return [(n, t) for n, t in self.checkpoint_tensors(dtype).items() if n not in skip]

    def save_pretrained(self, out_dir, dtype: torch.dtype = torch.bfloat16, layout: str = "sglang") -> Path:
        """config.json + model.safetensors (every tensor, d2t/t2d and the embedding included); ``layout``:
        ``"sglang"`` (``layers.0.*``) or ``"specforge"`` (``midlayer.*``), both loaded by SGLang and by us."""
        return write_checkpoint(out_dir, self.cfg.to_hf_dict(), self.checkpoint_tensors(dtype), layout)

    @classmethod
    def from_pretrained(cls, path, target_model=None) -> "Eagle3Drafter":
        """A drafter saved by us, SpecForge or another EAGLE-3 trainer (see ``respec/checkpoint.py``). Tensors the
        checkpoint may leave out come from ``target_model`` (the served HF model): the embedding, and the
        lm_head when the draft vocabulary is the target's. A config whose ``draft_vocab_size`` is null makes SGLang serve
        the target's lm_head in place of any the checkpoint has (``load_lm_head_from_target``): so does this
        drafter (given ``target_model``), and that head is frozen (``head_from_target``)."""
        cfg = DrafterConfig.from_hf_dict(read_config(path), getattr(target_model, "config", None))
        tensors = read_tensors(path)
        model = cls(cfg, t2d=vocab_tensors(tensors, cfg.vocab_size, cfg.draft_vocab_size))
        tensors.pop("t2d", None)
        tensors.pop("d2t", None)
        borrowed = {"embed_tokens.weight": "get_input_embeddings"}
        if cfg.draft_vocab_size == cfg.vocab_size:
            borrowed["lm_head.weight"] = "get_output_embeddings"
        if cfg.head_from_target and target_model is not None:
            tensors.pop("lm_head.weight", None)  # SGLang replaces it with the target's: so do we
        for name, getter in borrowed.items():
            if name not in tensors:
                if target_model is None:
                    raise KeyError(f"{path}: checkpoint lacks {name!r}; pass the target model to take it from")
                tensors[name] = getattr(target_model, getter)().weight.detach()
        model.load_named(tensors.items(), strict=False)
        missing = sorted(set(model.state_dict()) - set(tensors) - {"t2d", "d2t"})
        if missing:
            raise KeyError(f"{path}: checkpoint lacks {missing}")
        if cfg.head_from_target:
            model.lm_head.weight.requires_grad_(False)
        return model

    def load_named(self, named: Iterable[Tuple[str, torch.Tensor]], strict: bool = False) -> None:
        """Copy tensors by checkpoint name (also accepts SGLang's legacy ``midlayer.`` prefix)."""
        state = self.state_dict()
        seen = set()
        for name, t in named:
            name = name.replace("midlayer.", "layers.0.")
            if name not in state:
                raise KeyError(f"unknown drafter tensor {name!r}")
            if tuple(t.shape) != tuple(state[name].shape):
                raise ValueError(f"{name}: shape {tuple(t.shape)} != {tuple(state[name].shape)}")
            seen.add(name)
            with torch.no_grad():
                state[name].copy_(t.to(state[name].dtype))
        missing = set(state) - seen
        if strict and missing:
            raise KeyError(f"checkpoint lacks {sorted(missing)}")

    @classmethod
    def for_target(
        cls,
        target_model,
        draft_vocab_size: int,
        token_counts: Optional[torch.Tensor] = None,
        aux_layer_ids: Optional[Sequence[int]] = None,
        seed: int = 0,
    ) -> "Eagle3Drafter":
        """A fresh drafter for an HF Llama target: its embedding copied, vocab = most frequent tokens."""
        cfg = DrafterConfig.from_target(target_model.config, draft_vocab_size, aux_layer_ids)
        counts = token_counts if token_counts is not None else torch.zeros(cfg.vocab_size)
        torch.manual_seed(seed)
        model = cls(cfg, t2d=cls.select_vocab(counts, cfg.draft_vocab_size))
        for mod in model.modules():
            if isinstance(mod, nn.Linear):
                nn.init.normal_(mod.weight, std=0.02)
        with torch.no_grad():
            model.embed_tokens.weight.copy_(target_model.get_input_embeddings().weight.float())
            # Start the draft head from the target head's rows for the draft vocabulary (a good prior).
            head = target_model.get_output_embeddings().weight.float()
            model.lm_head.weight.copy_(head[model.t2d])
        return model


def shares_target_head(config: dict) -> bool:
    """SGLang's EAGLE-3 drafter of this config.json serves the target's lm_head tensor itself: its
    ``draft_vocab_size`` is null (``load_lm_head_from_target``) or its embeddings are tied."""
    return config.get("draft_vocab_size") is None or bool(config.get("tie_word_embeddings"))


def drafter_summary(model: Eagle3Drafter) -> dict:
    """Counts for logs and state endpoints."""
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    return {"config": dataclasses.asdict(model.cfg), "trainable_params": trainable}
