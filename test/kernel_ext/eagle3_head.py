"""A random EAGLE-3 draft head for a (tiny) Llama target, in the checkpoint format SGLang's LlamaForCausalLMEagle3 loads.

fc Linear(num_aux*H -> H), one decoder layer ("midlayer") whose attention takes [embeds, hidden] (2H), hidden_norm,
norm, lm_head over a reduced draft vocabulary with d2t (draft id -> target id offset) and t2d (target id in draft).
Random weights: acceptance is low, but greedy output with speculation must still equal greedy without it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Sequence

import torch
from safetensors.torch import load_file, save_file


def make_random_eagle3_head(
    target: Path, out: Path, aux_layer_ids: Sequence[int] = (-1, 0), draft_vocab: int = 200, seed: int = 0
) -> Path:
    """Write config.json + model.safetensors for a random EAGLE-3 head of ``target`` into ``out``."""
    cfg = json.loads((Path(target) / "config.json").read_text())
    h, inter, v = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    hd = cfg.get("head_dim") or h // cfg["num_attention_heads"]
    nq, nkv = cfg["num_attention_heads"] * hd, cfg["num_key_value_heads"] * hd
    g = torch.Generator().manual_seed(seed)

    def w(*shape):
        return (torch.randn(*shape, generator=g) * 0.05).to(torch.bfloat16)

    hot = torch.sort(torch.randperm(v, generator=g)[:draft_vocab]).values
    t2d = torch.zeros(v, dtype=torch.bool)
    t2d[hot] = True
    tensors = {
        "fc.weight": w(h, h * len(aux_layer_ids)),
        "midlayer.self_attn.q_proj.weight": w(nq, 2 * h),
        "midlayer.self_attn.k_proj.weight": w(nkv, 2 * h),
        "midlayer.self_attn.v_proj.weight": w(nkv, 2 * h),
        "midlayer.self_attn.o_proj.weight": w(h, nq),
        "midlayer.mlp.gate_proj.weight": w(inter, h),
        "midlayer.mlp.up_proj.weight": w(inter, h),
        "midlayer.mlp.down_proj.weight": w(h, inter),
        "midlayer.input_layernorm.weight": torch.ones(h, dtype=torch.bfloat16),
        "midlayer.post_attention_layernorm.weight": torch.ones(h, dtype=torch.bfloat16),
        "midlayer.hidden_norm.weight": torch.ones(h, dtype=torch.bfloat16),
        "norm.weight": torch.ones(h, dtype=torch.bfloat16),
        "lm_head.weight": w(draft_vocab, h),
        "d2t": hot - torch.arange(draft_vocab),
        "t2d": t2d,
    }
    embed = {k: t for k, t in load_file(str(Path(target) / "model.safetensors")).items() if "embed_tokens" in k}
    if embed:
        tensors["embed_tokens.weight"] = next(iter(embed.values())).to(torch.bfloat16)
    head_cfg = {
        **{k: cfg[k] for k in ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads")},
        "architectures": ["LlamaForCausalLMEagle3"],
        "model_type": "llama",
        "head_dim": hd,
        "num_hidden_layers": 1,
        "vocab_size": v,
        "draft_vocab_size": draft_vocab,
        "target_hidden_size": h,
        "rms_norm_eps": cfg.get("rms_norm_eps", 1e-6),
        "max_position_embeddings": cfg.get("max_position_embeddings", 2048),
        "rope_parameters": cfg.get("rope_parameters", {"rope_theta": 10000.0, "rope_type": "default"}),
        "hidden_act": "silu",
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": list(aux_layer_ids)},
    }
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(head_cfg, indent=2))
    save_file({k: t.contiguous() for k, t in tensors.items()}, str(out / "model.safetensors"))
    return out
