"""Run in a subprocess by the tests: instantiate SGLang's own LlamaForCausalLMEagle3 on CPU (no GPU, no server)
from a saved drafter's config.json, load the checkpoint (and optionally a hot-swap payload) through SGLang's
``load_weights``, and print a JSON report comparing every SGLang parameter with what we saved."""

from __future__ import annotations

import json
import os
import sys
from types import SimpleNamespace

os.environ["SGLANG_USE_CPU_ENGINE"] = "1"
os.environ.setdefault("HF_HUB_OFFLINE", "1")


def main(ckpt: str, target: str, payload_file: str = "") -> dict:
    import torch
    from safetensors.torch import load_file
    from sglang.srt.runtime_context import get_context, get_parallel
    from sglang.srt.server_args import ServerArgs
    from transformers import AutoConfig

    get_context().set_server_args(ServerArgs(model_path=target, device="cpu"))
    cfg = AutoConfig.from_pretrained(ckpt)
    from sglang.srt.models.llama_eagle3 import LlamaForCausalLMEagle3

    group = SimpleNamespace(is_last_rank=True, is_first_rank=True, world_size=1, rank_in_group=0)
    with get_parallel().override(
        tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_tp_rank=0, attn_tp_size=1, pp_group=group
    ):
        model = LlamaForCausalLMEagle3(cfg)
        params = dict(model.named_parameters())
        with torch.no_grad():
            for p in params.values():
                p.fill_(float("nan"))
        saved = load_file(os.path.join(ckpt, "model.safetensors"))
        model.load_weights(iter(saved.items()))
        report = {
            "config": {
                "draft_vocab_size": cfg.draft_vocab_size,
                "num_aux": model.model.num_aux_hidden_states,
                "hidden_size_in": model.model.hidden_size_in,
                "architectures": cfg.architectures,
                "load_lm_head_from_target": model.load_lm_head_from_target,
            }
        }
        report["params"] = {n: list(p.shape) for n, p in params.items()}
        report["checkpoint_diff"] = _diff(model, saved, cfg)
        report["hot_token_id_ok"] = bool(
            model.hot_token_id is not None
            and torch.equal(model.hot_token_id, saved["d2t"] + torch.arange(saved["d2t"].numel()))
        )
        if payload_file:
            from sglang.srt.utils import MultiprocessingSerializer

            with open(payload_file) as f:
                named = MultiprocessingSerializer.deserialize(json.load(f)[0])
            model.load_weights(iter(named))
            report["payload_names"] = [n for n, _ in named]
            report["payload_diff"] = _diff(model, dict(named), cfg, saved_embed=saved["embed_tokens.weight"])
    return report


def _diff(model, tensors, cfg, saved_embed=None) -> dict:
    """Max |SGLang param − expected| per SGLang parameter (NaN = not written); padding rows ignored."""
    import torch

    def get(name):
        return tensors[name].float()

    pre = "layers.0."
    expected = {
        "model.fc.weight": get("fc.weight"),
        "model.norm.weight": get("norm.weight"),
        "lm_head.weight": get("lm_head.weight"),
        "model.layers.0.self_attn.qkv_proj.weight": torch.cat(
            [get(pre + f"self_attn.{x}_proj.weight") for x in "qkv"], 0
        ),
        "model.layers.0.self_attn.o_proj.weight": get(pre + "self_attn.o_proj.weight"),
        "model.layers.0.mlp.gate_up_proj.weight": torch.cat(
            [get(pre + "mlp.gate_proj.weight"), get(pre + "mlp.up_proj.weight")], 0
        ),
        "model.layers.0.mlp.down_proj.weight": get(pre + "mlp.down_proj.weight"),
    }
    for norm in ("input_layernorm", "post_attention_layernorm", "hidden_norm"):
        expected[f"model.layers.0.{norm}.weight"] = get(pre + f"{norm}.weight")
    embed = tensors.get("embed_tokens.weight", saved_embed)
    expected["model.embed_tokens.weight"] = embed.float()
    out = {}
    for name, p in model.named_parameters():
        if name not in expected:
            out[name] = "unexpected parameter"
            continue
        e = expected[name]
        got = p.detach().float()[: e.shape[0]]
        out[name] = (
            float((got - e).abs().max()) if got.shape == e.shape else f"shape {list(got.shape)} vs {list(e.shape)}"
        )
    return out


if __name__ == "__main__":
    print("RESULT " + json.dumps(main(*sys.argv[1:])))
