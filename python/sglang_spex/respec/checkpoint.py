"""EAGLE-3 drafter checkpoints on disk in the layout SpecForge trains and SGLang's ``LlamaForCausalLMEagle3`` loads:
a directory with ``config.json`` (``"architectures": ["LlamaForCausalLMEagle3"]``) and safetensors weights, one
``model.safetensors`` or shards listed in ``model.safetensors.index.json``.

Tensor names as SpecForge writes them: ``midlayer.*`` for the one decoder layer (SGLang maps it to ``layers.0``),
``fc.weight``, ``norm.weight``, ``lm_head.weight``, ``embed_tokens.weight`` (optional: SGLang uses the target's),
``d2t`` / ``t2d`` (optional: absent when the draft vocabulary is the whole target vocabulary). This module only
reads and writes the files and normalises names; building the model is ``drafter.Eagle3Drafter.from_pretrained``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Dict, Mapping, Optional

import torch

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
SPECFORGE_LAYER = "midlayer."
OUR_LAYER = "layers.0."
# Prefixes some exporters put in front of the drafter's own names (SGLang's module path, HF wrappers).
_STRIP = ("model.", "draft_model.")


def read_config(path) -> dict:
    p = Path(path) / CONFIG_FILE
    if not p.exists():
        raise FileNotFoundError(f"{path}: no {CONFIG_FILE}")
    return json.loads(p.read_text())


def normalize_name(name: str) -> str:
    """A checkpoint tensor name as our drafter calls it (``layers.0.`` for the decoder layer, no module prefix)."""
    for prefix in _STRIP:
        if name.startswith(prefix):
            name = name[len(prefix) :]
    return name.replace(SPECFORGE_LAYER, OUR_LAYER)


def read_tensors(path) -> Dict[str, torch.Tensor]:
    """Every tensor of the checkpoint directory (single file or index + shards), names normalised."""
    from safetensors.torch import load_file

    p = Path(path)
    if (p / INDEX_FILE).exists():
        shards = sorted(set(json.loads((p / INDEX_FILE).read_text())["weight_map"].values()))
    elif (p / WEIGHTS_FILE).exists():
        shards = [WEIGHTS_FILE]
    else:
        shards = sorted(f.name for f in p.glob("*.safetensors"))
    if not shards:
        raise FileNotFoundError(f"{path}: no safetensors weights ({WEIGHTS_FILE} or {INDEX_FILE})")
    out: Dict[str, torch.Tensor] = {}
    for shard in shards:
        for name, t in load_file(str(p / shard)).items():
            key = normalize_name(name)
            if key in out:
                raise ValueError(f"{path}: tensor {key!r} appears twice (as {name!r})")
            out[key] = t
    return out


def write_checkpoint(out_dir, config: dict, tensors: Mapping[str, torch.Tensor], layout: str = "specforge") -> Path:
    """``config.json`` + ``model.safetensors``; ``layout="specforge"`` names the decoder layer ``midlayer.``
    (SpecForge's files), ``"sglang"`` keeps ``layers.0.``. SGLang loads both."""
    from safetensors.torch import save_file

    if layout not in ("specforge", "sglang"):
        raise ValueError(f"layout must be specforge or sglang, got {layout!r}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    named = {
        (n.replace(OUR_LAYER, SPECFORGE_LAYER, 1) if layout == "specforge" and n.startswith(OUR_LAYER) else n): t
        for n, t in tensors.items()
    }
    save_file({n: t.contiguous() for n, t in named.items()}, str(out / WEIGHTS_FILE))
    (out / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")
    return out


def vocab_tensors(
    tensors: Mapping[str, torch.Tensor], vocab_size: int, draft_vocab_size: int
) -> Optional[torch.Tensor]:
    """The t2d mask from whichever of ``t2d`` / ``d2t`` the checkpoint has (``d2t[i]`` = target id − draft id);
    the identity mapping when neither is there and the draft vocabulary is the whole target vocabulary."""
    if "t2d" in tensors:
        t2d = tensors["t2d"].bool()
    elif "d2t" in tensors:
        ids = tensors["d2t"].long() + torch.arange(tensors["d2t"].numel())
        t2d = torch.zeros(vocab_size, dtype=torch.bool)
        t2d[ids] = True
    elif draft_vocab_size == vocab_size:
        return torch.ones(vocab_size, dtype=torch.bool)
    else:
        raise ValueError(f"checkpoint has neither t2d nor d2t but draft_vocab_size {draft_vocab_size} != {vocab_size}")
    if t2d.numel() != vocab_size or int(t2d.sum()) != draft_vocab_size:
        raise ValueError(
            f"t2d selects {int(t2d.sum())} of {t2d.numel()} ids; config says {draft_vocab_size} of {vocab_size}"
        )
    if "d2t" in tensors:
        expect = torch.nonzero(t2d).flatten() - torch.arange(draft_vocab_size)
        if not torch.equal(tensors["d2t"].long(), expect):
            raise ValueError("d2t and t2d disagree (d2t must map draft ids to the ascending ids t2d selects)")
    return t2d
